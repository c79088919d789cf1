"""SASS of the built CUDA kernels: disassembly, parsing, and the class of each instruction.

The listing comes from ``cuobjdump`` (the ELF images of the extension module) and ``nvdisasm``
(each image), or ``cuobjdump -sass`` alone; both formats parse. ``bench.sass.loop`` finds a
kernel's main loop and counts its hot path (docs/gpu_model.md).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CLASSES", "Instruction", "Kernel", "classify", "disassemble", "disassemble_function",
           "find_tool", "load_bytes", "parse_listing", "resource_usage"]

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
            "STL", "RED", "NOP", "DEPBAR", "LDGSTS", "LDGDEPBAR", "MEMBAR", "ERRBAR", "CCTL",
            "YIELD", "BPT"}
_CARRY_OUT = {"IADD3", "LEA", "IMAD", "UIADD3", "ULEA", "UIMAD", "IADD"}


@dataclass(slots=True, eq=False)  # compared and hashed by identity
class Kernel:
    name: str  # mangled
    arch: str  # "sm_90"
    instructions: list[Instruction]
    demangled: str = ""
    _index: dict[int, int] = field(default_factory=dict, repr=False)
    _writers: dict[str, list[int]] = field(default_factory=dict, repr=False)

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


def disassemble_function(binary: str | Path, name: str, arch: str, cache: Path) -> list[Kernel]:
    """The kernels of ``binary``'s ``arch`` images whose mangled name contains ``name``.

    For a large library (torch's libtorch_cuda.so holds thousands of images): the images of
    ``arch`` are extracted, only those holding ``name`` disassembled, and the listing of the
    matching kernels written to ``cache`` (a folder), keyed by the binary's size and time and
    by ``name``, so that the next call parses that file alone."""
    path = Path(binary).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{arch}|{name}".encode())
    listing = Path(cache) / f"{path.name}.{arch}.{key.hexdigest()[:16]}.sass"
    if not listing.is_file():
        text = _function_listing(path, name, arch)
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.with_suffix(".partial").write_text(text)
        listing.with_suffix(".partial").replace(listing)
    kernels = parse_listing(listing.read_text(), arch)
    for kernel, demangled in zip(kernels, _demangle([k.name for k in kernels]), strict=True):
        kernel.demangled = demangled
    return kernels


def _function_listing(binary: Path, name: str, arch: str) -> str:
    """nvdisasm's listing of the kernels named ``name`` in ``binary``'s ``arch`` images."""
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        raise RuntimeError("cuobjdump and nvdisasm are needed (PATH, $CUDA_HOME/bin, triton)")
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        _run([cuobjdump, "-xelf", f"{arch}.", str(binary)], cwd=tmp)
        for image in sorted(Path(tmp).glob(f"*.{arch}.cubin")):
            if name.encode() in image.read_bytes():
                text = _run([nvdisasm, "-c", str(image)])
                sections += [s for s in re.split(r"(?m)^(?=\.text\.)", text)
                             if s.startswith(".text.") and name in s.split(":", 1)[0]]
    return f"\t.target\t{arch}\n" + "".join(sections)


def resource_usage(binary: str | Path, cuobjdump: str | None = None,
                   arch: str = "") -> dict[tuple[str, str], dict[str, int]]:
    """``(arch, mangled name) -> {"REG": .., "SHARED": .., "LOCAL": .., ...}`` from
    ``cuobjdump -res-usage``; ``arch`` for a cubin, whose listing does not name it."""
    text = _run([cuobjdump or find_tool("cuobjdump") or "cuobjdump", "-res-usage", str(binary)])
    usage, name = {}, ""
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
    """The command's output; "" for a binary without device code (a CPU-only build)."""
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0 and "does not contain device code" in done.stdout + done.stderr:
        return ""
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

CLASSES = ("ffma", "fadd", "fmul", "fp32_other", "half", "convert", "mufu", "shfl", "mma",
           "int", "predicate", "move", "uniform", "branch", "ldg", "lds", "ldc", "store", "sync",
           "other")
"""Instruction classes, in report order."""

_BY_OP = {
    "FFMA": "ffma", "FADD": "fadd", "FMUL": "fmul", "FMNMX": "fp32_other",
    "FSWZADD": "fp32_other", "FRND": "fp32_other",
    "HFMA2": "half", "HADD2": "half", "HMUL2": "half", "HMNMX2": "half",
    "F2F": "convert", "F2FP": "convert", "I2F": "convert", "F2I": "convert",
    "I2FP": "convert", "F2IP": "convert", "PRMT": "convert",
    "MUFU": "mufu", "SHFL": "shfl", "HMMA": "mma", "IMMA": "mma",
    "IMAD": "int", "IADD3": "int", "IADD": "int", "LEA": "int", "SHF": "int", "LOP3": "int",
    "IABS": "int", "VIADD": "int", "VIMNMX": "int", "IMNMX": "int", "POPC": "int", "FLO": "int",
    "SGXT": "int", "BMSK": "int", "IMUL": "int", "BREV": "int", "IDP": "int",
    "ISETP": "predicate", "FSETP": "predicate", "PLOP3": "predicate", "SEL": "predicate",
    "FSEL": "predicate", "FCHK": "predicate", "P2R": "predicate", "R2P": "predicate",
    "VOTE": "predicate", "HSETP2": "predicate",
    "MOV": "move", "CS2R": "move", "S2R": "move", "S2UR": "move",
    "BRA": "branch", "BSSY": "branch", "BSYNC": "branch", "WARPSYNC": "branch",
    "EXIT": "branch", "CALL": "branch", "RET": "branch",
    "LDG": "ldg", "LDGSTS": "ldg", "LDS": "lds", "LDSM": "lds", "LDC": "ldc", "LD": "ldg",
    "STG": "store", "STS": "store", "ST": "store", "STL": "store", "RED": "store",
    "ATOM": "store", "ATOMS": "store",
    "BAR": "sync", "MEMBAR": "sync", "DEPBAR": "sync", "LDGDEPBAR": "sync",
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
    """Bytes one lane loads from global memory with an LDG or LDGSTS (cp.async; 0 for other
    instructions)."""
    if insn.op not in ("LDG", "LD", "LDGSTS"):
        return 0
    for part, size in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1),
                       (".S8", 1)):
        if part in insn.opcode:
            return size
    return 4
