"""SASS of the built CUDA kernels: disassembly, the main loop of a kernel, and what one pass of
that loop issues, by instruction class, per byte it loads.

The listing comes from ``cuobjdump`` (the ELF images of the extension module) and ``nvdisasm``
(each image), or ``cuobjdump -sass`` alone; both formats parse. For each kernel:

1. **The main loop.** Every backward branch ``BRA head`` at address ``a`` closes a loop
   ``[head, a]``; the main loop is the one whose body loads the most global bytes (the sum of its
   ``LDG`` widths), the innermost on a tie. For attention that is the K/V loop; for the cache
   kernels the copy loop.
2. **The hot path of one iteration.** The loop body is cut into basic blocks; an iteration
   enters at the head with weight 1 and every conditional forward branch passes the weight to one
   side, by what its predicate tests (``Branch.kind``):

   - ``rows``: an ``ISETP`` of a loop-invariant register computed in the kernel (not a kernel
     parameter) against a small immediate: the attention kernel's ``r < rows`` guards. The
     scenario gives ``rows`` (a GQA group's query heads in one tile, at most 4).
   - ``config``: a predicate that depends only on kernel parameters (constant bank, uniform
     registers, immediates): soft cap, the unaligned-cache byte loads, a non-power-of-two block
     size. The model takes the shorter side, which is the common configuration (features off,
     aligned caches, power-of-two blocks).
   - ``data``: anything else (block-table entries, token bounds, values): the guarded code runs,
     as it does for every full iteration of a long context, unless it calls a subroutine
     (``CALL``: the slow path of an IEEE division), which the model skips.
3. **Counts.** Each instruction of a block counts its block's weight; predicated instructions
   count too (they take an issue slot whatever their predicate). ``kv_bytes`` is 32 lanes times
   the width of the loop's widest ``LDG`` (16 B for 16-bit caches, 8 B for fp8) summed over those
   loads; narrower loads (block-table entries) are counted as instructions only.
"""

from __future__ import annotations

import bisect
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CLASSES", "Branch", "Instruction", "Kernel", "LoopProfile", "classify",
           "disassemble", "find_tool", "loops", "main_loop", "parse_listing", "profile_loop",
           "resource_usage"]

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-6]\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LABEL = re.compile(r"^([.$\w]+):$")
_PRED = re.compile(r"^!?U?P[T0-6]$")


@dataclass(frozen=True, slots=True)
class Instruction:
    address: int
    guard: str  # "" or the predicate that guards it ("P1", "!P1", "UP0")
    opcode: str  # with its modifiers: "LDG.E.128.CONSTANT"
    operands: tuple[str, ...]
    target: int | None = None  # branch and call targets
    op: str = ""  # the opcode without modifiers: "LDG"

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", self.opcode.split(".")[0])

    def writes(self) -> tuple[str, ...]:
        """Registers and predicates this instruction writes (its destination operands)."""
        ops = self.operands
        if not ops or self.op in _NO_DEST:
            return ()
        if _PRED.match(ops[0]):  # ISETP P1, PT, ...: two predicate destinations
            return tuple(o for o in ops[:2] if _PRED.match(o))
        if len(ops) > 2 and _PRED.match(ops[1]) and self.op in _CARRY_OUT:
            return ops[0], ops[1]  # IADD3 R4, P1, ...: a carry-out predicate
        return ops[:1]


_NO_DEST = {"BRA", "BSSY", "BSYNC", "CALL", "EXIT", "RET", "WARPSYNC", "BAR", "STG", "STS", "ST",
            "STL", "RED", "NOP", "DEPBAR", "MEMBAR", "ERRBAR", "CCTL", "YIELD", "BPT"}
_CARRY_OUT = {"IADD3", "LEA", "IMAD", "UIADD3", "ULEA", "UIMAD", "IADD"}


@dataclass(slots=True)
class Kernel:
    name: str  # mangled
    arch: str  # "sm_90"
    instructions: list[Instruction]
    demangled: str = ""
    _index: dict[int, int] = field(default_factory=dict, repr=False)
    _writers: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _profiles: dict[int, LoopProfile | None] = field(default_factory=dict, repr=False)

    def writers(self, reg: str) -> list[int]:
        """Indices of the instructions that write ``reg``, in order."""
        if not self._writers and self.instructions:
            for i, insn in enumerate(self.instructions):
                for r in insn.writes():
                    self._writers.setdefault(r, []).append(i)
        return self._writers.get(reg, [])

    def at(self, address: int) -> int:
        """Index of the instruction at ``address``."""
        if len(self._index) != len(self.instructions):
            self._index = {insn.address: i for i, insn in enumerate(self.instructions)}
        return self._index[address]


