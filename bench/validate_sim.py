"""The simulator against the real engine on this CPU: predicted vs measured step times.

python -m bench.validate_sim [--calibration bench/results/bench_engine.json] [--quick]

For each model of the calibration file (``bench/bench_engine.py`` measured its steps on
synthetic batch shapes; ``load_calibration`` fits a ``LinearModel`` to them), the real engine
serves a different workload: an Alpaca-like trace with shared system prompts, Poisson arrivals,
a KV budget small enough to preempt. Every engine step's ``StepShape`` is priced by the fit and
compared with its measured wall time (per-step error, and the total), and the simulator replays
the same trace (the engine's tokens, so the same decisions) to compare the request metrics it
predicts (TTFT, normalized latency, duration) with those the engine measured. Writes
bench/results/validate_sim.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.tools import sim, traces
from pagedkv.tools.costmodel import load_calibration

try:  # run as python -m bench.validate_sim, or as a script
    from bench.bench_engine import MODELS
except ImportError:  # pragma: no cover
    from bench_engine import MODELS

from pagedkv.tools.demo import random_model

RESULTS = Path(__file__).parent / "results"

WORKLOADS = {  # model -> (requests, rate req/s, num_blocks): a few preemptions, a few minutes
    "demo": (64, 40.0, 48),
    "llama-h512": (32, 6.0, 40),
}


class Replay(sim.SimulatedServer):
    """The simulator generating the tokens the engine generated (so it decides the same)."""

    def __init__(self, config, cost, max_len, outputs):
        super().__init__(config, cost, max_len)
        self.outputs = outputs

    def next_token(self, request):
        return self.outputs[request.request_id][len(request.output_token_ids)]


def record(loop) -> tuple[list, list]:
    """Wrap ``loop.step`` to record (shape, seconds) and the scheduled batch of every step."""
    steps, batches = [], []
    step = loop.step

    def recorded():
        finished = step()
        steps.append((loop.last_shape, loop.last_seconds))
        batches.append(loop.last_batch)
        return finished

    loop.step = recorded
    return steps, batches


def _metrics(requests) -> dict[str, float]:
    done = [r for r in requests if r.finish_time is not None]
    start = min(r.arrival_time for r in requests)
    return {"ttft_p50": statistics.median(r.ttft for r in done),
            "ttft_p90": statistics.quantiles([r.ttft for r in done], n=10)[-1],
            "normalized_latency_mean": statistics.fmean(r.normalized_latency for r in done),
            "duration": max(r.finish_time for r in done) - start}


def serve(name: str, fit, arrivals: list[float], prompts, params, engine_config, seed: int,
          same_decisions: bool) -> dict:
    """The engine, then the simulator, on the same requests and arrival times."""
    engine = LLMEngine(random_model(MODELS[name], seed), engine_config)
    steps, engine_batches = record(engine)
    with torch.inference_mode():
        measured = sim.drive(engine, arrivals,
                             lambda i, t: engine.add_request(prompts[i], params[i], t))
    predicted = [fit.step_seconds(shape) for shape, _ in steps]
    errors = [abs(p - m) / m for p, (_, m) in zip(predicted, steps, strict=True)]
    outputs = {r.request_id: r.output_token_ids for r in measured}
    replay = Replay(engine_config, fit, 2048, outputs)
    _, replay_batches = record(replay)
    simulated = sim.drive(replay, arrivals,
                          lambda i, t: replay.add_request(prompts[i], params[i], t))
    if same_decisions and replay_batches != engine_batches:
        raise AssertionError(f"{name}: the simulator decided otherwise than the engine")
    engine_m, sim_m = _metrics(measured), _metrics(simulated)
    measured_total = sum(m for _, m in steps)
    return {
        "steps": len(steps), "simulated_steps": len(replay_batches),
        "same_decisions": replay_batches == engine_batches,
        "preemptions": engine.stats.swaps_out + engine.stats.recomputes,
        "step_error_median": statistics.median(errors),
        "step_error_p90": statistics.quantiles(errors, n=10)[-1],
        "total_measured_s": measured_total, "total_predicted_s": sum(predicted),
        "total_error": sum(predicted) / measured_total - 1,
        "engine": engine_m, "simulator": sim_m,
        "metric_errors": {k: sim_m[k] / engine_m[k] - 1 for k in engine_m},
    }


def validate(name: str, calibration: Path, quick: bool, seed: int = 0) -> list[dict]:
    """Two workloads per model: every request queued at once (the simulator must decide exactly
    as the engine: the errors are the cost model's alone), and Poisson arrivals (the simulator's
    clock decides when requests join, so its batches may differ: the request metrics are the
    test)."""
    fit = load_calibration(calibration, name)
    num_requests, rate, num_blocks = WORKLOADS[name]
    if quick:
        num_requests //= 4
    trace = traces.synthetic_trace("alpaca", num_requests, seed=seed, max_len=512,
                                   system_share=0.5, system_len=64)
    vocab = MODELS[name].vocab_size
    prompts = [[t % vocab for t in r.tokens(0, r.prompt_len)] for r in trace]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in trace]
    engine_config = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_seqs=32,
                                 max_num_batched_tokens=512)
    rows = []
    for workload, arrivals in (("all at once", [0.0] * num_requests),
                               (f"Poisson {rate:g}/s", sim.poisson_arrivals(num_requests, rate,
                                                                             seed))):
        row = serve(name, fit, arrivals, prompts, params, engine_config, seed,
                    same_decisions=workload == "all at once")
        rows.append({"model": name, "workload": workload, "requests": num_requests,
                     "num_blocks": num_blocks,
                     "fit": {"median_rel_error": fit.fit_error_median,
                             "p90_rel_error": fit.fit_error_p90}, **row})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, default=RESULTS / "bench_engine.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.calibration.is_file():
        parser.error(f"argument --calibration: {args.calibration} not found; run "
                     "python -m bench.bench_engine first")
    models = list(json.loads(args.calibration.read_text())["models"])
    rows = [row for name in models for row in validate(name, args.calibration, args.quick)]
    print(f"{'model':<12}{'workload':<16}{'steps':>6}{'preempt':>8}{'same':>5}{'fit med':>8}"
          f"{'step med':>9}{'step p90':>9}{'total':>8}{'TTFT p50':>9}{'norm lat':>9}"
          f"{'duration':>9}")
    for r in rows:
        e = r["metric_errors"]
        print(f"{r['model']:<12}{r['workload']:<16}{r['steps']:>6}{r['preemptions']:>8}"
              f"{'yes' if r['same_decisions'] else 'no':>5}{r['fit']['median_rel_error']:>8.1%}"
              f"{r['step_error_median']:>9.1%}{r['step_error_p90']:>9.1%}"
              f"{r['total_error']:>+8.1%}{e['ttft_p50']:>+9.1%}"
              f"{e['normalized_latency_mean']:>+9.1%}{e['duration']:>+9.1%}")
    print("step med/p90: |predicted - measured| / measured per engine step; total: the engine's "
          "steps priced / measured - 1;\nTTFT p50, norm lat (mean), duration: simulator / engine "
          "- 1; same: the simulator scheduled every step as the engine did")
    RESULTS.mkdir(exist_ok=True)
    machine = {"cpus": os.cpu_count(), "load_average": os.getloadavg(),
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "processor": platform.processor()}
    path = RESULTS / "validate_sim.json"
    path.write_text(json.dumps({**machine, "rows": rows}, indent=2))
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
