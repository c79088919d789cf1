"""The simt backend: pagedkv's CUDA kernel source compiled as host C++ and run on the CPU by an
emulator (csrc/simt), registered for CPU tensors as ``torch.ops.pagedkv_simt`` with the same
schemas as ``torch.ops.pagedkv`` (glue: csrc/simt_backend). The emulator's controls are
``torch.ops.pagedkv_simt_ctl``, wrapped below. It exists so that machines without a GPU (CI)
execute, and test, the CUDA kernels. It is a verification tool, orders of magnitude slower than
the CPU ops.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from pagedkv.ops import register_fakes

try:
    from pagedkv import _simt  # noqa: F401  (registers torch.ops.pagedkv_simt)
except ImportError:  # built without the CUDA toolkit headers
    _simt = None

__all__ = ["Profile", "available", "config", "ops", "profile", "set_order",
           "set_plan_max_seq_len", "set_workers"]

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


def set_plan_max_seq_len(n: int) -> None:
    """Plan each paged_attention call as if its max_seq_len were at most ``n`` (0: off): the
    split-K plan a CUDA graph captured for shorter sequences, replayed with longer ones."""
    torch.ops.pagedkv_simt_ctl.set_plan_max_seq_len(n)


def config() -> tuple[str, int, int]:
    """The current (order, seed, workers)."""
    return tuple(torch.ops.pagedkv_simt_ctl.config())


# traffic counters -------------------------------------------------------------------------------

SECTOR = 32  # bytes: the unit in which a GPU's L2 and DRAM move global memory

_COUNTS = ("requests", "bytes", "sectors", "ideal_sectors", "distinct_bytes")


@dataclass
class Profile:
    """Global-memory traffic of the kernels launched inside ``profile()``, counted by the
    emulator (docs/simt.md, Traffic): one entry per launch in ``launches`` (kernel, grid, block,
    smem, and per tag and op the counts), filled when the ``with`` block ends."""

    launches: list[dict] = field(default_factory=list)

    def rows(self, kernel: str | None = None) -> list[dict]:
        """One row per (kernel, tag, op), summed over launches whose kernel name contains
        ``kernel``, with the derived figures: ``sector_efficiency`` (ideal / touched sectors),
        ``reread`` (bytes requested / distinct bytes; distinct bytes are summed per launch) and
        ``bytes_per_request``."""
        totals: dict[tuple[str, str, str], dict] = {}
        for launch in self.launches:
            name = launch["kernel"]
            if kernel is not None and kernel not in name:
                continue
            short = name.split("(")[0].split("<")[0].split("::")[-1]
            for t in launch["traffic"]:
                row = totals.setdefault((short, t["tag"], t["op"]),
                                        {"kernel": short, "tag": t["tag"], "op": t["op"],
                                         "launches": 0} | dict.fromkeys(_COUNTS, 0))
                row["launches"] += 1
                for c in _COUNTS:
                    row[c] += t[c]
        out = []
        for row in totals.values():
            row["sector_efficiency"] = row["ideal_sectors"] / max(row["sectors"], 1)
            row["reread"] = row["bytes"] / max(row["distinct_bytes"], 1)
            row["bytes_per_request"] = row["bytes"] / max(row["requests"], 1)
            out.append(row)
        return out

    def total(self, kernel: str | None = None, tag: str | None = None,
              op: str = "load") -> dict:
        """The counts of ``rows(kernel)`` summed over the rows of ``tag`` (all tags: None) and
        ``op``, with the derived figures."""
        rows = [r for r in self.rows(kernel) if r["op"] == op and tag in (None, r["tag"])]
        total = dict.fromkeys(_COUNTS, 0)
        for r in rows:
            for c in _COUNTS:
                total[c] += r[c]
        total["sector_efficiency"] = total["ideal_sectors"] / max(total["sectors"], 1)
        total["reread"] = total["bytes"] / max(total["distinct_bytes"], 1)
        return total

    def to_dict(self) -> dict:
        return {"launches": self.launches, "rows": self.rows()}

    def table(self) -> str:
        head = (f"{'kernel':<32}{'tag':<10}{'op':<6}{'launches':>9}{'requests':>10}"
                f"{'bytes':>12}{'sectors':>10}{'ideal':>10}{'sector eff':>11}{'distinct':>12}"
                f"{'reread':>8}")
        lines = [head]
        for r in self.rows():
            lines.append(f"{r['kernel'][:31]:<32}{r['tag']:<10}{r['op']:<6}{r['launches']:>9}"
                         f"{r['requests']:>10}{r['bytes']:>12}{r['sectors']:>10}"
                         f"{r['ideal_sectors']:>10}{r['sector_efficiency']:>11.1%}"
                         f"{r['distinct_bytes']:>12}{r['reread']:>8.2f}")
        return "\n".join(lines)


@contextlib.contextmanager
def profile() -> Iterator[Profile]:
    """Counts the global-memory traffic of every simt launch inside the block::

        with pagedkv.ops.simt.profile() as prof:
            ops.paged_attention(...)
        print(prof.table()); prof.to_dict()

    Off by default, and free when off; one profile at a time (a nested one raises)."""
    if _simt is None:
        raise RuntimeError("pagedkv._simt is not built: no traffic counters")
    prof = Profile()
    torch.ops.pagedkv_simt_ctl.profile_start()
    try:
        yield prof
    finally:
        prof.launches = json.loads(torch.ops.pagedkv_simt_ctl.profile_stop())["launches"]
