"""Step cost models: the seconds one serving step takes, priced from its ``StepShape``.

The simulator drives the real scheduler and asks a cost model what each step would cost:

- ``RooflineModel``: from a model preset and a device's spec sheet. A step reads the weights once
  and every sequence's K/V, writes the new tokens' K/V, and does the matmuls and attention of its
  query tokens; it takes the longer of the memory and the compute time (they overlap), plus the
  device<->CPU swaps (PCIe, not overlapped) and a fixed per-step overhead.
- ``LinearModel``: ``c0 + c . (num_seqs, query_tokens, attended, kv_read, swap_blocks)`` with
  non-negative coefficients, fitted to steps measured on a real engine
  (``bench/bench_engine.py`` writes them; ``load_calibration`` fits them).

Both satisfy the ``CostModel`` protocol: ``step_seconds(shape)`` and ``breakdown(shape)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from pagedkv import checks
from pagedkv.cache.formats import cache_format
from pagedkv.serving.scheduler import StepShape
from pagedkv.tools.presets import ModelPreset

__all__ = ["DEVICES", "SHAPE_FIELDS", "CostModel", "DevicePreset", "LinearModel",
           "RooflineModel", "get_device", "load_calibration"]

SHAPE_FIELDS = tuple(f.name for f in fields(StepShape))
"""The fields of a StepShape, as the calibration rows carry them."""

GIB = 2**30


@runtime_checkable
class CostModel(Protocol):
    """What the simulator needs of a cost model."""

    def step_seconds(self, shape: StepShape) -> float:
        """Seconds of one step of this shape."""
        ...

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        """The parts of ``step_seconds`` (keys ending in ``_s``), ``total_s`` among them."""
        ...


def _check_shape(shape: StepShape) -> None:
    for name in SHAPE_FIELDS:
        value = getattr(shape, name)
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"shape.{name} must be an int >= 0, got {value!r}")


# devices ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DevicePreset:
    """An accelerator's spec-sheet figures, and how much of them a serving step gets.

    Rates are peaks: ``memory_bandwidth`` (HBM, B/s), ``bf16_flops`` (dense tensor-core FLOP/s,
    without 2:4 sparsity) and ``pcie_bandwidth`` (host link, B/s per direction). The efficiencies
    scale them to what real kernels reach:

    - ``bandwidth_efficiency`` 0.8: streaming kernels (weight GEMVs of decode, paged attention)
      reach 75-90% of HBM peak; a STREAM-like copy tops out near 90%.
    - ``flops_efficiency`` 0.6: large bf16 GEMMs reach 60-80% of the dense peak, and a step also
      runs attention, norms and small GEMMs that reach less.
    - ``pcie_efficiency`` 0.8: pinned-memory copies reach about 80% of the link's rate (about
      25 GB/s of PCIe 4.0 x16's 31.5 GB/s), after TLP/DLLP protocol overhead.
    - ``step_overhead`` 1 ms: host work per step that the GPU waits for (scheduling, building
      the batch tensors, sampling, launches not hidden by CUDA graphs) in a Python serving loop;
      it dominates only small decode batches, where a model's weights take a few ms to read.

    The SM figures feed the SASS model of the kernels (``bench.sass.model`` in a checkout):
    ``sm_count`` multiprocessors at ``sm_clock`` Hz (boost), ``schedulers_per_sm`` warp
    schedulers each issuing one warp instruction per clock, ``fp32_lanes_per_sm`` FP32 results
    per clock, ``sass_arch`` the SASS the device runs. ``issue_efficiency`` 0.8 is the share of
    issue slots a loop of independent ALU work keeps busy with 4 warps per scheduler: an
    assumption, to be replaced by ncu's ``smsp__issue_active.avg.pct_of_peak_sustained_active``
    once a GPU run measured it.

    ``nvlink_bandwidth`` (B/s per direction between two GPUs of a node) carries the all-reduces of
    tensor parallelism, at ``bandwidth_efficiency`` of its peak.
    """

    name: str
    memory_bytes: int
    memory_bandwidth: float
    bf16_flops: float
    pcie_bandwidth: float
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    pcie_efficiency: float = 0.8
    step_overhead: float = 1e-3
    sm_count: int = 0
    sm_clock: float = 0.0
    schedulers_per_sm: int = 4
    fp32_lanes_per_sm: int = 64
    sass_arch: str = ""
    issue_efficiency: float = 0.8
    nvlink_bandwidth: float = 0.0
    note: str = ""

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "memory_bandwidth", "bf16_flops", "pcie_bandwidth"):
            checks.number(getattr(self, name), f"DevicePreset.{name}", above=0)
        for name in ("bandwidth_efficiency", "flops_efficiency", "pcie_efficiency",
                     "issue_efficiency"):
            checks.number(getattr(self, name), f"DevicePreset.{name}", above=0, at_most=1)
        checks.number(self.step_overhead, "DevicePreset.step_overhead", at_least=0)


# NVIDIA's A100 / H100 / H200 datasheets. Capacities are the sheets' "GB" read as GiB (what
# nvidia-smi reports is within about 1% of them). PCIe per direction: 4.0 x16 is 16 GT/s x 16
# lanes x 128/130 = 31.5 GB/s, 5.0 x16 twice that; the sheets quote both directions together
# (64 and 128 GB/s).
# SMs and clocks: the A100 whitepaper (108 SMs, 1410 MHz boost, 64 FP32 lanes per SM) and the
# H100 whitepaper (SXM5: 132 SMs, 128 FP32 lanes per SM); the datasheets' FP32 peaks agree:
# 108 x 64 x 2 x 1.41 GHz = 19.5 TFLOPS (A100), 132 x 128 x 2 x 1.98 GHz = 67 TFLOPS (H100 and
# H200 SXM, the same GH100 die at a 1980 MHz boost). Both have 4 warp schedulers per SM.
_PCIE4, _PCIE5 = 31.5e9, 63e9
# NVLink per direction: the sheets' totals (A100 600 GB/s, H100 and H200 SXM 900 GB/s) halved.
_A100 = dict(sm_count=108, sm_clock=1.41e9, fp32_lanes_per_sm=64, sass_arch="sm_80",
             nvlink_bandwidth=300e9)
_H100 = dict(sm_count=132, sm_clock=1.98e9, fp32_lanes_per_sm=128, sass_arch="sm_90",
             nvlink_bandwidth=450e9)

DEVICES: dict[str, DevicePreset] = {d.name.lower(): d for d in [
    DevicePreset("A100-40GB", 40 * GIB, 1555e9, 312e12, _PCIE4, **_A100,
                 note="SXM4 or PCIe: both 1555 GB/s HBM2"),
    DevicePreset("A100-80GB", 80 * GIB, 2039e9, 312e12, _PCIE4, **_A100,
                 note="SXM4 (the PCIe card: 1935 GB/s)"),
    DevicePreset("H100", 80 * GIB, 3.35e12, 989e12, _PCIE5, **_H100, note="SXM5 80GB HBM3"),
    DevicePreset("H200", 141 * GIB, 4.8e12, 989e12, _PCIE5, **_H100, note="SXM 141GB HBM3e"),
]}


def get_device(name: str) -> DevicePreset:
    """The device preset named ``name`` (case-insensitive); ValueError listing them otherwise."""
    try:
        return DEVICES[name.lower()]
    except (KeyError, AttributeError):
        names = ", ".join(d.name for d in DEVICES.values())
        raise ValueError(f"unknown device {name!r}; devices: {names}") from None


# roofline -----------------------------------------------------------------------------------

class RooflineModel:
    """A step's time from the bytes it moves and the FLOPs it does on ``device``.

    memory = weights read once + K/V read (``kv_read`` tokens) + K/V written (``query_tokens``);
    compute = the layers' matmuls for every query token + the lm_head for each sequence's last
    token (``num_seqs``: the engine samples only there) + attention, 4 FLOPs per layer, head and
    head dimension for each query-key pair (QK^T and PV; ``ModelPreset.attention_flops_per_key``);
    an MLA model attends in the absorbed form: heads x (2 x 576 + 2 x 512) FLOPs per layer and
    pair, its K/V bytes one latent row per token and layer, read once for all heads;
    swap = ``swap_blocks`` blocks over PCIe before the step;
    allreduce = with ``tp`` > 1, two all-reduces per layer (after o_proj and down_proj) of the
    query tokens' hidden states, a ring moving 2 (tp - 1) / tp of their bytes over NVLink.

    ``step_seconds = max(memory, compute) + swap + allreduce + overhead`` (the all-reduces wait for
    the matmul before them, so they do not overlap). With ``tp`` devices each holds and moves 1/tp
    of the weights and the FLOPs, and its share of the KV heads (one replicated head each when
    there are fewer KV heads than devices; an MLA latent on every device). Mixtures of experts read
    only the routed experts a step's tokens are sent to: the expected share under uniform routing,
    ``1 - (1 - active/experts)^query_tokens`` (shared experts and dense layers: all of them).
    """

    def __init__(self, model: ModelPreset, device: DevicePreset, cache_dtype: str | None = None,
                 block_size: int = 16, tp: int = 1) -> None:
        if cache_dtype is not None:
            cache_dtype = cache_format(cache_dtype, "cache_dtype").name
        tp, block_size = checks.positive(tp, "tp"), checks.positive(block_size, "block_size")
        self.model, self.device, self.tp = model, device, tp
        self.spec = model.spec(block_size, cache_dtype)
        self.rank_spec = model.spec(block_size, cache_dtype, tp)
        self.weight_bytes = model.weight_bytes()
        moe = model.routed_expert_params * self.weight_bytes // model.num_params
        self._dense_bytes, self._moe_bytes = self.weight_bytes - moe, moe
        self._layer_flops = model.flops_per_token(lm_head=False)
        self._lm_head_flops = model.flops_per_token() - self._layer_flops
        self._attention_flops = model.attention_flops_per_key
        self._bandwidth = device.memory_bandwidth * device.bandwidth_efficiency * tp
        self._flops = device.bf16_flops * device.flops_efficiency * tp
        self._pcie = device.pcie_bandwidth * device.pcie_efficiency * tp
        self._allreduce_bytes = 0.0  # per query token, per device
        if tp > 1:
            if not (device.nvlink_bandwidth and model.hidden_size):
                raise ValueError(f"tp {tp}: needs the NVLink bandwidth of {device.name} and the "
                                 f"hidden_size of {model.name}")
            self._allreduce_bytes = (2 * model.num_layers * model.hidden_size
                                     * model.activation_size * 2 * (tp - 1) / tp)
            self._nvlink = device.nvlink_bandwidth * device.bandwidth_efficiency

    def weights_read(self, query_tokens: int) -> float:
        """Bytes of weights a step of ``query_tokens`` tokens reads (all of them when dense)."""
        if not self._moe_bytes:
            return self.weight_bytes
        model = self.model
        share = 1 - (1 - model.num_active_experts / model.num_experts) ** query_tokens
        return self._dense_bytes + self._moe_bytes * share

    def flops(self, shape: StepShape) -> float:
        """The step's FLOPs over all ``tp`` devices."""
        return (self._layer_flops * shape.query_tokens + self._lm_head_flops * shape.num_seqs
                + self._attention_flops * shape.attended)

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        _check_shape(shape)
        weights_s = self.weights_read(shape.query_tokens) / self._bandwidth
        kv_bytes = (shape.kv_read + shape.query_tokens) * self.rank_spec.bytes_per_token * self.tp
        kv_s = kv_bytes / self._bandwidth
        compute_s = self.flops(shape) / self._flops
        swap_s = shape.swap_blocks * self.rank_spec.bytes_per_block * self.tp / self._pcie
        allreduce_s = (shape.query_tokens * self._allreduce_bytes / self._nvlink
                       if self.tp > 1 else 0.0)
        overhead_s = self.device.step_overhead
        total_s = max(weights_s + kv_s, compute_s) + swap_s + allreduce_s + overhead_s
        return {"weights_s": weights_s, "kv_s": kv_s, "compute_s": compute_s, "swap_s": swap_s,
                "allreduce_s": allreduce_s, "overhead_s": overhead_s, "total_s": total_s}

    def step_seconds(self, shape: StepShape) -> float:
        return self.breakdown(shape)["total_s"]

    def kv_cache_bytes(self, memory_fraction: float = 0.9) -> int:
        """Bytes left for the KV cache on the ``tp`` devices together, after the weights, when
        the engine may use ``memory_fraction`` of each device's memory (activations and the
        CUDA context live in the rest). ValueError when the weights do not fit."""
        checks.number(memory_fraction, "memory_fraction", above=0, at_most=1)
        usable = int(self.device.memory_bytes * memory_fraction) * self.tp
        if usable <= self.weight_bytes:
            raise ValueError(
                f"the weights of {self.model.name} ({self.weight_bytes / GIB:.1f} GiB) do not fit "
                f"in {memory_fraction:.0%} of {self.tp} x {self.device.name} "
                f"({usable / GIB:.1f} GiB); raise tp")
        return usable - self.weight_bytes


