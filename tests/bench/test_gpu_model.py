"""The SASS performance model: the counter on synthetic listings (it finds the loop, weighs the
branches, and reports a wasteful loop as worse), and an instruction budget on the decode kernels
of the built module (or of their unit compiled by nvcc when the module has no CUDA code), so
that a change making them issue more per K/V byte fails here.

The budgets are today's figures (docs/gpu_model.md) plus about 3%: lower one when a change makes
a kernel leaner, so that the gain is kept.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from bench.sass.build import NVCC_FLAGS, ROOT, find_nvcc, unit_kernels
from bench.sass.disasm import classify, disassemble, find_tool, parse_listing
from bench.sass.loop import main_loop, profile_loop
from bench.sass.model import attention_kernels, decode_cost, estimate, occupancy
from pagedkv.tools.costmodel import DEVICES, DevicePreset

# (arch, query dtype, cache dtype, padded head, GQA group) -> instructions per KiB of K/V.
# Today: sm_90 bf16 97 / 201 / 402, fp8_e4m3 200 / 388 / 776; sm_80 bf16 98 / 202 / 403,
# fp8_e4m3 (converted in software on sm_80) 1272 / 1460 / 2920.
BUDGETS = {
    ("sm_90", "bf16", "bf16", 128, 1): 100, ("sm_90", "bf16", "bf16", 128, 4): 207,
    ("sm_90", "bf16", "bf16", 128, 8): 414,
    ("sm_90", "bf16", "fp8_e4m3", 128, 1): 206, ("sm_90", "bf16", "fp8_e4m3", 128, 4): 400,
    ("sm_90", "bf16", "fp8_e4m3", 128, 8): 800,
    ("sm_80", "bf16", "bf16", 128, 1): 101, ("sm_80", "bf16", "bf16", 128, 4): 208,
    ("sm_80", "bf16", "bf16", 128, 8): 416,
    ("sm_80", "bf16", "fp8_e4m3", 128, 1): 1310, ("sm_80", "bf16", "fp8_e4m3", 128, 4): 1504,
    ("sm_80", "bf16", "fp8_e4m3", 128, 8): 3008,
    # Caches with a scale per (token, head): one kernel for every query dtype ("any"). Today:
    # sm_90 int8 252 / 440 / 880, int4 349 / 572 / 1145.
    ("sm_90", "any", "int8", 128, 1): 260, ("sm_90", "any", "int8", 128, 4): 453,
    ("sm_90", "any", "int8", 128, 8): 906,
    ("sm_90", "any", "int4", 128, 1): 359, ("sm_90", "any", "int4", 128, 4): 589,
    ("sm_90", "any", "int4", 128, 8): 1179,
}


def within_budget(kernel, group: int, budget: float) -> None:
    per_kib = decode_cost(kernel, group).instructions * 1024
    assert per_kib <= budget, (
        f"{kernel.arch} {kernel.demangled or kernel.name} at GQA {group}: {per_kib:.0f} "
        f"instructions per KiB of K/V, over the budget of {budget} (docs/gpu_model.md)")


# synthetic listings -----------------------------------------------------------------------------

LOOP = """\
S2R R0, SR_TID.X
S2R R9, SR_CTAID.X
IMAD R9, R9, 0x4, -R0
ULDC UR4, c[0x0][0x210]
ISETP.NE.AND P1, PT, RZ, UR4, PT
head: IMAD.WIDE R2, R0, 0x10, R4
@P1 LDG.E.128 R12, desc[UR6][R2.64]
@P1 LDG.E.128 R16, desc[UR6][R2.64+0x10]
@P1 BRA aligned
LDG.E.U8 R12, desc[UR6][R2.64]
LDG.E.U8 R13, desc[UR6][R2.64+0x1]
aligned: ISETP.GE.AND P2, PT, R9.reuse, 0x2, PT
FFMA R20, R12, R13, R20
@!P2 BRA rows_done
FFMA R21, R14, R15, R21
SHFL.BFLY PT, R22, R21, 0x1, 0x1f
{waste}rows_done: IADD3 R0, R0, 0x80, RZ
ISETP.GE.AND P0, PT, R0, c[0x0][0x214], PT
@!P0 BRA head
EXIT
"""


def listing(waste: int = 0) -> str:
    """LOOP as cuobjdump prints it (addresses, hex branch targets), with ``waste`` integer
    instructions added to the guarded row code."""
    header = ["\tcode for sm_90", "\t\tFunction : _Z6decodev",
              '\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"']
    return assemble(LOOP.replace("{waste}", "IMAD R30, R30, 0x3, RZ\n" * waste), header,
                    "                /* 0x000fc00000000000 */")


def assemble(text: str, header: list[str], suffix: str = "") -> str:
    """``label: instruction`` lines as a disassembler prints them after ``header``: 16 bytes
    each, branch targets as addresses, ``suffix`` after each instruction."""
    lines = text.splitlines()
    labels = {line.split(":")[0]: 16 * i for i, line in enumerate(lines) if ": " in line}
    out = list(header)
    for i, line in enumerate(lines):
        text = line.split(": ", 1)[-1]
        for label, address in labels.items():
            text = text.replace(f"BRA {label}", f"BRA {address:#x}")
        out.append(f"        /*{16 * i:04x}*/ {text} ;{suffix}")
    return "\n".join(out) + "\n"


def kernel_of(text: str):
    kernels = parse_listing(text)
    assert len(kernels) == 1
    return kernels[0]


def test_the_loop_its_bytes_and_its_branches():
    k = kernel_of(listing())
    assert k.arch == "sm_90" and k.name == "_Z6decodev"
    first, last = main_loop(k)
    assert (k.instructions[first].address, k.instructions[last].address) == (0x50, 0x120)
    p = profile_loop(k, rows=4)
    assert p.static_instructions == 14
    assert p.kv_bytes == 2 * 16 * 32 and p.load_width == 16
    assert p.instructions == 12  # the byte loads of unaligned caches are skipped
    assert p.classes == {"ffma": 2, "shfl": 1, "int": 2, "predicate": 2, "branch": 3, "ldg": 2}
    kinds = {b.address: (b.kind, b.taken) for b in p.branches}
    assert kinds == {0x80: ("config", 1.0), 0xd0: ("rows", 0.0)}
    one_row = profile_loop(k, rows=1)
    assert one_row.instructions == 10 and one_row.classes["ffma"] == 1
    assert {b.address: b.taken for b in one_row.branches}[0xd0] == 1.0


def test_the_counter_reports_a_wasteful_loop():
    lean, wasteful = kernel_of(listing()), kernel_of(listing(waste=40))
    # the waste sits in the guarded row code: 40 more instructions per pass with 2+ rows
    assert profile_loop(wasteful, 4).instructions == profile_loop(lean, 4).instructions + 40
    assert profile_loop(wasteful, 1).instructions == profile_loop(lean, 1).instructions
    budget = decode_cost(lean, 4).instructions * 1024 * 1.03
    within_budget(lean, 4, budget)
    with pytest.raises(AssertionError, match="over the budget"):
        within_budget(wasteful, 4, budget)
    h100 = DEVICES["h100"]
    lean_h100 = estimate(decode_cost(lean, 4), h100)
    assert estimate(decode_cost(wasteful, 4), h100).issue_bandwidth < lean_h100.issue_bandwidth
    very = estimate(decode_cost(kernel_of(listing(waste=600)), 4), h100)
    assert lean_h100.bound == "hbm" and very.bound == "issue"
    assert very.bandwidth < lean_h100.bandwidth


def test_nvdisasm_labels_resolve():
    text = """
	.target	sm_80
