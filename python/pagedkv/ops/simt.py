"""The simt backend: pagedkv's CUDA kernel source compiled as host C++ and run on the CPU by an
emulator (csrc/simt), registered for CPU tensors as ``torch.ops.pagedkv_simt`` with the same
schemas as ``torch.ops.pagedkv`` (glue: csrc/simt_backend). The emulator's controls are
``torch.ops.pagedkv_simt_ctl``, wrapped below. It exists so that machines without a GPU (CI)
execute, and test, the CUDA kernels. It is a verification tool, orders of magnitude slower than
the CPU ops.
"""

from __future__ import annotations

import torch

from pagedkv.ops import register_fakes

try:
    from pagedkv import _simt  # noqa: F401  (registers torch.ops.pagedkv_simt)
except ImportError:  # built without the CUDA toolkit headers
    _simt = None

__all__ = ["available", "config", "ops", "set_order", "set_workers"]

ops = torch.ops.pagedkv_simt

if _simt is not None:
    register_fakes("pagedkv_simt")


def available() -> bool:
    """Whether the emulator module was built."""
    return _simt is not None


def set_order(order: str, seed: int = 0) -> None:
    """Order in which each block's threads run between barriers: forward, reverse or random."""
    torch.ops.pagedkv_simt_ctl.set_order(order, seed)


def set_workers(n: int) -> None:
    """OS threads that run blocks concurrently; 1 gives a deterministic run."""
    torch.ops.pagedkv_simt_ctl.set_workers(n)


def config() -> tuple[str, int, int]:
    """The current (order, seed, workers)."""
    return tuple(torch.ops.pagedkv_simt_ctl.config())
