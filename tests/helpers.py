"""Shared test helpers: cache layouts, random data, bitwise comparison, the processor's
instruction sets; the sanitized simt module."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# "address" in `make sanitize`: the simt suites run on the ASan + UBSan build of pagedkv._simt.
SIMT_SANITIZE = os.environ.get("PAGEDKV_SIMT_SANITIZE", "")

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
LAYOUTS = ["hnd", "nhd", "combined"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_caches(
    layout: str,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [num_blocks, num_kv_heads, block_size, head_size] in a storage layout:
    hnd (contiguous), nhd (a permuted view) or combined (views of one [num_blocks, 2, ...]
    tensor), filled with random values so that unwritten elements show."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device).to(dtype)

    if layout == "hnd":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return rand(*shape), rand(*shape)
    if layout == "nhd":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return rand(*shape).permute(0, 2, 1, 3), rand(*shape).permute(0, 2, 1, 3)
    if layout == "combined":
        kv = rand(num_blocks, 2, num_kv_heads, block_size, head_size)
        return kv[:, 0], kv[:, 1]
    raise ValueError(layout)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that comparisons are exact (NaN == NaN, fp8 works)."""
    return t.view(_INT_VIEW[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    mismatch = bits(actual).cpu() != bits(expected).cpu()
    if mismatch.any():
        where = mismatch.nonzero()[:5].tolist()
        raise AssertionError(f"{int(mismatch.sum())} elements differ, first at {where}")


def unique_slots(num_tokens: int, num_slots: int, padding: int, device) -> torch.Tensor:
    """int64 [num_tokens]: distinct random slots, with ``padding`` entries set to -1."""
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[torch.randperm(num_tokens)[:padding]] = -1
    return slots.to(device)


# The instruction sets of the CPU attention kernels, narrowest first, and the processor flags
# each needs (csrc/cpu/attention_isa.inc), read independently of the extension's own test.
CPU_ISAS = {"base": set(), "avx2": {"avx2", "fma", "f16c"},
            "avx512": {"avx512f", "avx2", "fma", "f16c"},
            "avx512bf16": {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx2", "fma",
                           "f16c"}}


def cpu_flags() -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (none where there is no such file)."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has(isa: str) -> bool:
    """Whether this processor runs the CPU kernels compiled for ``isa``."""
    return not CPU_ISAS[isa] or (platform.machine() == "x86_64" and CPU_ISAS[isa] <= cpu_flags())


def expected_cpu_kernel(head_size: int, most: str = "avx512bf16") -> str:
    """The kernels csrc/cpu/attention.cpp should pick: the widest set, at most ``most``, that the
    processor has and whose vectors (16 floats for the avx512 sets, else 8) divide
    ``head_size``."""
    allowed = list(CPU_ISAS)[:list(CPU_ISAS).index(most) + 1]
    lanes = {"avx512": 16, "avx512bf16": 16}
    wide = [isa for isa in allowed if cpu_has(isa) and head_size % lanes.get(isa, 8) == 0]
    return wide[-1] if wide else "base"


def use_cpu_isa(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Runs the CPU kernels compiled for ``isa`` (PAGEDKV_CPU_ISA, read at every call); skips
    where this processor lacks it."""
    if not cpu_has(isa):
        missing = " ".join(sorted(CPU_ISAS[isa] - cpu_flags())) or "x86-64"
        pytest.skip(f"this processor has no {isa} (lacks {missing}): its kernels are compiled "
                    "but cannot run here")
    monkeypatch.setenv("PAGEDKV_CPU_ISA", isa)


AMX_FLAGS = {"amx_tile", "amx_bf16"}  # the AMX prefill of the avx512bf16 kernels


def use_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs bfloat16 prefill on AMX tiles (PAGEDKV_CPU_AMX=1); skips where this processor lacks
    AMX-BF16 or Linux does not grant its tile state."""
    from pagedkv import ops

    missing = AMX_FLAGS | CPU_ISAS["avx512bf16"]
    missing = missing - cpu_flags() if platform.machine() == "x86_64" else {"x86-64"}
    if missing:
        pytest.skip(f"this processor has no AMX-BF16 (lacks {' '.join(sorted(missing))}): the "
                    "AMX prefill is compiled but cannot run here")
    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    monkeypatch.setenv("PAGEDKV_CPU_AMX", "1")
    try:
        ops.cpu_amx_tiles(128)
    except ValueError as e:
        pytest.skip(f"AMX-BF16 present but not usable here: {e}")


def use_sanitized_simt() -> None:
    """Under PAGEDKV_SIMT_SANITIZE, makes ``pagedkv._simt`` the sanitized build that setup.py
    wrote to build/simt-<mode>/pagedkv (the in-place module stays as it is). Must run before
    anything imports ``pagedkv._simt``."""
    if not SIMT_SANITIZE:
        return
    import pagedkv

    if "pagedkv._simt" in sys.modules:
        raise RuntimeError("pagedkv._simt was imported before the sanitized build could be")
    folder = ROOT / "build" / f"simt-{SIMT_SANITIZE}" / "pagedkv"
    found = sorted(folder.glob("_simt.*.so"))
    if not found:
        raise RuntimeError(f"PAGEDKV_SIMT_SANITIZE={SIMT_SANITIZE}: no {folder}/_simt.*.so; "
                           "`make sanitize` builds it")
    spec = importlib.util.spec_from_file_location("pagedkv._simt", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["pagedkv._simt"] = module
    pagedkv._simt = module


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster, and fair to a shared machine. Autouse in the
    modules that import it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_hf_model(seed: int = 0, **overrides) -> torch.nn.Module:
    """A random Hugging Face LlamaForCausalLM from a tiny config (no download); transformers is
    imported here, so that modules without it can import the other helpers."""
    import transformers

    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()


def generate_within_windows(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of ``engine`` (an ``LLMEngine``) per prompt, checking after every step
    that a request which computed q tokens holds at most ``(q + W - 2) // block_size + 2``
    blocks in a window-W group (the window plus a block when decoding).
    ``engine.peak_window_blocks``: the most it saw."""
    from pagedkv.serving.engine import SamplingParams

    manager, size = engine.manager, engine.config.block_size
    requests = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    engine.peak_window_blocks = 0
    while engine.has_unfinished():
        engine.step()
        for request_id, q in engine.last_batch:
            if request_id in manager:
                for group, window in enumerate(manager.group_windows):
                    if window is not None:
                        held = manager.num_held_blocks(request_id, group)
                        assert held <= (q + window - 2) // size + 2, (request_id, group, held)
                        engine.peak_window_blocks = max(engine.peak_window_blocks, held)
    return [r.output_token_ids for r in requests]
