"""Argument checks at the public boundary of block management: each raises InvalidArgumentError
naming the argument, before the caller changes any state."""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Sequence
from numbers import Real
from typing import Any

from pagedkv.errors import InvalidArgumentError

__all__ = ["count", "extra_key_bytes", "hashable", "number", "optional_count", "positive",
           "query_lens", "token_ids"]

MAX_TOKEN_ID = (1 << 63) - 1
"""Token ids are stored (and hashed) as int64."""
INT32_MAX = (1 << 31) - 1
"""The largest count that fits the int32 tensors of the batch (block ids, lengths, offsets)."""


def _as_int(value: Any, name: str) -> int:
    """``value`` as a Python int: an int, a numpy integer or a 0-d integer tensor; not a bool."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or getattr(value, "is_floating_point", lambda: False)():
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def count(value: Any, name: str, maximum: int | None = None) -> int:
    """A non-negative int, at most ``maximum`` (``INT32_MAX`` where it becomes an int32)."""
    value = _as_int(value, name)
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidArgumentError(f"{name} must be <= {maximum}, got {value}")
    return value


def positive(value: Any, name: str, maximum: int | None = None) -> int:
    """A positive int, at most ``maximum`` (``INT32_MAX`` where it becomes an int32)."""
    value = _as_int(value, name)
    if value < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidArgumentError(f"{name} must be <= {maximum}, got {value}")
    return value


def hashable(value: Any, name: str) -> Hashable:
    """``value`` if it can be a dict key."""
    try:
        hash(value)
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be hashable, got {type(value).__name__}") from None
    return value


def token_ids(value: Any, name: str = "token_ids", vocab_size: int | None = None) -> list[int]:
    """Token ids as a new list of Python ints in ``[0, vocab_size)`` (``[0, 2**63)`` without a
    vocabulary): from an int, a sequence of ints, or an integer numpy array or torch tensor of at
    most one dimension. Floats, bools, strings and None are refused, not rounded or coerced."""
    if type(value) is int:
        ids = [value]
    elif isinstance(value, (str, bytes, bytearray)):
        raise InvalidArgumentError(f"{name} must be ints, got {type(value).__name__} {value!r}")
    elif hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy arrays/scalars, tensors
        kind = getattr(value.dtype, "kind", None)  # numpy
        integral = kind in ("i", "u") if kind is not None else not (
            value.dtype.is_floating_point or value.dtype.is_complex or str(value.dtype) ==
            "torch.bool")
        if not integral or getattr(value, "ndim", 0) > 1:
            raise InvalidArgumentError(
                f"{name} must be integer ids of at most one dimension, got {value.dtype} of shape "
                f"{tuple(getattr(value, 'shape', ()))}")
        ids = value.tolist()
        ids = [ids] if isinstance(ids, int) else ids
    else:
        try:
            ids = list(value)
        except TypeError:
            raise InvalidArgumentError(
                f"{name} must be an int or a sequence of ints, got {type(value).__name__}"
            ) from None
        if not all(type(t) is int for t in ids):
            ids = [_as_int(t, f"{name}[{i}]") for i, t in enumerate(ids)]
    if ids:
        low, high = min(ids), max(ids)
        limit = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
        if low < 0 or high > limit:
            bad = low if low < 0 else high
            raise InvalidArgumentError(
                f"{name} holds {bad}, expected ids in [0, {limit + 1})"
                + (" (the model's vocabulary)" if vocab_size is not None else ""))
    return ids


def extra_key_bytes(key: Any, name: str = "extra_key") -> bytes:
    """The canonical encoding of an extra key: None, str, bytes, int or tuples of them, each
    tagged with its type, so equal keys encode alike in every process and unequal ones differ."""
    out = bytearray()
    _encode(key, name, out)
    return bytes(out)


def _encode(key: Any, name: str, out: bytearray) -> None:
    if key is None:
        out += b"N"
    elif type(key) is str:
        data = key.encode()
        out += b"S" + len(data).to_bytes(8, "little") + data
    elif type(key) is bytes:
        out += b"B" + len(key).to_bytes(8, "little") + key
    elif type(key) is int:
        data = str(key).encode()
        out += b"I" + len(data).to_bytes(8, "little") + data
    elif type(key) is tuple:
        out += b"T" + len(key).to_bytes(8, "little")
        for item in key:
            _encode(item, name, out)
    else:
        raise InvalidArgumentError(
            f"{name} must be None, a str, bytes, an int or a tuple of them (a stable, comparable "
            f"key), got {type(key).__name__} {key!r}")


def optional_count(value: Any, name: str, maximum: int | None = None) -> int | None:
    """None or a non-negative int, at most ``maximum``."""
    return None if value is None else count(value, name, maximum)


def query_lens(value: Any, num_seqs: int, name: str = "num_query_tokens") -> int | Sequence[int]:
    """A positive int, or one positive int per sequence; each at most ``INT32_MAX`` (the query
    lengths and their offsets are int32 tensors)."""
    if not isinstance(value, Sequence) and not hasattr(value, "__len__"):
        return positive(value, name, INT32_MAX)
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        value = token_ids(value, name)
    if len(value) != num_seqs:
        raise InvalidArgumentError(f"{name} must have one entry per sequence ({num_seqs}), got "
                                   f"{len(value)}")
    return [positive(v, f"{name}[{i}]", INT32_MAX) for i, v in enumerate(value)]


def number(value: Any, name: str, *, at_least: float | None = None, above: float | None = None,
           at_most: float | None = None, below: float | None = None) -> float:
    """A real number (an int or a float, numpy's included; not a bool, not NaN) as a float, in the
    interval the bounds give: ``>= at_least`` or ``> above``, ``<= at_most`` or ``< below``.
    Unbounded above it must be finite; ``at_most=math.inf`` lets infinity through."""
    low, low_closed = (at_least, True) if at_least is not None else (
        -math.inf if above is None else above, False)
    high, high_closed = (at_most, True) if at_most is not None else (
        math.inf if below is None else below, False)
    real = isinstance(value, Real) and not isinstance(value, bool)
    if not (real and (low <= value if low_closed else low < value)  # NaN fails both
            and (value <= high if high_closed else value < high)):
        interval = f"{'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
        raise InvalidArgumentError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)