# parsing ------------------------------------------------------------------------------------

def parse_listing(text: str, arch: str = "") -> list[Kernel]:
    """Kernels of a ``cuobjdump -sass`` or ``nvdisasm`` listing, in listing order."""
    kernels: list[Kernel] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    raw: list[tuple[int, str, str, str]] = []

    def close() -> None:
        if kernels:
            kernels[-1].instructions = [_instruction(a, g, o, s, labels) for a, g, o, s in raw]
        raw.clear(), labels.clear(), pending.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if m := re.match(r"(?:arch = |\.target\s+|code for )(sm_\d+a?)", stripped):
            arch = m.group(1)
        elif m := re.match(r'\.headerflags\s+@"EF_CUDA_SM(\d+)', stripped):
            arch = kernels[-1].arch = f"sm_{m.group(1)}" if kernels else arch
        elif m := re.match(r"(?:Function : |\.text\.)(\S+?):?$", stripped):
            close()
            kernels.append(Kernel(m.group(1), arch, []))
        elif m := _LABEL.match(stripped):
            pending.append(m.group(1))
        elif kernels and (m := _INSN.search(line)):
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending.clear()
            raw.append((address, (m.group(2) or "").strip().lstrip("@"), m.group(3),
                        m.group(4).strip()))
    close()
    return kernels


def _instruction(address: int, guard: str, opcode: str, text: str,
                 labels: dict[str, int]) -> Instruction:
    operands = tuple(o.strip().replace(".reuse", "") for o in text.split(",")) if text else ()
    target = None
    if opcode.split(".")[0] in ("BRA", "CALL", "BSSY") and operands:
        last = operands[-1].strip("`() ").split()[-1]
        target = labels.get(last) if last in labels else _hex(last)
    return Instruction(address, guard, opcode, operands, target)


def _hex(text: str) -> int | None:
    try:
        return int(text, 16)
    except ValueError:
        return None


# tools --------------------------------------------------------------------------------------

def find_tool(name: str) -> str | None:
    """``name`` (cuobjdump, nvdisasm) on PATH, in $CUDA_HOME/bin, or in triton's bundled bin."""
    found = shutil.which(name)
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    try:
        import triton

        roots.append(str(Path(triton.__file__).parent / "backends" / "nvidia"))
    except ImportError:
        pass
    for root in filter(None, roots):
        path = Path(root) / "bin" / name
        if path.is_file():
            return str(path)
    return None


def disassemble(binary: str | Path, images: str = "", cuobjdump: str | None = None,
                nvdisasm: str | None = None) -> list[Kernel]:
    """Every kernel of the ELF images in ``binary`` (an extension module, a cubin or an object
    file) whose image name contains ``images`` (``attention_bf16``; "" for all). RuntimeError
    when cuobjdump is missing or fails."""
    cuobjdump = cuobjdump or find_tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found (PATH, $CUDA_HOME/bin, triton's bundled tools)")
    nvdisasm = nvdisasm or find_tool("nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        _run([cuobjdump, "-xelf", "all", str(Path(binary).resolve())], cwd=tmp)
        cubins = [c for c in sorted(Path(tmp).glob("*.cubin")) if images in c.name]
        if nvdisasm is None:  # slower: cuobjdump disassembles each image itself
            commands = [[cuobjdump, "-sass", str(c)] for c in cubins]
        else:
            commands = [[nvdisasm, "-c", str(c)] for c in cubins]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            listings = list(pool.map(_run, commands))
    kernels = [k for text in listings for k in parse_listing(text)]
    names = _demangle([k.name for k in kernels])
    for kernel, name in zip(kernels, names, strict=True):
        kernel.demangled = name
    return kernels


def resource_usage(binary: str | Path, cuobjdump: str | None = None) -> dict[tuple[str, str],
                                                                              dict[str, int]]:
    """``(arch, mangled name) -> {"REG": .., "SHARED": .., "LOCAL": .., ...}`` from
    ``cuobjdump -res-usage``."""
    text = _run([cuobjdump or find_tool("cuobjdump") or "cuobjdump", "-res-usage", str(binary)])
    usage, arch, name = {}, "", ""
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(r"arch = (sm_\d+a?)", line):
            arch = m.group(1)
        elif m := re.match(r"Function (\S+):$", line):
            name = m.group(1)
        elif line.startswith("REG:") and name:
            usage[(arch, name)] = {k: int(v) for k, v in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)",
                                                                        line)}
    return usage


