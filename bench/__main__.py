"""Runs every microbenchmark: python -m bench [--device cpu|cuda] [--quick]."""

from __future__ import annotations

import argparse
import importlib

import torch

SUITES = ["bench.bench_cache", "bench.bench_attention", "bench.bench_manager"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args(argv)
    forwarded = ["--device", args.device] + (["--quick"] if args.quick else [])
    for name in SUITES:
        try:
            suite = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        suite.main(forwarded)


if __name__ == "__main__":
    main()
