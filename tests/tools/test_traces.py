"""Request traces: token ids shared only through the prefix, seeded synthetic shapes, JSONL."""

from __future__ import annotations

import json

import pytest

from pagedkv.tools.traces import Request, load_jsonl, synthetic_trace, trace_stats


def test_request_tokens_share_only_the_prefix():
    a, b = Request(0, 40, 5, prefix_id=1, prefix_len=20), Request(1, 40, 5, 1, 30)
    assert a.tokens(0, 20) == b.tokens(0, 20)
    assert a.tokens(20, 21) != b.tokens(20, 21)
    assert a.tokens(0, 45)[40:] == [a.output_token(p) for p in range(40, 45)]
    c = Request(2, 3, 2, prompt=(7, 8, 9))
    assert c.tokens(1, 4) == [8, 9, c.output_token(3)]


def test_synthetic_trace_seeded_and_shaped():
    a = synthetic_trace("sharegpt", 400, seed=3, system_share=0.5)
    assert a == synthetic_trace("sharegpt", 400, seed=3, system_share=0.5)
    assert a != synthetic_trace("sharegpt", 400, seed=4, system_share=0.5)
    assert all(1 <= r.output_len and r.final_len <= 2048 for r in a)
    plain = trace_stats(synthetic_trace("sharegpt", 2000, seed=0))
    assert 130 < plain["prompt_mean"] < 200 and 270 < plain["output_mean"] < 400
    alpaca = trace_stats(synthetic_trace("alpaca", 2000, seed=0))
    assert alpaca["prompt_mean"] < 30 and alpaca["output_mean"] < 80
    assert 0.4 < trace_stats(a)["prefix_share"] < 0.6 and plain["prefix_share"] == 0


def test_jsonl_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"prompt_len": 70, "output_len": 5, "prefix_id": "sys", "prefix_len": 64},
            {"prompt_len": 90, "output_len": 7, "prefix_id": "sys", "prefix_len": 64},
            {"prompt": list(range(40)), "output_len": 3},
            {"prompt": list(range(40)) + [99], "output_len": 3}, {"prompt_len": 9, "output_len": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    requests = load_jsonl(path)
    assert [r.prefix_id for r in requests] == [0, 0, None, None, None]
    assert requests[0].tokens(0, 64) == requests[1].tokens(0, 64)
    assert requests[0].tokens(64, 65) != requests[1].tokens(64, 65)
    assert requests[2].tokens(0, 40) == list(range(40)) == requests[3].tokens(0, 40)
    path.write_text('{"prompt_len": 4, "output_len": 0}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        load_jsonl(path)


def test_jsonl_arrival_times(tmp_path):
    path = tmp_path / "timed.jsonl"
    path.write_text("".join(json.dumps({"prompt_len": 8, "output_len": 2, "arrival_time": t})
                            + "\n" for t in (0.5, 0.0, 2.25)))
    assert [r.arrival_time for r in load_jsonl(path)] == [0.5, 0.0, 2.25]
    path.write_text('{"prompt_len": 8, "output_len": 2, "arrival_time": 1}\n'
                    '{"prompt_len": 8, "output_len": 2}\n')
    with pytest.raises(ValueError, match="1 of 2 requests have an arrival_time"):
        load_jsonl(path)
    path.write_text('{"prompt_len": 8, "output_len": 2, "arrival_time": -1}\n')
    with pytest.raises(ValueError, match="timed.jsonl:1: arrival_time"):
        load_jsonl(path)