def _run(cmd: list[str], cwd: str | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}): "
                           f"{done.stderr.strip()[:500]}")
    return done.stdout


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    return lines if out.returncode == 0 and len(lines) == len(names) else list(names)


# classes ------------------------------------------------------------------------------------

CLASSES = ("ffma", "fadd", "fmul", "fp32_other", "half", "convert", "mufu", "shfl", "int",
           "predicate", "move", "uniform", "branch", "ldg", "lds", "ldc", "store", "sync",
           "other")
"""Instruction classes, in report order."""

_BY_OP = {
    "FFMA": "ffma", "FADD": "fadd", "FMUL": "fmul", "FMNMX": "fp32_other",
    "FSWZADD": "fp32_other", "FRND": "fp32_other",
    "HFMA2": "half", "HADD2": "half", "HMUL2": "half", "HMNMX2": "half",
    "F2F": "convert", "F2FP": "convert", "I2F": "convert", "F2I": "convert",
    "I2FP": "convert", "F2IP": "convert", "PRMT": "convert",
    "MUFU": "mufu", "SHFL": "shfl",
    "IMAD": "int", "IADD3": "int", "IADD": "int", "LEA": "int", "SHF": "int", "LOP3": "int",
    "IABS": "int", "VIADD": "int", "VIMNMX": "int", "IMNMX": "int", "POPC": "int", "FLO": "int",
    "SGXT": "int", "BMSK": "int", "IMUL": "int", "BREV": "int", "IDP": "int",
    "ISETP": "predicate", "FSETP": "predicate", "PLOP3": "predicate", "SEL": "predicate",
    "FSEL": "predicate", "FCHK": "predicate", "P2R": "predicate", "R2P": "predicate",
    "VOTE": "predicate", "HSETP2": "predicate",
    "MOV": "move", "CS2R": "move", "S2R": "move", "S2UR": "move",
    "BRA": "branch", "BSSY": "branch", "BSYNC": "branch", "WARPSYNC": "branch",
    "EXIT": "branch", "CALL": "branch", "RET": "branch",
    "LDG": "ldg", "LDS": "lds", "LDSM": "lds", "LDC": "ldc", "LD": "ldg",
    "STG": "store", "STS": "store", "ST": "store", "STL": "store", "RED": "store",
    "ATOM": "store", "ATOMS": "store",
    "BAR": "sync", "MEMBAR": "sync", "DEPBAR": "sync",
}


def classify(insn: Instruction) -> str:
    """The class of one instruction (one of ``CLASSES``).

    bf16 -> fp32 widening is bit work: a 16-bit left shift (``SHF.L.U32 d, s, 0x10`` or
    ``IMAD.U32 d, s, 0x10000``) or a mask of the high half (``LOP3.LUT d, s, 0xffff0000``); those
    count as ``convert``. Moves in disguise (``IMAD.MOV``, ``HFMA2.MMA d, -RZ, RZ, ...``, which
    the compiler uses to set a constant) count as ``move``."""
    op, ops = insn.op, insn.operands
    if op == "IMAD" and insn.opcode.startswith("IMAD.MOV"):
        return "move"
    if op == "HFMA2" and ".MMA" in insn.opcode and ops[1:3] == ("-RZ", "RZ"):
        return "move"
    if len(ops) >= 3 and ((op == "SHF" and insn.opcode.startswith("SHF.L.U32") and ops[2] == "0x10")
                          or (insn.opcode == "IMAD.U32" and ops[2] == "0x10000")
                          or (op == "LOP3" and ops[2] == "0xffff0000")):
        return "convert"
    if op.startswith("U") and op not in _BY_OP:
        return "uniform"
    return _BY_OP.get(op, "other")


def load_bytes(insn: Instruction) -> int:
    """Bytes one lane loads with an LDG (0 for other instructions)."""
    if insn.op not in ("LDG", "LD"):
        return 0
    for part, size in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1),
                       (".S8", 1)):
        if part in insn.opcode:
            return size
    return 4


# loops and the hot path -----------------------------------------------------------------------

def loops(kernel: Kernel) -> list[tuple[int, int]]:
    """``(first, last)`` instruction indices of every loop: a backward branch and its target."""
    found = []
    for i, insn in enumerate(kernel.instructions):
        if insn.op == "BRA" and insn.target is not None and insn.target <= insn.address:
            found.append((kernel.at(insn.target), i))
    return found


