"""Backends under test: every op suite runs on each one available here.

cpu   the CPU kernels (torch.ops.pagedkv on CPU tensors)
cuda  the CUDA kernels (torch.ops.pagedkv on CUDA tensors), when a GPU is present
simt  the CUDA kernel source run by the emulator (torch.ops.pagedkv_simt on CPU tensors),
      in two fiber orders (forward, and random with a fixed seed)

PAGEDKV_TEST_BACKENDS=cpu,simt-forward restricts the list. PAGEDKV_SIMT_SANITIZE=address (`make
sanitize`) runs simt on the ASan + UBSan build of the emulator module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import pagedkv  # noqa: F401  (loads torch.ops.pagedkv)

from helpers import use_sanitized_simt

use_sanitized_simt()


@dataclass(frozen=True)
class Backend:
    name: str
    device: torch.device
    ops: Any  # a torch.ops namespace with the pagedkv schemas
    simt_order: str | None = None

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
    wanted = os.environ.get("PAGEDKV_TEST_BACKENDS")
    if wanted:
        names = set(wanted.split(","))
        backends = [b for b in backends if b.name in names or b.name.split("-")[0] in names]
    return backends


BACKENDS = available_backends()


@pytest.fixture(params=BACKENDS, ids=str)
def backend(request) -> Backend:
    b: Backend = request.param
    if b.simt_order is not None:
        simt = _simt_module()
        simt.set_order(b.simt_order, seed=1234)
    return b


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