.text._Z1kv:
        /*0000*/                   MOV R0, RZ ;
.L_x_0:
        /*0010*/                   LDG.E.64 R2, desc[UR4][R4.64] ;
        /*0020*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0030*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0040*/              @!P0 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
"""
    k = kernel_of(text)
    assert k.arch == "sm_80" and k.instructions[4].target == 0x10
    p = profile_loop(k)
    assert (p.first, p.last, p.kv_bytes, p.instructions) == (0x10, 0x40, 8 * 32, 4)


def test_classes():
    def cls(line: str) -> str:
        return classify(kernel_of(f".text._Z1kv:\n /*0000*/ {line} ;\n").instructions[0])

    assert cls("SHF.L.U32 R1, R2, 0x10, RZ") == "convert"  # bf16 -> fp32
    assert cls("IMAD.U32 R1, R2, 0x10000, RZ") == "convert"
    assert cls("LOP3.LUT R1, R2, 0xffff0000, RZ, 0xc0, !PT") == "convert"
    assert cls("LOP3.LUT R1, R2, 0xff, RZ, 0xc0, !PT") == "int"
    assert cls("IMAD.MOV.U32 R1, RZ, RZ, 0x3") == "move"
    assert cls("HFMA2.MMA R47, -RZ, RZ, 0, 0") == "move"
    assert cls("MUFU.EX2 R1, R2") == "mufu"
    assert cls("UIADD3 UR4, UR4, 0x1, URZ") == "uniform"


def test_estimates_take_the_lowest_bound():
    k = kernel_of(listing())
    cost = decode_cost(k, 4)
    fast = DevicePreset("fast", 1 << 30, 1e9, 1e12, 1e9, sm_count=100, sm_clock=2e9)
    slow_memory = estimate(cost, fast)
    assert slow_memory.bound == "hbm" and slow_memory.bandwidth == pytest.approx(0.8e9)
    tiny = DevicePreset("tiny", 1 << 30, 1e15, 1e12, 1e9, sm_count=1, sm_clock=1e9)
    issue = estimate(cost, tiny)
    assert issue.bound == "issue"
    assert issue.bandwidth == pytest.approx(1e9 * 4 * 0.8 / cost.instructions)
    assert decode_cost(k, 8).tiles == 2
    assert decode_cost(k, 8).instructions == pytest.approx(2 * cost.instructions)
    with pytest.raises(ValueError, match="SM figures"):
        estimate(cost, DevicePreset("bare", 1 << 30, 1e9, 1e12, 1e9))
    assert occupancy(128) == 16 and occupancy(168) == 12 and occupancy(32) == 64


def test_a_binary_without_device_code_has_no_kernels():
    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found (PATH, $CUDA_HOME/bin, triton's bundled tools)")
    assert disassemble(sys.executable) == []


def test_cubins_are_compiled_as_the_extension_is():
    """bench.sass.build's flags: setup.py's NVCC_FLAGS, then what torch's cpp_extension adds."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    setup_flags = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                       if isinstance(node, ast.Assign)
                       and any(getattr(t, "id", "") == "NVCC_FLAGS" for t in node.targets))
    assert list(NVCC_FLAGS[:len(setup_flags)]) == setup_flags
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    assert set(COMMON_NVCC_FLAGS) <= set(NVCC_FLAGS)