def main_loop(kernel: Kernel) -> tuple[int, int] | None:
    """The loop loading the most global bytes per pass (static), the innermost on a tie."""
    best, key = None, (0, 0)
    for first, last in loops(kernel):
        loaded = sum(load_bytes(i) for i in kernel.instructions[first:last + 1])
        k = (loaded, -(last - first))
        if loaded and k > key:
            best, key = (first, last), k
    return best


@dataclass(frozen=True, slots=True)
class Branch:
    address: int
    kind: str  # "rows", "config" or "data"
    taken: float  # probability the scenario gives it
    test: str  # the instruction that set its predicate


@dataclass(slots=True)
class LoopProfile:
    """What one pass of a kernel's main loop issues on the hot path (one warp)."""

    kernel: str
    arch: str
    first: int  # address of the loop head
    last: int  # address of the backward branch
    static_instructions: int
    instructions: float
    kv_bytes: float  # bytes of the widest global loads, 32 lanes
    load_width: int  # bytes per lane of those loads
    classes: dict[str, float] = field(default_factory=dict)
    branches: list[Branch] = field(default_factory=list)

    @property
    def per_byte(self) -> float:
        return self.instructions / self.kv_bytes

    def class_per_kib(self) -> dict[str, float]:
        """Instructions of each class per KiB of K/V."""
        return {c: n * 1024 / self.kv_bytes for c, n in self.classes.items()}


def profile_loop(kernel: Kernel, rows: int = 4) -> LoopProfile | None:
    """The hot path of ``kernel``'s main loop with ``rows`` query rows per tile (None: no loop)."""
    if rows not in kernel._profiles:
        kernel._profiles[rows] = _profile(kernel, rows)
    return kernel._profiles[rows]


def _profile(kernel: Kernel, rows: int) -> LoopProfile | None:
    span = main_loop(kernel)
    if span is None:
        return None
    first, last = span
    body = kernel.instructions[first:last + 1]
    weights, branches = _weights(kernel, first, last, rows)
    width = max(load_bytes(i) for i in body)
    counts: Counter[str] = Counter()
    kv = 0.0
    for insn, w in zip(body, weights, strict=True):
        counts[classify(insn)] += w
        if load_bytes(insn) == width:
            kv += 32 * width * w
    classes = {c: counts[c] for c in CLASSES if counts[c]}
    return LoopProfile(kernel.demangled or kernel.name, kernel.arch, body[0].address,
                       body[-1].address, len(body), sum(weights), kv, width, classes, branches)


def _weights(kernel: Kernel, first: int, last: int,
             rows: int) -> tuple[list[float], list[Branch]]:
    """Per instruction of the loop body: how often one pass executes it."""
    insns = kernel.instructions
    written = {r for i in insns[first:last + 1] for r in i.writes()}
    flow = [0.0] * (last - first + 2)  # weight arriving at each index (+1: leaving the loop)
    flow[0] = 1.0
    weights, branches = [], []
    for i in range(first, last + 1):
        w = flow[i - first]
        weights.append(w)
        insn = insns[i]
        if insn.op == "EXIT" and not insn.guard:
            continue
        if insn.op != "BRA" or insn.target is None or not first <= kernel.at(insn.target) <= last:
            flow[i - first + 1] += w
            continue
        j = kernel.at(insn.target)
        if j <= i:  # the loop's own back edge ends the pass; an inner loop counts once
            taken = 1.0 if i == last or not insn.guard else 0.0
        elif not insn.guard:
            taken = 1.0
        else:
            branch = _branch(kernel, i, j, first, last, written, rows)
            branches.append(branch)
            taken = branch.taken
        if j > i:
            flow[j - first] += w * taken
        flow[i - first + 1] += w * (1 - taken)
    return weights, branches


def _branch(kernel: Kernel, i: int, j: int, first: int, last: int, written: set[str],
            rows: int) -> Branch:
    insns = kernel.instructions
    insn = insns[i]
    negated = insn.guard.startswith("!")
    pred = insn.guard.lstrip("!")
    test = _definition(kernel, pred, i, (first, last))
    skipped = insns[i + 1:j]
    if test is not None and (value := _rows_test(kernel, test, written, first, rows)) is not None:
        kind, taken = "rows", float(value != negated)
    elif test is not None and _uniform(kernel, test, (first, last), set()):
        then_len = len(skipped)
        else_len = 0
        if skipped and skipped[-1].op == "BRA" and not skipped[-1].guard and (
                skipped[-1].target or 0) > insns[j].address:
            then_len -= 1
            else_len = kernel.at(skipped[-1].target) - j
        kind, taken = "config", float(then_len > else_len)
    else:
        kind, taken = "data", float(_slow_path(kernel, i, j))
    text = f"{test.opcode} {', '.join(test.operands)}" if test else "(no definition found)"
    return Branch(insn.address, kind, taken, text)


