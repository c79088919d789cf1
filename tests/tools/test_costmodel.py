"""Step cost models: preset parameter counts, the roofline's bounds and monotonicity, the NNLS fit
of the linear model, its JSON, and the calibration file that bench/bench_engine.py writes."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from pagedkv import checks
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.scheduler import StepShape
from pagedkv.tools.costmodel import (
    DEVICES,
    SHAPE_FIELDS,
    CostModel,
    DevicePreset,
    LinearModel,
    RooflineModel,
    _nnls,
    get_device,
    load_calibration,
)
from pagedkv.tools.presets import MODELS, ModelPreset, get_model

GIB = 2**30


# presets ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, published", [
    ("Llama-3-8B", 8.03e9), ("Llama-3.1-8B", 8.03e9), ("Llama-3-70B", 70.6e9),
    ("Llama-3.1-405B", 405.9e9), ("Llama-2-7B", 6.74e9), ("Mistral-7B", 7.24e9),
    ("Qwen2.5-7B", 7.62e9), ("Gemma-2-9B", 9.24e9), ("OPT-13B", 12.9e9),
    ("Mixtral-8x7B", 46.7e9),
])
def test_parameter_counts_match_published_sizes(name, published):
    assert get_model(name).num_params == pytest.approx(published, rel=0.02)


def test_every_preset_has_dimensions():
    for m in MODELS.values():
        assert m.num_params > m.num_layers * m.attention_params > 0, m.name
        assert m.flops_per_token() > m.flops_per_token(lm_head=False) > 0, m.name


def test_mixtral_counts_all_experts_for_weights_and_active_ones_for_flops():
    mixtral, mistral = get_model("Mixtral-8x7B"), get_model("Mistral-7B")
    assert mixtral.active_params == pytest.approx(12.9e9, rel=0.02)
    assert mixtral.num_params > 3.5 * mixtral.active_params
    mlp_flops = 2 * mixtral.num_layers * mixtral.expert_params
    router_flops = 2 * mixtral.num_layers * mixtral.hidden_size * mixtral.num_experts
    # Mistral's shape with one MLP; Mixtral's token runs two MLPs and the router
    assert mixtral.flops_per_token() == mistral.flops_per_token() + mlp_flops + router_flops


def test_flops_per_token_is_twice_the_matmul_params():
    untied, tied = get_model("Llama-3-8B"), get_model("Gemma-2-9B")
    assert not untied.tied_embeddings and tied.tied_embeddings
    # untied: the embedding table is a lookup, the lm_head a matmul of as many parameters
    assert untied.flops_per_token() == 2 * (untied.num_params - untied.embedding_params)
    # tied: one table serves both, and the matmul uses it
    assert tied.flops_per_token() == 2 * tied.num_params
    assert untied.flops_per_token(lm_head=False) == 2 * (
        untied.num_params - 2 * untied.embedding_params)


def test_opt_mlp_has_two_matrices():
    opt = get_model("OPT-13B")
    assert not opt.gated_mlp
    assert opt.expert_params == 2 * opt.hidden_size * opt.intermediate_size
    gated = dataclasses.replace(opt, gated_mlp=True)
    assert gated.num_params - opt.num_params == opt.num_layers * opt.expert_params // 2


def test_weight_bytes_follow_the_dtype():
    m = get_model("Llama-3-8B")
    assert m.weight_bytes() == 2 * m.num_params == m.weight_bytes("fp16")
    assert m.weight_bytes("fp8") == m.num_params and m.weight_bytes("fp32") == 4 * m.num_params
    with pytest.raises(ValueError, match="dtype"):
        m.weight_bytes("int3")


def test_kv_only_preset_has_no_parameter_count():
    kv_only = ModelPreset("kv-only", 2, 4, 2, 64, 1024)
    assert kv_only.spec().bytes_per_token == 2 * 2 * 2 * 64 * 2
    with pytest.raises(ValueError, match="hidden_size"):
        _ = kv_only.num_params


# devices and the roofline --------------------------------------------------------------------

def test_devices_and_lookup():
    assert get_device("H100") is get_device("h100") is DEVICES["h100"]
    for d in DEVICES.values():
        assert d.bf16_flops > 1e14 and d.memory_bandwidth > 1e12 and d.pcie_bandwidth > 1e10
        assert 0 < d.bandwidth_efficiency <= 1 and d.step_overhead >= 0
    assert get_device("H200").memory_bandwidth > get_device("H100").memory_bandwidth
    with pytest.raises(ValueError, match="unknown device 'tpu'.*H100"):
        get_device("tpu")
    slow = DevicePreset("slow", 24 * GIB, 500e9, 80e12, 16e9)  # efficiencies by default
    assert slow.bandwidth_efficiency == get_device("H100").bandwidth_efficiency
    shape = StepShape.of([1024] * 8, [1] * 8)
    model = get_model("Llama-3-8B")
    assert (RooflineModel(model, slow).step_seconds(shape)
            > RooflineModel(model, get_device("H100")).step_seconds(shape))


@pytest.mark.parametrize("field, value", [
    ("memory_bandwidth", 0), ("bf16_flops", -1.0), ("bandwidth_efficiency", 1.5),
    ("flops_efficiency", 0), ("step_overhead", -1e-3), ("memory_bytes", float("nan")),
    ("pcie_bandwidth", math.inf), ("issue_efficiency", True), ("step_overhead", "1ms"),
])
def test_device_preset_rejects_bad_figures(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(get_device("H100"), **{field: value})


@pytest.mark.parametrize("bounds, inside, outside", [
    ({}, [-1e300, 0, 7, np.float32(2.5), np.int64(-3)], [math.inf, -math.inf, math.nan]),
    ({"above": 0}, [1e-300, 5], [0, -0.0, -1, math.inf]),
    ({"at_least": 0}, [0, -0.0, 3.5], [-1e-300, math.inf]),
    ({"above": 0, "at_most": 1}, [1, 0.5, 1e-9], [0, 1.0000001, math.nan]),
    ({"at_least": 0, "below": 1}, [0, 0.999], [1, -0.5]),
    ({"above": 0, "at_most": math.inf}, [math.inf, 3], [0, math.nan, -math.inf]),
])
def test_number_check_takes_its_interval(bounds, inside, outside):
    for value in inside:
        result = checks.number(value, "x", **bounds)
        assert type(result) is float and result == value
    for value in [*outside, True, False, "1", None, [1.0], 1j]:
        with pytest.raises(InvalidArgumentError, match=r"^x must be a number in [\[(]"):
            checks.number(value, "x", **bounds)


def test_number_check_message_names_the_interval():
    with pytest.raises(InvalidArgumentError, match=r"rate must be a number in \(0, inf\], got 0"):
        checks.number(0, "rate", above=0, at_most=math.inf)
    with pytest.raises(InvalidArgumentError, match=r"share must be a number in \[0, 1\], got 2"):
        checks.number(2, "share", at_least=0, at_most=1)


def roofline(model: str = "Llama-3-8B", device: str = "H100", **kwargs) -> RooflineModel:
    return RooflineModel(get_model(model), get_device(device), **kwargs)


def test_both_models_are_cost_models():
    assert isinstance(roofline(), CostModel) and isinstance(LinearModel(c0=1e-3), CostModel)


BASES = {
    "decode": StepShape.of([1000] * 8, [1] * 8),
    "prefill": StepShape.of([4096], [4096]),
    "mixed": StepShape.of([700, 300, 50], [1, 1, 50], swap_blocks=2),
}
PART = {"num_seqs": "compute_s", "query_tokens": "kv_s", "prefill_tokens": None,
        "attended": "compute_s", "kv_read": "kv_s", "swap_blocks": "swap_s"}


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("field", SHAPE_FIELDS)
def test_roofline_is_monotonic_in_every_shape_field(base, field):
    model, shape = roofline(), BASES[base]
    before = model.breakdown(shape)
    for step in (1, 100, 10_000):
        bigger = dataclasses.replace(shape, **{field: getattr(shape, field) + step})
        after = model.breakdown(bigger)
        assert after["total_s"] >= before["total_s"]
        if PART[field]:
            assert after[PART[field]] > before[PART[field]]
        before = after


def test_decode_batch_1_is_bound_by_reading_the_weights():
    model, h100 = get_model("Llama-3-8B"), get_device("H100")
    parts = roofline().breakdown(StepShape.of([512], [1]))
    floor = model.weight_bytes() / h100.memory_bandwidth  # every byte read once at peak
    assert parts["weights_s"] > parts["compute_s"] and parts["weights_s"] > 10 * parts["kv_s"]
    assert floor < parts["total_s"] < 2 * floor + h100.step_overhead
    assert parts["weights_s"] == pytest.approx(floor / h100.bandwidth_efficiency)


def test_long_prefill_is_compute_bound():
    model, h100 = get_model("Llama-3-8B"), get_device("H100")
    parts = roofline().breakdown(StepShape.of([8192], [8192]))
    assert parts["compute_s"] > 5 * (parts["weights_s"] + parts["kv_s"])
    assert parts["total_s"] == pytest.approx(parts["compute_s"] + parts["overhead_s"])
    matmul_floor = 8192 * model.flops_per_token(lm_head=False) / h100.bf16_flops
    assert matmul_floor < parts["compute_s"] < 2 * matmul_floor / h100.flops_efficiency


def test_swap_cost_scales_with_blocks():
    model = roofline(block_size=16)
    h100 = get_device("H100")
    costs = [model.breakdown(StepShape(swap_blocks=n))["swap_s"] for n in (0, 10, 20, 40)]
    assert costs[0] == 0 and costs[2] == pytest.approx(2 * costs[1])
    assert costs[3] == pytest.approx(4 * costs[1])
    per_block = get_model("Llama-3-8B").spec(16).bytes_per_block
    assert costs[1] == pytest.approx(10 * per_block / (h100.pcie_bandwidth * h100.pcie_efficiency))
    fp8 = roofline(block_size=16, cache_dtype="fp8").breakdown(StepShape(swap_blocks=10))
    assert fp8["swap_s"] == pytest.approx(costs[1] / 2)


def test_tensor_parallel_splits_the_work_and_sizes_the_cache():
    shape = StepShape.of([2048] * 4, [1] * 4)
    one, two = roofline("Llama-3-70B", "H200"), roofline("Llama-3-70B", "H200", tp=2)
    for part in ("weights_s", "kv_s", "compute_s"):
        assert two.breakdown(shape)[part] == pytest.approx(one.breakdown(shape)[part] / 2)
    weights = get_model("Llama-3-70B").weight_bytes()
    h100 = get_device("H100")
    with pytest.raises(ValueError, match="do not fit"):
        roofline("Llama-3-70B", "H100").kv_cache_bytes()
    assert roofline("Llama-3-70B", "H100", tp=2).kv_cache_bytes(0.9) == (
        2 * int(0.9 * h100.memory_bytes) - weights)
    small = roofline("Llama-3-8B", "H100")
    assert small.kv_cache_bytes(0.5) < small.kv_cache_bytes(0.9) < h100.memory_bytes


def test_tensor_parallel_prices_the_all_reduces_and_replicated_kv_heads():
    llama = get_model("Llama-3-70B")
    h200 = get_device("H200")
    shape = StepShape.of([1024] * 8, [1] * 8)
    assert roofline("Llama-3-70B", "H200").breakdown(shape)["allreduce_s"] == 0
    for tp in (2, 4, 8):
        parts = roofline("Llama-3-70B", "H200", tp=tp).breakdown(shape)
        ring = 2 * (tp - 1) / tp * 8 * llama.hidden_size * 2  # 8 tokens of bf16 hidden states
        expected = 2 * llama.num_layers * ring / (h200.nvlink_bandwidth
                                                  * h200.bandwidth_efficiency)
        assert parts["allreduce_s"] == pytest.approx(expected)
        assert parts["total_s"] == pytest.approx(
            max(parts["weights_s"] + parts["kv_s"], parts["compute_s"]) + parts["swap_s"]
            + parts["allreduce_s"] + parts["overhead_s"])
    # 8 KV heads over 16 devices: each holds (and reads) one, as over 8: KV time does not halve
    sixteen, eight = roofline("Llama-3-70B", "H200", tp=16), roofline("Llama-3-70B", "H200", tp=8)
    assert sixteen.rank_spec.num_kv_heads == eight.rank_spec.num_kv_heads == 1
    assert sixteen.breakdown(shape)["kv_s"] == pytest.approx(eight.breakdown(shape)["kv_s"])
    with pytest.raises(ValueError, match="one must divide the other"):
        roofline("Llama-3-70B", "H200", tp=3)


def test_mixture_reads_only_the_experts_its_tokens_use():
    mixtral = roofline("Mixtral-8x7B", "H100", tp=2)
    weights = get_model("Mixtral-8x7B").weight_bytes()
    one_token = mixtral.weights_read(1)
    assert weights / 4 < one_token < weights / 2  # 2 of 8 experts, plus attention and embeddings
    assert mixtral.weights_read(4) > one_token
    assert mixtral.weights_read(1024) == pytest.approx(weights)


@pytest.mark.parametrize("kwargs, match", [
    ({"tp": 0}, "tp"), ({"block_size": 0}, "block_size"), ({"cache_dtype": "int3"}, "cache_dtype"),
    ({"tp": True}, "tp"), ({"block_size": 16.0}, "block_size"),
])
def test_roofline_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        roofline(**kwargs)


def test_bad_shapes_and_fractions_are_refused():
    with pytest.raises(ValueError, match="shape.kv_read"):
        roofline().step_seconds(StepShape(num_seqs=1, query_tokens=1, kv_read=-5))
    with pytest.raises(ValueError, match="shape.swap_blocks"):
        LinearModel(c0=1.0).step_seconds(StepShape(swap_blocks=-1))
    for fraction in (1.5, 0, True, math.nan):
        with pytest.raises(ValueError, match="memory_fraction"):
            roofline().kv_cache_bytes(fraction)


# the linear model ---------------------------------------------------------------------------

def test_nnls_matches_the_kkt_conditions():
    rng = np.random.default_rng(0)
    for _ in range(50):
        # correlated columns and a mixed-sign truth: the active set must drop columns it took
        a = rng.normal(size=(40, 12)) + 10 * rng.normal(size=(40, 1))
        b = a @ rng.normal(size=12) + 0.1 * rng.normal(size=40)
        x = _nnls(a, b)
        gradient = a.T @ (b - a @ x)  # minus the gradient of ||a x - b||^2 / 2
        assert (x >= 0).all()
        assert np.allclose(gradient[x > 0], 0, atol=1e-8)  # free: stationary
        assert (gradient[x == 0] <= 1e-8).all()  # at the bound: growing would not help
        unconstrained = np.linalg.lstsq(a, b, rcond=None)[0]
        if (unconstrained >= 0).all():
            assert np.allclose(x, unconstrained)
    with pytest.raises(ValueError, match="nnls"):
        _nnls(np.ones((3, 2)), np.ones(4))


def random_shapes(rng: np.random.Generator, count: int) -> list[StepShape]:
    shapes = []
    for _ in range(count):
        batch = int(rng.integers(1, 65))
        seq_lens = rng.integers(16, 1025, size=batch).tolist()
        prefill = rng.random() < 0.3
        query_lens = [n if prefill and i == 0 else 1 for i, n in enumerate(seq_lens)]
        shapes.append(StepShape.of(seq_lens, query_lens, int(rng.integers(0, 3)) * 8))
    return shapes


def test_fit_recovers_known_coefficients_from_noisy_rows():
    truth = LinearModel(c0=2e-3, c_seq=5e-5, c_query=2e-5, c_attended=3e-9, c_kv=0.0,
                        c_swap=1e-4)
    rng = np.random.default_rng(1)
    shapes = random_shapes(rng, 400)
    rows = [(s, truth.step_seconds(s) * (1 + 0.02 * rng.standard_normal())) for s in shapes]
    fit = LinearModel.fit(rows)
    for name in ("c0", "c_seq", "c_query", "c_attended", "c_swap"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.15), name
    assert fit.c_kv >= 0 and fit.c_kv * 1024 < 0.05 * truth.c0  # a zero stays (near) zero
    assert fit.num_rows == 400 and fit.fit_error_median < 0.03 < fit.fit_error_p90 < 0.06


def test_fit_never_returns_a_negative_coefficient():
    rng = np.random.default_rng(2)
    shapes = random_shapes(rng, 100)
    # time falls with kv_read: least squares would give c_kv < 0, NNLS pins it at 0
    rows = [(s, max(1e-3, 0.05 - 1e-6 * s.kv_read + 1e-5 * s.query_tokens)) for s in shapes]
    fit = LinearModel.fit(rows)
    assert (fit.coefficients >= 0).all() and fit.c_kv == 0
    x = np.array([[1, s.num_seqs, s.query_tokens, s.attended, s.kv_read, s.swap_blocks]
                  for s, _ in rows], dtype=float)
    assert np.linalg.lstsq(x, [t for _, t in rows], rcond=None)[0][4] < 0


def test_relative_fit_keeps_short_steps_right():
    # a cost the linear model cannot express, over decode steps of ms and prefills of seconds:
    # fitting relative error keeps the many short steps close, absolute error gives them up
    rng = np.random.default_rng(6)
    shapes = [StepShape.of([int(n)] * int(b), [1] * int(b))
              for n, b in zip(rng.integers(16, 1024, 90), rng.integers(1, 64, 90), strict=True)]
    shapes += [StepShape.of([int(n)], [int(n)]) for n in rng.integers(256, 4096, 10)]
    rows = [(s, 2e-3 + 1e-7 * s.kv_read + 1e-4 * s.num_seqs**0.5 + 2e-5 * s.query_tokens**1.5)
            for s in shapes]
    relative, absolute = LinearModel.fit(rows), LinearModel.fit(rows, relative=False)
    assert relative.fit_error_median < 0.5 * absolute.fit_error_median
    assert relative.fit_error_median < 0.2


def test_fit_rejects_bad_rows_and_coefficients():
    with pytest.raises(ValueError, match="rows"):
        LinearModel.fit([])
    with pytest.raises(ValueError, match="seconds"):
        LinearModel.fit([(StepShape.of([4], [4]), 0.0)])
    for bad in (-1e-9, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="c_kv"):
            LinearModel(c_kv=bad)


def test_json_round_trip():
    rng = np.random.default_rng(3)
    truth = LinearModel(c0=1e-3, c_query=1e-5, c_kv=1e-8)
    fit = LinearModel.fit((s, truth.step_seconds(s)) for s in random_shapes(rng, 50))
    again = LinearModel.from_json(fit.to_json())
    assert again == fit and again.fit_error_p90 == fit.fit_error_p90
    shape = StepShape.of([100, 200], [1, 200])
    assert again.step_seconds(shape) == fit.step_seconds(shape)
    assert again.breakdown(shape)["total_s"] == pytest.approx(sum(
        v for k, v in again.breakdown(shape).items() if k != "total_s"))
    with pytest.raises(ValueError, match="unknown LinearModel fields"):
        LinearModel.from_json(json.dumps({"c0": 1.0, "c_gpu": 2.0}))


def write_calibration(path, models: dict[str, LinearModel], rng: np.random.Generator) -> None:
    """A file laid out as bench/bench_engine.py writes it."""
    data = {"machine": {"cpus": 2}, "models": {}}
    for name, truth in models.items():
        rows = [{"case": "random", **{f: getattr(s, f) for f in SHAPE_FIELDS},
                 "seconds": truth.step_seconds(s)} for s in random_shapes(rng, 60)]
        data["models"][name] = {"config": {}, "rows": rows}
    path.write_text(json.dumps(data))


def test_load_calibration_fits_one_model_per_key(tmp_path):
    small = LinearModel(c0=2e-3, c_query=2e-5, c_kv=1e-7)
    big = LinearModel(c0=2e-2, c_seq=5e-4, c_query=4e-4)
    path = tmp_path / "bench_engine.json"
    write_calibration(path, {"small": small, "big": big}, np.random.default_rng(4))
    for name, truth in (("small", small), ("big", big)):
        fit = load_calibration(path, name)
        assert fit.fit_error_p90 < 1e-6
        assert fit.coefficients == pytest.approx(truth.coefficients, rel=1e-4, abs=1e-12)
    with pytest.raises(ValueError, match="several models.*small, big"):
        load_calibration(path)
    with pytest.raises(ValueError, match="'huge' is not in"):
        load_calibration(path, "huge")
    only = tmp_path / "one.json"
    write_calibration(only, {"small": small}, np.random.default_rng(5))
    assert load_calibration(only).c0 == pytest.approx(small.c0)
