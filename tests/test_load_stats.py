"""The load generator's arithmetic on hand-made timelines, its datasets and its arrival process."""

from __future__ import annotations

import statistics

import pytest

from phasewise.lab import load_gen as G
from phasewise.lab.load_stats import RequestRecord, meets, parse_goodput, summarize


def record(start, chunks, end, out, prompt=10, ok=True):
    return RequestRecord(start=start, ok=ok, prompt_tokens=prompt, output_tokens=out, chunk_times=chunks,
                         end=end, usage_reported=True)


# Request a: sent at 0, chunks at 0.1, 0.2, 0.4, done at 0.4 (3 tokens).
# Request b: sent at 0.5, chunks at 1.0, 1.1, done at 1.1 (2 tokens). Request c failed.
A = record(0.0, [0.1, 0.2, 0.4], 0.4, 3)
B = record(0.5, [1.0, 1.1], 1.1, 2)
C = RequestRecord(start=0.2, end=0.3, error="HTTP 500: boom")


def test_per_request_definitions():
    assert A.ttft == pytest.approx(0.1) and A.e2e == pytest.approx(0.4)
    assert A.itl == pytest.approx([0.1, 0.2])
    assert A.tpot == pytest.approx((0.4 - 0.1) / 2)
    assert B.tpot == pytest.approx(0.1)
    assert record(0.0, [0.3], 0.3, 1).tpot is None           # one token: no TPOT
    assert C.ttft is None and not C.ok


def test_summary_on_a_hand_timeline():
    s = summarize([A, B, C], duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["prompt_tokens"] == 20 and s["output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(12.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)       # (100 + 500) / 2
    assert s["ttft_ms"]["median"] == pytest.approx(300.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(460.0)        # 100 + 0.9 * 400
    assert s["itl_ms"]["median"] == pytest.approx(100.0)      # gaps 100, 200, 100
    assert s["itl_ms"]["p99"] == pytest.approx(198.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(125.0)       # (150 + 100) / 2
    assert s["e2e_ms"]["median"] == pytest.approx(500.0)      # 400 and 600
    assert s["errors"] == ["HTTP 500: boom"] and s["usage_reported"]


def test_goodput_counts_requests_meeting_every_slo():
    assert parse_goodput(["ttft:200", "tpot:120"]) == {"ttft": 200.0, "tpot": 120.0}
    assert meets(A, {"ttft": 200}) and not meets(B, {"ttft": 200})
    assert not meets(A, {"tpot": 120}) and meets(B, {"tpot": 120})
    assert meets(record(0.0, [0.05], 0.05, 1), {"tpot": 1})   # no TPOT to break
    assert not meets(C, {"e2e": 10_000})                       # failed requests never count
    s = summarize([A, B, C], 2.0, {"e2e": 500})
    assert s["goodput"]["requests"] == 1 and s["goodput"]["requests_per_s"] == pytest.approx(0.5)
    for bad in (["ttft"], ["latency:5"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_random_prompts_have_the_asked_lengths_and_repeat_with_the_seed():
    ps = G.random_prompts(20, 50, 8, range_ratio=0.2, seed=3, vocab=1000)
    assert all(40 <= len(p.prompt) <= 60 and 6 <= p.output_len <= 9 for p in ps)
    assert all(100 <= t < 1000 for p in ps for t in p.prompt)
    assert [p.prompt for p in ps] == [p.prompt for p in G.random_prompts(20, 50, 8, 0.2, seed=3, vocab=1000)]
    words = G.random_prompts(3, 12, 4, token_ids=False)
    assert all(isinstance(p.prompt, str) and len(p.prompt.split()) == 12 for p in words)


def test_shared_prefix_prompts_share_exactly_their_prefix():
    ps = G.shared_prefix_prompts(3, 4, prefix_len=20, suffix_len=5, output_len=7, seed=1)
    assert len(ps) == 12 and all(len(p.prompt) == 25 and p.output_len == 7 for p in ps)
    prefixes = {tuple(p.prompt[:20]) for p in ps}
    assert len(prefixes) == 3
    assert len({tuple(p.prompt[20:]) for p in ps}) == 12


def test_file_prompts_cycle_paragraphs(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("first para\nstill first\n\nsecond\n\n\n")
    assert [p.prompt for p in G.file_prompts(f, 3, 5)] == ["first para\nstill first", "second", "first para\nstill first"]
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError):
        G.file_prompts(tmp_path / "empty.txt", 1, 1)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrival_gaps_have_the_asked_mean_and_spread(burstiness):
    gaps = list(G.intervals(20_000, rate=8.0, burstiness=burstiness, seed=0))
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)
    cv = statistics.stdev(gaps) / statistics.fmean(gaps)           # gamma: CV = 1 / sqrt(shape)
    assert cv == pytest.approx(burstiness ** -0.5, rel=0.05)
    assert list(G.intervals(3, float("inf"))) == [0.0, 0.0, 0.0]