def _slow_path(kernel: Kernel, i: int, j: int) -> bool:
    """Whether the code a branch at ``i`` skips (up to ``j``) is a slow path: it calls a
    subroutine or loops, and no branch inside it guards that call or loop on its own."""
    insns = kernel.instructions
    inner = [(k, kernel.at(insns[k].target)) for k in range(i + 1, j)
             if insns[k].op == "BRA" and insns[k].guard and insns[k].target is not None
             and insns[k].target > insns[k].address]
    for s in range(i + 1, j):
        slow = insns[s].op == "CALL" or (insns[s].op == "BRA" and insns[s].target is not None
                                          and insns[s].target <= insns[s].address)
        if slow and not any(k < s < end for k, end in inner):
            return True
    return False


def _definition(kernel: Kernel, reg: str, i: int, loop: tuple[int, int]) -> Instruction | None:
    """The instruction that last wrote ``reg`` before index ``i``, in layout order; inside
    ``loop`` (first, last): earlier in the loop, else later in it (the previous pass), else
    before the loop."""
    writers = kernel.writers(reg)
    first, last = loop
    at = bisect.bisect_left(writers, i)
    if first <= i <= last:
        start = bisect.bisect_left(writers, first)
        end = bisect.bisect_right(writers, last)
        if start < at:  # earlier in this pass
            return kernel.instructions[writers[at - 1]]
        if end > at and writers[end - 1] > i:  # later in the loop: the previous pass
            return kernel.instructions[writers[end - 1]]
        at = start
    return kernel.instructions[writers[at - 1]] if at else None


_IMM = re.compile(r"^-?(0x[0-9a-f]+|\d+)$")


def _rows_test(kernel: Kernel, test: Instruction, written: set[str], first: int,
               rows: int) -> bool | None:
    """The value of ``ISETP.<cmp> P, PT, R, imm, PT`` when R is loop-invariant and computed in
    the kernel (the tile's row count), with R = ``rows``; None for any other test. A copy of a
    uniform predicate (``PLOP3.LUT P, PT, PT, PT, UP0, 0x80, 0x0``) is followed to ``UP0``'s
    ``UISETP``."""
    ops = test.operands
    if test.opcode == "PLOP3.LUT" and ops[1:4] == ("PT", "PT", "PT") and ops[5:] == ("0x80", "0x0"):
        source = _definition(kernel, ops[4].lstrip("!"), kernel.at(test.address), (-1, -1))
        value = source and _rows_test(kernel, source, written, first, rows)
        return None if value is None else value != ops[4].startswith("!")
    if test.op not in ("ISETP", "UISETP") or len(ops) != 5 or ops[4] not in ("PT", "UPT"):
        return None
    reg, imm = test.operands[2], test.operands[3]
    if not re.match(r"^U?R\d+$", reg) or not _IMM.match(imm) or reg in written:
        return None
    k = int(imm, 0)
    if not 0 <= k <= 8:
        return None
    source = _definition(kernel, reg, first, (-1, -1))
    if source is None or _uniform(kernel, source, (-1, -1), set()):
        return None
    cmp = test.opcode.split(".")[1]
    result = {"GE": rows >= k, "GT": rows > k, "LT": rows < k, "LE": rows <= k,
              "EQ": rows == k, "NE": rows != k}.get(cmp)
    if result is None:
        return None
    return result if ".OR" not in test.opcode else None


def _uniform(kernel: Kernel, insn: Instruction, loop: tuple[int, int], seen: set[int]) -> bool:
    """Whether ``insn`` computes only from kernel parameters, uniform registers and constants."""
    if insn.address in seen:
        return True
    seen.add(insn.address)
    if insn.op in ("LDG", "LDS", "LD", "S2R", "S2UR", "SHFL", "CS2R", "VOTE"):
        return False
    index = kernel.at(insn.address)
    for operand in insn.operands[len(insn.writes()):]:
        operand = operand.lstrip("-!|").rstrip("|")
        if re.match(r"^(U?R\d+|U?P[0-6])(\.|$)", operand):
            reg = operand.split(".")[0]
            source = _definition(kernel, reg, index, loop)
            if source is None or not _uniform(kernel, source, loop, seen):
                return False
    return True