# linear model -------------------------------------------------------------------------------

def _nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """x >= 0 minimizing ||a x - b||: Lawson and Hanson's active-set method.

    Columns join the passive (free) set one at a time, the one whose gradient most wants to grow
    first; whenever the unconstrained solution on the passive set turns a coefficient negative,
    the step is cut back to the boundary and that column leaves. Stops when no column outside
    the set can lower the residual."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls needs a of [m, n] and b of [m], got {a.shape} and {b.shape}")
    n = a.shape[1]
    max_iter = 3 * n if max_iter is None else max_iter
    tol = 10 * np.finfo(float).eps * np.abs(a).sum(axis=0).max(initial=0.0) * max(a.shape)
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while passive.any():  # each pass drops a column, so it ends within n passes
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                x = s
                break
            cut = np.flatnonzero(passive & (s <= 0))
            ratios = x[cut] / (x[cut] - s[cut])
            x = x + ratios.min() * (s - x)
            passive &= x > tol
            passive[cut[np.argmin(ratios)]] = False  # the one that hit 0, whatever rounding says
            x[~passive] = 0.0
    return np.maximum(x, 0.0)


_COEFFICIENTS = ("c_seq", "c_query", "c_attended", "c_kv", "c_swap")
_FEATURES = ("num_seqs", "query_tokens", "attended", "kv_read", "swap_blocks")
_PARTS = ("seqs_s", "query_s", "attended_s", "kv_s", "swap_s")


@dataclass(slots=True)
class LinearModel:
    """``c0 + c_seq num_seqs + c_query query_tokens + c_attended attended + c_kv kv_read +
    c_swap swap_blocks`` seconds, every coefficient >= 0.

    ``fit`` sets ``fit_error_median`` / ``fit_error_p90``: ``|predicted - measured| / measured``
    over the rows it was fitted to (None for a model given by hand)."""

    c0: float = 0.0
    c_seq: float = 0.0
    c_query: float = 0.0
    c_attended: float = 0.0
    c_kv: float = 0.0
    c_swap: float = 0.0
    fit_error_median: float | None = None
    fit_error_p90: float | None = None
    num_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("c0", *_COEFFICIENTS):
            setattr(self, name, checks.number(getattr(self, name), f"LinearModel.{name}",
                                              at_least=0))

    @property
    def coefficients(self) -> np.ndarray:
        """``[c0, c_seq, c_query, c_attended, c_kv, c_swap]``."""
        return np.array([self.c0, *(getattr(self, c) for c in _COEFFICIENTS)])

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        _check_shape(shape)
        parts = {"base_s": self.c0}
        for part, c, feature in zip(_PARTS, _COEFFICIENTS, _FEATURES, strict=True):
            parts[part] = getattr(self, c) * getattr(shape, feature)
        return parts | {"total_s": sum(parts.values())}

    def step_seconds(self, shape: StepShape) -> float:
        return self.breakdown(shape)["total_s"]

    @classmethod
    def fit(cls, rows: Iterable[tuple[StepShape, float]], relative: bool = True) -> LinearModel:
        """Fit to measured ``(shape, seconds)`` rows by non-negative least squares.

        ``relative`` weighs each row by 1/seconds, minimizing relative rather than absolute
        error: step times span orders of magnitude (a decode step vs a long prefill), and the
        simulator needs the short steps, its most frequent ones, as right as the long."""
        rows = list(rows)
        if not rows:
            raise ValueError("rows is empty: fit needs measured (shape, seconds) rows")
        for shape, seconds in rows:
            _check_shape(shape)
            checks.number(seconds, "seconds of a row", above=0)
        x = np.array([[1.0, *(getattr(s, f) for f in _FEATURES)] for s, _ in rows])
        y = np.array([seconds for _, seconds in rows], dtype=float)
        weights = 1 / y if relative else np.ones_like(y)
        a = x * weights[:, None]
        scale = np.linalg.norm(a, axis=0)  # equilibrate: features span ~10 orders of magnitude
        scale[scale == 0] = 1.0
        coefficients = _nnls(a / scale, y * weights) / scale
        model = cls(*coefficients.tolist())
        errors = np.abs(x @ coefficients - y) / y
        model.fit_error_median = float(np.median(errors))
        model.fit_error_p90 = float(np.percentile(errors, 90))
        model.num_rows = len(rows)
        return model

    def to_json(self) -> str:
        """The coefficients and fit errors as a JSON object (``from_json`` reads it back)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_json(cls, text: str) -> LinearModel:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a LinearModel's JSON is an object, got {type(data).__name__}")
        unknown = data.keys() - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown LinearModel fields in JSON: {', '.join(sorted(unknown))}")
        return cls(**data)


def load_calibration(path: str | Path, model: str | None = None) -> LinearModel:
    """The LinearModel fitted to the steps ``bench/bench_engine.py`` measured for ``model`` (a key
    of the file's ``models``; may be omitted when the file holds one)."""
    data = json.loads(Path(path).read_text())
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models:
        raise ValueError(f"{path} holds no calibration: expected {{'models': {{name: rows}}}}")
    if model is None:
        if len(models) > 1:
            raise ValueError(f"{path} calibrates several models, pass model= one of "
                             f"{', '.join(models)}")
        model = next(iter(models))
    if model not in models:
        raise ValueError(f"model {model!r} is not in {path}; it has {', '.join(models)}")
    rows = [(StepShape(**{f: row[f] for f in SHAPE_FIELDS}), row["seconds"])
            for row in models[model]["rows"]]
    return LinearModel.fit(rows)
