"""Backends under test: every op suite runs on each one available here.

cpu   the CPU kernels (torch.ops.pagedkv on CPU tensors)
cuda  the CUDA kernels (torch.ops.pagedkv on CUDA tensors), when a GPU is present
simt  the CUDA kernel source run by the emulator (torch.ops.pagedkv_simt on CPU tensors),
      in two fiber orders (forward, and random with a fixed seed)

The mla_attention suite takes `mla_backend`: those of them that register an mla_attention kernel
(the CUDA-source backends run the tensor-core MLA kernel).

The paged_attention suites take `attention_backend` instead: the same backends, plus for cuda
and simt the tensor-core kernel forced (PAGEDKV_ATTENTION_KERNEL=tensor_core, names ending in
-tc) besides the automatic dispatch (docs/cuda_attention.md).

PAGEDKV_TEST_BACKENDS=cpu,simt-forward restricts the list (a name also selects the names it
prefixes: simt-forward-tc; simt-forward-tc alone runs the attention suites only).
PAGEDKV_SIMT_SANITIZE=address (`make sanitize`) runs simt on the ASan + UBSan build of the
emulator module.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, replace
from typing import Any

# Before torch loads libgomp, which reads it once: an OpenMP thread that finishes its share of
# a parallel region sleeps instead of spinning for its next one. With one pytest-xdist worker
# per core, each worker's spinning threads took the core from the other worker's running test:
# `PAGEDKV_TEST_BACKENDS=cpu,simt-forward pytest -n 2 tests/ops` took 189 s spinning, 43 s
# sleeping (2 cores). The threads and the work they are given stay as they were.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import pagedkv  # noqa: F401,E402  (loads torch.ops.pagedkv)

from helpers import use_sanitized_simt  # noqa: E402

use_sanitized_simt()


@dataclass(frozen=True)
class Backend:
    name: str
    device: torch.device
    ops: Any  # a torch.ops namespace with the pagedkv schemas
    simt_order: str | None = None
    attention_kernel: str | None = None  # PAGEDKV_ATTENTION_KERNEL for the test; None: as set

    def __str__(self) -> str:
        return self.name


def _simt_module():
    try:
        from pagedkv.ops import simt
    except ImportError:
        return None
    return simt if simt.available() else None


def available_backends() -> list[Backend]:
    backends = [Backend("cpu", torch.device("cpu"), torch.ops.pagedkv)]
    if torch.cuda.is_available():
        backends.append(Backend("cuda", torch.device("cuda"), torch.ops.pagedkv))
    simt = _simt_module()
    if simt is not None:
        for order in ("forward", "random"):
            backends.append(Backend(f"simt-{order}", torch.device("cpu"), simt.ops, order))
    return backends


def wanted(backends: list[Backend]) -> list[Backend]:
    """Those PAGEDKV_TEST_BACKENDS names: a name selects itself and the names it prefixes
    (simt: simt-forward, simt-random-tc, ...)."""
    names = os.environ.get("PAGEDKV_TEST_BACKENDS")
    if not names:
        return backends
    names = names.split(",")
    return [b for b in backends if any(b.name == n or b.name.startswith(n + "-") for n in names)]


ALL_BACKENDS = available_backends()
BACKENDS = wanted(ALL_BACKENDS)
# The CUDA-source backends once more with the tensor-core attention kernel forced.
ATTENTION_BACKENDS = wanted(ALL_BACKENDS + [
    replace(b, name=f"{b.name}-tc", attention_kernel="tensor_core")
    for b in ALL_BACKENDS if b.name == "cuda" or b.simt_order is not None
])


def _has_kernel(b: Backend, op: str) -> bool:
    key = "CUDA" if b.device.type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{b.ops.name}::{op}", key)


MLA_BACKENDS = [b for b in BACKENDS if _has_kernel(b, "mla_attention")]


def _use(b: Backend, monkeypatch) -> Backend:
    if b.simt_order is not None:
        simt = _simt_module()
        simt.set_order(b.simt_order, seed=1234)
    if b.attention_kernel is not None:
        monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", b.attention_kernel)
    return b


@pytest.fixture(params=BACKENDS, ids=str)
def backend(request, monkeypatch) -> Backend:
    return _use(request.param, monkeypatch)


@pytest.fixture(params=MLA_BACKENDS, ids=str)
def mla_backend(request, monkeypatch) -> Backend:
    return _use(request.param, monkeypatch)


@pytest.fixture(params=ATTENTION_BACKENDS, ids=str)
def attention_backend(request, monkeypatch) -> Backend:
    return _use(request.param, monkeypatch)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_finish(session) -> None:
    """What exists once the tests are collected (the modules, torch, thousands of test items)
    lives to the end of the run: frozen, the cyclic collector no longer walks it at every full
    collection, which took 8-14% of an emulator test's time."""
    gc.collect()
    gc.freeze()
