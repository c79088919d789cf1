"""Request traces for ``pagedkv.tools.sim``: synthetic ShareGPT-like and Alpaca-like, or a JSONL
file.

Synthetic lengths are log-normal (a median and a sigma of the log), rounded, at least 1, with
``prompt + output <= max_len`` (the output is cut). The parameters are chosen so that the means
land on the token statistics the vLLM paper (Kwon et al., SOSP 2023, section 6.1) reports:

==============  ==========================  ==========================  ======================
trace           prompt (median, sigma)      output (median, sigma)      paper's means (in/out)
==============  ==========================  ==========================  ======================
``sharegpt``    100, 1.0 (mean ~165)        220, 0.9 (mean ~330)        161 / 338
``alpaca``      15, 0.7 (mean ~19)          40, 0.9 (mean ~60)          19 / 58
==============  ==========================  ==========================  ======================

A share of the requests (``system_share``) opens with one of ``num_system_prompts`` common system
prompts, whose lengths are drawn uniformly in ``[system_len / 2, 3 * system_len / 2]`` and
prepended to the user prompt. Everything is drawn from ``numpy.random.default_rng(seed)``.

JSONL: one object per line with ``prompt_len`` and ``output_len``, and optionally ``prefix_id``
(any JSON scalar: requests with the same id open with the same tokens) with ``prefix_len``
(default: the whole prompt), or ``prompt`` (the prompt's token ids; then ``prompt_len`` may be
left out), and ``arrival_time`` (seconds from the trace's start; all requests or none).
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv import checks

__all__ = ["TRACES", "Request", "load_jsonl", "synthetic_trace", "trace_stats"]

TRACES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "sharegpt": ((100.0, 1.0), (220.0, 0.9)),
    "alpaca": ((15.0, 0.7), (40.0, 0.9)),
}
"""Name -> ((prompt median, sigma), (output median, sigma)) of the log-normal lengths."""

_SHIFT = 1 << 24  # token ids: a request's own tokens are (id + 1) * _SHIFT + position,
_SHARED = 1 << 48  # shared prefix p's are _SHARED + p * _SHIFT + position (all ids >= 0)


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace. Its prompt opens with ``prefix_len`` tokens of the shared prefix
    ``prefix_id`` (if any); the other tokens are its own, unless ``prompt`` gives them all."""

    id: int
    prompt_len: int
    output_len: int
    prefix_id: int | None = None
    prefix_len: int = 0
    prompt: tuple[int, ...] | None = None
    arrival_time: float | None = None  # seconds, from a JSONL trace that records them

    @property
    def final_len(self) -> int:
        """Tokens in the cache when the request finishes: prompt plus output."""
        return self.prompt_len + self.output_len

    def output_token(self, position: int) -> int:
        """The id of the generated token at ``position`` (>= prompt_len): unique to the request."""
        return (self.id + 1) * _SHIFT + position

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids at positions ``start .. stop - 1`` (prompt, then generated tokens)."""
        own = (self.id + 1) * _SHIFT
        if self.prompt is not None:
            head = list(self.prompt[start:min(stop, self.prompt_len)])
            return head + [own + p for p in range(max(start, self.prompt_len), stop)]
        shared = _SHARED + (self.prefix_id or 0) * _SHIFT
        cut = min(max(start, self.prefix_len), stop)
        return [shared + p for p in range(start, cut)] + [own + p for p in range(cut, stop)]


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    return np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, n))).astype(np.int64)


def synthetic_trace(
    name: str,
    num_requests: int,
    seed: int = 0,
    max_len: int = 2048,
    num_system_prompts: int = 4,
    system_share: float = 0.0,
    system_len: int = 200,
) -> list[Request]:
    """A seeded synthetic trace (``"sharegpt"`` or ``"alpaca"``; see the module docstring)."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; built-in traces: {', '.join(TRACES)}")
    checks.number(system_share, "system_share", at_least=0, at_most=1)
    (p_med, p_sig), (o_med, o_sig) = TRACES[name]
    rng = np.random.default_rng(seed)
    system_lens = rng.integers(system_len // 2, 3 * system_len // 2 + 1, num_system_prompts)
    user = _lognormal(rng, p_med, p_sig, num_requests)
    output = _lognormal(rng, o_med, o_sig, num_requests)
    with_system = rng.random(num_requests) < (system_share if num_system_prompts else 0.0)
    which = rng.integers(0, max(1, num_system_prompts), num_requests)
    requests = []
    for i in range(num_requests):
        prefix = int(system_lens[which[i]]) if with_system[i] else 0
        prompt = min(prefix + int(user[i]), max_len - 1)
        out = min(int(output[i]), max_len - prompt)
        requests.append(Request(i, prompt, out, int(which[i]) if prefix else None,
                                min(prefix, prompt)))
    return requests


def load_jsonl(path: str | Path) -> list[Request]:
    """Requests from a JSONL file (see the module docstring for the fields)."""
    requests: list[Request] = []
    prefix_ids: dict[Hashable, int] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(_request(len(requests), json.loads(line), prefix_ids))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    if not requests:
        raise ValueError(f"{path}: no requests")
    timed = sum(r.arrival_time is not None for r in requests)
    if timed not in (0, len(requests)):
        raise ValueError(f"{path}: {timed} of {len(requests)} requests have an arrival_time; "
                         "give it for all or none")
    return requests


def _request(index: int, row: dict, prefix_ids: dict[Hashable, int]) -> Request:
    prompt = tuple(int(t) for t in row["prompt"]) if "prompt" in row else None
    prompt_len = int(row["prompt_len"]) if "prompt_len" in row else len(prompt or ())
    if prompt is not None and len(prompt) != prompt_len:
        raise ValueError(f"prompt has {len(prompt)} tokens, prompt_len says {prompt_len}")
    output_len = int(row["output_len"])
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    arrival = row.get("arrival_time")
    if arrival is not None:
        arrival = checks.number(arrival, "arrival_time", at_least=0)
    key = row.get("prefix_id")
    if key is None or prompt is not None:
        return Request(index, prompt_len, output_len, prompt=prompt, arrival_time=arrival)
    prefix_id = prefix_ids.setdefault(key, len(prefix_ids))
    prefix_len = min(int(row.get("prefix_len", prompt_len)), prompt_len)
    return Request(index, prompt_len, output_len, prefix_id, prefix_len, arrival_time=arrival)


def trace_stats(requests: list[Request]) -> dict[str, float]:
    """Count, mean and p99 of prompt and output lengths, and the share with a ``prefix_id``."""
    prompt = np.array([r.prompt_len for r in requests])
    output = np.array([r.output_len for r in requests])
    shared = sum(r.prefix_id is not None for r in requests)
    return {"requests": len(requests),
            "prompt_mean": float(prompt.mean()), "prompt_p99": float(np.percentile(prompt, 99)),
            "output_mean": float(output.mean()), "output_p99": float(np.percentile(output, 99)),
            "prefix_share": shared / len(requests)}
