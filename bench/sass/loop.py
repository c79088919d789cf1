"""The main loop of a kernel and what one pass of it issues, by instruction class, per byte it
loads (docs/gpu_model.md).

1. **The main loop.** Every backward branch ``BRA head`` at address ``a`` closes a loop
   ``[head, a]``; the main loop is the one whose body loads the most global bytes (the sum of its
   ``LDG`` and ``LDGSTS`` widths), the shortest on a tie. For attention that is the K/V loop; for
   the cache kernels the copy loop. In a kernel with tensor-core loops it is the innermost loop
   with ``HMMA`` (one that holds no other loop with ``HMMA``; of several, the one with the most
   ``HMMA``, then the most bytes, then the shortest): the key-tile loop, not a copy loop, and
   where the kernel nests its unmasked key-tile loop in a loop that also holds the masked body,
   the unmasked one, which runs the interior tiles (the common path). A loop is nested in
   another when its head is later and its back edge not after (back edges to one head close
   one loop each, as for the decode kernels). The HMMA loop right around the main loop, if any,
   is the boundary loop (``boundary_loop``): one pass of it outside the main loop is a masked
   tile (``profile_loop(..., boundary=True)``).
2. **The hot path of one iteration.** The loop body is cut into basic blocks; an iteration
   enters at the head with weight 1 and every conditional forward branch passes the weight to one
   side, by what its predicate tests (``Branch.kind``):

   - ``rows``: an ``ISETP`` of a loop-invariant register computed in the kernel (not a kernel
     parameter) against a small immediate, also through a copy of a uniform predicate: the
     attention kernel's ``r < rows`` guards. The scenario gives ``rows`` (a GQA group's query
     heads in one tile, at most 4).
   - ``config``: a predicate that depends only on kernel parameters (constant bank, uniform
     registers, immediates): soft cap, the unaligned-cache byte loads, a non-power-of-two block
     size. The model takes the shorter side, which is the common configuration (features off,
     aligned caches, power-of-two blocks), except where only one side holds tensor-core work
     (``HMMA``, ``LDGSTS``): that side runs (the tensor-core kernel's head-size guards).
   - ``data``: anything else (block-table entries, token bounds, values): the guarded code runs,
     as it does for every full iteration of a long context, unless it is a slow path: it calls
     a subroutine (``CALL``: an IEEE division's special cases) or loops, and no branch inside
     guards that call or loop on its own. Inner loops count once. Where only one side (of an
     if, or of an if / else) holds tensor-core work (``HMMA``, ``LDGSTS``), that side runs:
     the next tile's copies, which every tile but the last issues.
   - ``boundary``: in a pass of the boundary loop, a branch of which one side runs into the main
     loop (starts in it or falls through to its head) takes the other side, the masked body.
3. **Counts.** Each instruction of a block counts its block's weight; predicated instructions
   count too (they take an issue slot whatever their predicate). ``kv_bytes`` is 32 lanes times
   the width of the loop's widest ``LDG`` (16 B for 16-bit caches, 8 B for fp8) summed over those
   loads; narrower loads (block-table entries) are counted as instructions only. ``opcodes``
   counts each opcode with its modifiers (``HMMA.16816.F32.BF16``, ``LDSM.16.M88.4``) the same
   way, for the tensor-core model (``bench.sass.tensor_core``).

Profiles are cached here, per kernel (by identity) and row count.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections import Counter
from dataclasses import dataclass, field

from bench.sass.disasm import CLASSES, Instruction, Kernel, classify, load_bytes

__all__ = ["Branch", "LoopProfile", "boundary_loop", "loops", "main_loop", "profile_loop"]


def loops(kernel: Kernel) -> list[tuple[int, int]]:
    """``(first, last)`` instruction indices of every loop: a backward branch and its target."""
    found = []
    for i, insn in enumerate(kernel.instructions):
        if insn.op == "BRA" and insn.target is not None and insn.target <= insn.address:
            found.append((kernel.at(insn.target), i))
    return found


def main_loop(kernel: Kernel) -> tuple[int, int] | None:
    """The main loop (module docstring, 1): of the loops that load from global memory and hold
    HMMA, the innermost (holding no other such loop), the one with the most HMMA, then the most
    global bytes loaded per pass (static), then the shortest; in a kernel without HMMA the same
    order on bytes alone. None when no loop loads from global memory."""
    spans = _loop_spans(kernel)
    tensor = [s for s in spans if spans[s][0]]
    candidates = [s for s in tensor if not any(_holds(s, t) for t in tensor)] or list(spans)
    return max(candidates, key=lambda s: (*spans[s], s[0] - s[1]), default=None)


def boundary_loop(kernel: Kernel) -> tuple[int, int] | None:
    """The HMMA loop right around the main loop (the key-tile loop that holds the masked body
    beside the unmasked loop); None where the main loop is the outermost."""
    inner = main_loop(kernel)
    spans = _loop_spans(kernel)
    around = [s for s in spans if inner and spans[s][0] and _holds(s, inner)]
    return min(around, key=lambda s: s[1] - s[0], default=None)


def _loop_spans(kernel: Kernel) -> dict[tuple[int, int], tuple[int, int]]:
    """``(first, last) -> (HMMA, global bytes)`` of every loop that loads from global memory."""
    spans = {}
    for first, last in loops(kernel):
        body = kernel.instructions[first:last + 1]
        loaded = sum(load_bytes(i) for i in body)
        if loaded:
            spans[first, last] = (sum(i.op == "HMMA" for i in body), loaded)
    return spans


def _holds(outer: tuple[int, int], inner: tuple[int, int]) -> bool:
    """Whether loop ``inner`` is nested in ``outer``: its head later, its back edge not after
    (two back edges to one head close one loop, not two nested ones)."""
    return outer[0] < inner[0] and inner[1] <= outer[1]


@dataclass(frozen=True, slots=True)
class Branch:
    address: int
    kind: str  # "rows", "config", "data" or "boundary"
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
    opcodes: dict[str, float] = field(default_factory=dict)  # with modifiers, weighted
    static_opcodes: dict[str, int] = field(default_factory=dict)  # the whole body, once each

    def count(self, prefix: str, static: bool = False) -> float:
        """Instructions whose opcode starts with ``prefix`` ("HMMA", "LDSM.16.MT88"), on the hot
        path (weighted) or in the whole body (``static``)."""
        table = self.static_opcodes if static else self.opcodes
        return sum(n for op, n in table.items() if op.startswith(prefix))

    @property
    def per_byte(self) -> float:
        return self.instructions / self.kv_bytes

    def class_per_kib(self) -> dict[str, float]:
        """Instructions of each class per KiB of K/V."""
        return {c: n * 1024 / self.kv_bytes for c, n in self.classes.items()}


@functools.lru_cache(maxsize=4096)
def profile_loop(kernel: Kernel, rows: int = 4, boundary: bool = False) -> LoopProfile | None:
    """The hot path of ``kernel``'s main loop with ``rows`` query rows per tile (None: no loop);
    with ``boundary``, of one pass of the boundary loop that does not enter the main loop (a
    masked tile; None where there is no boundary loop). A boundary profile's static counts are
    its loop's body without the main loop's."""
    inner = main_loop(kernel)
    span = boundary_loop(kernel) if boundary else inner
    if span is None:
        return None
    first, last = span
    avoid = inner if boundary else None
    weights, branches = _weights(kernel, first, last, rows, avoid)
    body = kernel.instructions[first:last + 1]
    if avoid is not None:
        keep = [not avoid[0] <= first + n <= avoid[1] for n in range(len(body))]
        body = [i for i, k in zip(body, keep, strict=True) if k]
        weights = [w for w, k in zip(weights, keep, strict=True) if k]
    width = max(load_bytes(i) for i in body)
    counts: Counter[str] = Counter()
    opcodes: Counter[str] = Counter()
    kv = 0.0
    for insn, w in zip(body, weights, strict=True):
        counts[classify(insn)] += w
        opcodes[insn.opcode] += w
        if load_bytes(insn) == width:
            kv += 32 * width * w
    classes = {c: counts[c] for c in CLASSES if counts[c]}
    return LoopProfile(kernel.demangled or kernel.name, kernel.arch, body[0].address,
                       body[-1].address, len(body), sum(weights), kv, width, classes, branches,
                       {op: n for op, n in opcodes.items() if n},
                       dict(Counter(i.opcode for i in body)))


def _weights(kernel: Kernel, first: int, last: int, rows: int,
             avoid: tuple[int, int] | None = None) -> tuple[list[float], list[Branch]]:
    """Per instruction of the loop body: how often one pass executes it; a pass that does not
    enter the loop ``avoid`` (first, last indices) where given."""
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
            branch = _branch(kernel, i, j, first, last, written, rows, avoid)
            if avoid is None or not avoid[0] <= i <= avoid[1]:
                branches.append(branch)
            taken = branch.taken
        if j > i:
            flow[j - first] += w * taken
        flow[i - first + 1] += w * (1 - taken)
    return weights, branches


def _branch(kernel: Kernel, i: int, j: int, first: int, last: int, written: set[str],
            rows: int, avoid: tuple[int, int] | None = None) -> Branch:
    insns = kernel.instructions
    insn = insns[i]
    negated = insn.guard.startswith("!")
    pred = insn.guard.lstrip("!")
    test = _definition(kernel, pred, i, (first, last))
    skipped = insns[i + 1:j]
    then, other = skipped, []  # the side the branch skips; the else side (if / else) it runs
    if skipped and skipped[-1].op == "BRA" and not skipped[-1].guard and (
            skipped[-1].target or 0) > insns[j].address:
        then, other = skipped[:-1], insns[j:kernel.at(skipped[-1].target)]
    work = [any(i.op in _TILE_WORK for i in side) for side in (then, other)]
    enters = [avoid is not None and _enters(kernel, start, avoid) for start in (j, i + 1)]
    if enters[0] != enters[1]:  # a boundary pass: the side that does not enter the main loop
        kind, taken = "boundary", float(enters[1])
    elif test is not None and (value := _rows_test(kernel, test, written, first, rows)) is not None:
        kind, taken = "rows", float(value != negated)
    elif test is not None and _uniform(kernel, test, (first, last), set()):
        kind = "config"
        taken = float(work[1] if work[0] != work[1] else len(then) > len(other))
    else:
        kind = "data"
        taken = float(work[1] if work[0] != work[1] else _slow_path(kernel, i, j))
    text = f"{test.opcode} {', '.join(test.operands)}" if test else "(no definition found)"
    return Branch(insn.address, kind, taken, text)


def _enters(kernel: Kernel, start: int, loop: tuple[int, int]) -> bool:
    """Whether the code from index ``start`` runs into ``loop`` (first, last): it starts inside
    it, or falls through to its head with no unconditional branch or exit on the way."""
    if loop[0] <= start <= loop[1]:
        return True
    return start < loop[0] and not any(
        insn.op in ("BRA", "EXIT") and not insn.guard
        for insn in kernel.instructions[start:loop[0]])


# Tensor-core work: where only one side of a branch holds it, that side runs (a padded head's
# guards ``kk < k_steps`` pass in full at the standard head sizes; the K/V copies of the next
# tile run on every tile but the last).
_TILE_WORK = ("HMMA", "LDGSTS")


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
