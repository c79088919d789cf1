"""Runs every microbenchmark: python -m bench [--device cpu|cuda] [--quick]."""

from __future__ import annotations

import argparse
import importlib

import torch

# suite -> whether it times device kernels (and so takes --device); the manager's, the
# engine's step times (the simulator's calibration), the validation that uses them and the
# engine's tokens/s against Hugging Face (bench_serve, CPU) are host-only, and so is the SASS
# model of the built CUDA kernels (bench_gpu_model: no GPU needed). bench_hf (transformers'
# generate and generate_batch with pagedkv vs sdpa) and bench_serve skip themselves when
# transformers is not installed. bench_kv_accuracy (the quantized caches' end-to-end error on
# small random models) is host-only too.
SUITES = {"bench.bench_cache": True, "bench.bench_attention": True,
          "bench.bench_attention_mla": True, "bench.bench_attention_quant": True,
          "bench.bench_features": True, "bench.bench_cascade": True,
          "bench.bench_manager": False,
          "bench.bench_engine": False, "bench.validate_sim": False, "bench.bench_serve": False,
          "bench.bench_gpu_model": False, "bench.bench_hf": True,
          "bench.bench_kv_accuracy": False}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args(argv)
    quick = ["--quick"] if args.quick else []
    for name, on_device in SUITES.items():
        try:
            suite = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        suite.main((["--device", args.device] if on_device else []) + quick)


if __name__ == "__main__":
    main()
