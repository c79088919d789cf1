"""Tensor parallelism: the ranks, the process group and the few collectives serving needs.

Each rank holds a shard of the attention heads (and so of the KV cache) and of the MLP
(Megatron-LM's split): q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel,
followed by an all-reduce (sum) of their outputs. Embeddings and lm_head are replicated. Every rank
runs the same scheduler on the same inputs; rank 0's sampled tokens are broadcast each step so the
replicas stay identical (``docs/architecture.md``). The transport is ``torch.distributed``: gloo
on the CPU, nccl with CUDA, launched by ``torchrun`` (it sets RANK, WORLD_SIZE, MASTER_ADDR...).

A collective that fails (a rank exited) or waits longer than the group's timeout raises
``TensorParallelError`` on the ranks still running, so they exit with that error instead of hanging.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedkv import checks
from pagedkv.errors import InvalidArgumentError

__all__ = ["TensorParallel", "TensorParallelError", "init_tensor_parallel",
           "kv_heads_per_rank", "shard_range"]


class TensorParallelError(RuntimeError):
    """A collective between the tensor-parallel ranks failed or timed out."""


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place among ``size`` ranks (``size`` 1: no process group, no collective).

    ``device``: where the collectives' tensors live (cuda for nccl, cpu for gloo)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    device: torch.device = torch.device("cpu")
    timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1
                and isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise InvalidArgumentError(
                f"tensor parallel rank {self.rank!r} of size {self.size!r}: need 0 <= rank < size")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.size > 1:
            self._run(dist.all_reduce, x, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of all ranks."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (the same length on every rank)."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self._run(dist.broadcast, t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return t.tolist()

    def close(self) -> None:
        """Leave the process group (nothing with one rank)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _run(self, collective: Any, *args: Any, **kwargs: Any) -> None:
        try:
            collective(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as e:
            raise TensorParallelError(
                f"tensor parallel rank {self.rank} of {self.size}: a collective failed or "
                f"timed out (timeout {self.timeout_s:g} s): another rank exited or stalled "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e


def shard_range(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """The [start, end) of rank ``tp.rank``'s equal share of ``total`` items named ``what``.

    Raises InvalidArgumentError when ``tp.size`` does not divide ``total``."""
    if total % tp.size:
        raise InvalidArgumentError(
            f"tensor parallel size {tp.size} does not divide {what} ({total})")
    share = total // tp.size
    return tp.rank * share, (tp.rank + 1) * share


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each of ``tp_size`` ranks holds: a share of them, or one replicated head when
    there are fewer KV heads than ranks (as vLLM does).

    Raises InvalidArgumentError unless one of the two numbers divides the other."""
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise InvalidArgumentError(
            f"tensor parallel size {tp_size} and the model's {num_kv_heads} KV heads: one must "
            "divide the other")
    return max(1, num_kv_heads // tp_size)


def init_tensor_parallel(tp_size: int, timeout_s: float = 60.0,
                         backend: str | None = None) -> TensorParallel:
    """Join the process group of a ``torchrun`` launch of ``tp_size`` processes.

    ``tp_size`` 1 needs no launcher and returns the single-rank ``TensorParallel``. Otherwise
    WORLD_SIZE must equal ``tp_size``; the backend is nccl when CUDA is available, else gloo (or
    ``backend``); with nccl each rank takes GPU LOCAL_RANK. Collectives give up after
    ``timeout_s`` seconds with ``TensorParallelError``.
    """
    tp_size = checks.positive(tp_size, "tp_size")
    if tp_size == 1:
        return TensorParallel()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp_size:
        raise InvalidArgumentError(
            f"tensor parallel size {tp_size} needs {tp_size} processes launched by torchrun "
            f"(torchrun --nproc-per-node {tp_size} ...); WORLD_SIZE is {world}")
    if not dist.is_available():
        raise InvalidArgumentError("tensor parallel needs torch.distributed, not built here")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallel(dist.get_rank(), tp_size, dist.group.WORLD, device, timeout_s)
