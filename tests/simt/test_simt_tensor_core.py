"""Self-tests of the emulated tensor-core instructions (kernels/tensor_core.cuh on simt:
mma.sync m16n8k16, ldmatrix, cp.async), in every fiber order: each against a plain matmul or
copy on random data, which lane holds which element checked against the PTX ISA fragment tables
written out below, and kernels that get the layout or the cp.async wait wrong shown to fail."""

import pytest
import torch

simt = pytest.importorskip("pagedkv.ops.simt")
if not simt.available():
    pytest.skip("pagedkv._simt is not built (no CUDA toolkit headers)", allow_module_level=True)

DTYPES = [torch.float16, torch.bfloat16]
FP32_EPS = 2.0**-24  # unit roundoff of float32


# The PTX ISA's "Matrix Fragments for mma.m16n8k16" (f16 / bf16), element i of lane l.
def a_element(lane, i):
    g, t = lane // 4, lane % 4
    row = g if i < 2 or 4 <= i < 6 else g + 8
    return row, 2 * t + (i & 1) + (8 if i >= 4 else 0)


def b_element(lane, i):
    g, t = lane // 4, lane % 4
    return 2 * t + (i & 1) + (8 if i >= 2 else 0), g


def c_element(lane, i):
    g, t = lane // 4, lane % 4
    return g + (8 if i >= 2 else 0), 2 * t + (i & 1)


def bits16(x):
    """The raw 16-bit patterns of a float16 / bfloat16 tensor, as int64 in [0, 65536)."""
    return x.view(torch.int16).to(torch.int64) & 0xFFFF


def int32(values):
    """Unsigned 32-bit values as an int32 tensor of the same bits."""
    v = torch.as_tensor(values, dtype=torch.int64)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack(matrix, element, registers):
    """Each lane's registers of a 16-bit operand: element 2j in the low half of register j."""
    bits = bits16(matrix)
    regs = torch.zeros(32, registers, dtype=torch.int64)
    for lane in range(32):
        for i in range(2 * registers):
            regs[lane, i // 2] |= bits[element(lane, i)] << (16 * (i % 2))
    return int32(regs)


def mma_inputs(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    b = torch.randn(16, 8, generator=gen).to(dtype)
    c = torch.randn(16, 8, generator=gen)
    return a, b, c


def run_mma(ops, a, b, c, permute=0):
    """D [16, 8] as the lanes' d registers place it (by the C table)."""
    rc = torch.tensor([[c[c_element(lane, i)].item() for i in range(4)] for lane in range(32)])
    d = ops.mma_fragments(pack(a, a_element, 4), pack(b, b_element, 2), rc,
                          a.dtype == torch.bfloat16, permute)
    out = torch.empty(16, 8)
    for lane in range(32):
        for i in range(4):
            out[c_element(lane, i)] = d[lane, i]
    return out


def within_fp32_summation(got, a, b, c=None):
    """Whether got is a @ b (+ c) up to float32 summation of exact products: at most
    (k + 1) * eps * the sum of the terms' magnitudes from the exact (float64) result."""
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    if c is not None:
        exact, scale = exact + c.double(), scale + c.double().abs()
    bound = (a.shape[1] + 1) * FP32_EPS * scale
    return bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_matches_a_matmul_with_the_ptx_fragment_layout(order, dtype, ops):
    for seed in range(3):
        a, b, c = mma_inputs(dtype, seed)
        assert within_fp32_summation(run_mma(ops, a, b, c), a, b, c)


@pytest.mark.parametrize("permute", [1, 2], ids=["a-registers-swapped", "lanes-shifted"])
def test_a_wrong_fragment_mapping_fails_the_check(order, permute, ops):
    a, b, c = mma_inputs(torch.bfloat16, 0)
    assert not within_fp32_summation(run_mma(ops, a, b, c, permute), a, b, c)


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True], ids=["rows", "trans"])
def test_ldmatrix_lane_ownership(order, num, trans, ops):
    gen = torch.Generator().manual_seed(num)
    m = (torch.randperm(65536, generator=gen)[: 32 * 8] - 32768).to(torch.int16).view(32, 8)
    bits = m.to(torch.int64) & 0xFFFF
    got = ops.ldmatrix_fragments(m, num, trans)
    for lane in range(32):
        for i in range(num):  # matrix i is m[8i : 8i + 8]; lane holds row lane // 4, a pair
            mat = bits[8 * i : 8 * i + 8]
            mat = mat.t() if trans else mat
            row, col = lane // 4, 2 * (lane % 4)
            assert got[lane, i] == mat[row, col] | mat[row, col + 1] << 16, (lane, i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b_kn", [False, True], ids=["b-nk", "b-kn-trans"])
@pytest.mark.parametrize("shape", [(70, 32, 48), (16, 16, 16), (129, 48, 64)])
def test_cp_async_ldmatrix_mma_tile_matmul(order, dtype, b_kn, shape, ops):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    c = ops.tile_matmul(a, b if b_kn else b.t().contiguous(), b_kn, False)
    assert within_fp32_summation(c, a, b)


def test_reading_a_cp_async_destination_before_its_wait_shows(order, ops):
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(70, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
    assert ops.tile_matmul(a, b, False, True).isnan().any()
    assert not ops.tile_matmul(a, b, False, False).isnan().any()


def test_cp_async_groups_zfill_and_poison(order, ops):
    src = torch.randint(-(2**31), 2**31 - 1, (32, 4, 4), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(6))
    out = ops.cp_async_groups(src.view(32, 16))
    poison = torch.full((32, 4), -1, dtype=torch.int32)
    assert torch.equal(out[:, 0], poison)  # before any wait
    assert torch.equal(out[:, 1], src[:, 0])  # wait_group 2: the oldest group landed
    assert torch.equal(out[:, 2], poison)
    assert torch.equal(out[:, 3], src[:, 1])  # wait_group 1
    assert torch.equal(out[:, 4], torch.zeros(32, 4, dtype=torch.int32))  # src_bytes 0: zfill
    assert torch.equal(out[:, 5], poison)  # wait_group 0 leaves the uncommitted copy pending
    half = torch.cat([src[:, 3, :2], torch.zeros(32, 2, dtype=torch.int32)], 1)
    assert torch.equal(out[:, 6], half)  # committed and waited: 8 bytes copied, 8 zeroed
