"""Timing harness shared by every microbenchmark.

Each op is timed as the median of repeated runs after a warm-up (CUDA events on a GPU, a
monotonic clock on the CPU) and reported as GB/s of the bytes it must move, and as a fraction of
the machine's memory bandwidth measured in the same run: ``read`` (a sum over a large tensor) for
read-bound kernels such as decode attention, ``copy`` (read + write of a large tensor) for the
kernels that move data.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


@dataclass
class Row:
    op: str
    case: str
    median_ms: float
    gbytes: float  # bytes the op must move, in GB
    bound: str  # "read" or "copy": which measured bandwidth is its ceiling
    gbps: float = 0.0
    fraction: float = 0.0
    baselines_ms: dict[str, float] = field(default_factory=dict)

    def finish(self, bandwidth: dict[str, float]) -> Row:
        self.gbps = self.gbytes / (self.median_ms / 1e3)
        self.fraction = self.gbps / bandwidth[self.bound]
        return self


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3,
              repeat: int = 10) -> float:
    """Median wall time of ``fn`` in milliseconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, gib: float = 1.0) -> dict[str, float]:
    """Measured memory bandwidth in GB/s: ``read`` (sum of a large fp32 tensor) and ``copy``
    (bytes read plus bytes written by a large tensor copy)."""
    n = int(gib * 2**30) // 4
    x = torch.ones(n, device=device)
    y = torch.empty_like(x)
    read_ms = median_ms(lambda: x.sum(), device, repeat=7)
    copy_ms = median_ms(lambda: y.copy_(x), device, repeat=7)
    nbytes = x.numel() * 4
    return {"read": nbytes / 1e9 / (read_ms / 1e3), "copy": 2 * nbytes / 1e9 / (copy_ms / 1e3)}


def print_table(title: str, rows: list[Row], bandwidth: dict[str, float]) -> None:
    print(f"\n{title}  (bandwidth measured now: read {bandwidth['read']:.1f} GB/s, "
          f"copy {bandwidth['copy']:.1f} GB/s)")
    baseline_names = sorted({name for r in rows for name in r.baselines_ms})
    op_width = max([20, *(len(r.op) + 2 for r in rows)])
    case_width = max([34, *(len(r.case) + 2 for r in rows)])
    header = f"{'op':<{op_width}}{'case':<{case_width}}{'ms':>9}{'GB/s':>8}{'of bw':>7}"
    header += "".join(f"{'x vs ' + b:>18}" for b in baseline_names)
    print(header)
    for r in rows:
        line = (f"{r.op:<{op_width}}{r.case:<{case_width}}{r.median_ms:>9.3f}{r.gbps:>8.1f}"
                f"{r.fraction:>7.0%}")
        for b in baseline_names:
            ms = r.baselines_ms.get(b)
            line += f"{(ms / r.median_ms if ms else float('nan')):>17.1f}x"
        print(line)


def write_json(name: str, rows: list[Row], bandwidth: dict[str, float],
               device: torch.device) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "bandwidth_gbps": bandwidth,
        "rows": [asdict(r) for r in rows],
    }
    path.write_text(json.dumps(payload, indent=2))
    return path


def write_host_json(name: str, rows: list[dict], **fields: object) -> Path:
    """bench/results/<name>.json of a host-side benchmark: its rows with the machine (CPUs, load
    average, torch) and ``fields``; prints the load (other work skews host timings) and the path."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    machine = {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "torch": torch.__version__,
               **fields}
    path.write_text(json.dumps({**machine, "rows": rows}, indent=2))
    print(f"load average {machine['load_average'][0]:.1f} on {machine['cpus']} CPUs")
    print(f"wrote {path}")
    return path