# the built module ------------------------------------------------------------------------------

def built_kernels(unit: str) -> list:
    """The kernels of ``csrc/cuda/<unit>.cu``: the extension module's, or compiled by nvcc when
    the module has no CUDA code (bench.sass.build, cached under build/sass)."""
    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found (PATH, $CUDA_HOME/bin, triton's bundled tools)")
    import pagedkv._C as ext

    kernels = disassemble(Path(ext.__file__), images=unit)
    if kernels:
        return kernels
    if find_nvcc() is None:
        pytest.skip("the extension module holds no CUDA kernels and nvcc is not found")
    return unit_kernels(unit)


@pytest.fixture(scope="module")
def decode_kernels():
    """The CUDA-core decode kernels of bf16 queries, and those of the row-scaled caches (their
    own unit)."""
    return attention_kernels(built_kernels("attention_bf16") +
                             built_kernels("attention_row_scaled"))


@pytest.mark.parametrize("key", sorted(BUDGETS), ids=lambda k: "-".join(map(str, k)))
def test_decode_kernels_stay_within_their_instruction_budget(decode_kernels, key):
    arch, dtype, cache, head, group = key
    kernel = decode_kernels.get((arch, dtype, cache, head))
    if kernel is None:
        pytest.skip(f"the module has no {arch} {dtype}/{cache} h{head} kernel")
    p = profile_loop(kernel)
    assert p.load_width == {"bf16": 16, "int4": 4}.get(cache, 8)
    assert sum(b.kind == "rows" for b in p.branches) >= 3  # the row guards were recognized
    within_budget(kernel, group, BUDGETS[key])
