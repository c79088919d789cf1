"""argparse ``type=`` functions: every option is checked while the command line is parsed,
before any work, and a bad value is reported argparse's way (``argument --x: ...``, exit 2)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedkv import checks
from pagedkv.cache.formats import cache_format, format_names
from pagedkv.errors import InvalidArgumentError
from pagedkv.tools.costmodel import DevicePreset, get_device
from pagedkv.tools.presets import ModelPreset, get_model, parse_bytes
from pagedkv.tools.traces import TRACES

__all__ = ["byte_size", "cache_dtype", "choices_list", "count", "device_preset", "existing_file",
           "fraction", "model_preset", "output_file", "positive_float", "positive_int", "rate",
           "rates", "trace"]


def _checked(check: Callable[..., Any], value: Any, **bounds: float) -> Any:
    """``check(value, "the value", **bounds)`` (one of pagedkv.checks), its error argparse's."""
    try:
        return check(value, "the value", **bounds)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    return _checked(checks.positive, _int(text))


def count(text: str) -> int:
    return _checked(checks.count, _int(text))


def _float(text: str, **bounds: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    return _checked(checks.number, value, **bounds)


def fraction(text: str) -> float:
    return _float(text, at_least=0, at_most=1)


def positive_float(text: str) -> float:
    return _float(text, above=0)


def rate(text: str) -> float:
    """Requests per second > 0, or ``inf`` (all requests at time 0)."""
    return _float(text, above=0, at_most=math.inf)


def rates(text: str) -> list[float]:
    """Comma-separated finite rates > 0, increasing."""
    values = [positive_float(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated rates, e.g. 1,2,4,8")
    if values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"rates must increase, got {text}")
    return values


def byte_size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a size > 0, got {text!r}")
    return value


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text}")
    return path


def output_file(text: str) -> Path:
    """A file to write: its folder must exist and be writable (checked now, not after the
    work)."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, expected a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {folder}")
    return path


def choices_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """Comma-separated, non-empty, distinct values from ``allowed``."""
    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"repeated value in {text!r}")
        return values
    return parse


def cache_dtype(text: str) -> str:
    """A cache format (``pagedkv.cache.formats``) by any of its names: its canonical name."""
    try:
        return cache_format(text).name
    except InvalidArgumentError:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(format_names())}, got {text!r}") from None


def model_preset(text: str) -> ModelPreset:
    """A model preset by name (case-insensitive)."""
    try:
        return get_model(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device_preset(text: str) -> DevicePreset:
    """A device preset by name (case-insensitive)."""
    try:
        return get_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def trace(text: str) -> str:
    """A built-in synthetic trace's name, or a readable JSONL file."""
    if text in TRACES:
        return text
    try:
        return str(existing_file(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected {', '.join(TRACES)} or a JSONL file, got {text!r} (no such file)") from None
