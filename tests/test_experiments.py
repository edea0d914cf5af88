"""The lab's experiments: their statistics on hand-made numbers, and real runs on the default model."""

from __future__ import annotations

import csv
import json

import pytest

from phasewise.cli import main
from phasewise.lab import experiments as E


def test_default_prompt_lengths_are_log_spaced_and_hit_both_ends():
    lengths = E.default_prompt_lengths(50, 3500, 10)
    assert lengths[0] == 50 and lengths[-1] == 3500 and len(lengths) == 10
    ratios = [b / a for a, b in zip(lengths, lengths[1:])]
    assert max(ratios) / min(ratios) < 1.05          # a constant ratio: log spacing
    assert E.default_prompt_lengths(10, 20, 1) == [20]


def test_spread_on_hand_values():
    s = E.spread([10.0, 12.0, 14.0, 16.0, 18.0])
    assert s["median"] == 14.0 and s["mean"] == 14.0
    assert s["p5"] == pytest.approx(10.4) and s["p95"] == pytest.approx(17.6)   # numpy's linear rule
    assert s["std"] == pytest.approx(10 ** 0.5)
    assert s["cv"] == pytest.approx(10 ** 0.5 / 14)
    assert (s["min"], s["max"]) == (10.0, 18.0)


def test_outliers_flag_a_cold_first_run_but_not_noise():
    warm = [100.0, 102.0, 98.0, 101.0, 99.0, 103.0, 97.0, 100.0]
    assert E.outliers(warm) == []
    assert E.outliers([400.0] + warm) == [0]
    assert E.outliers([5.0] * 6) == []                # no spread: nothing to flag
    assert E.outliers([100.0, 100.0, 100.0, 104.0]) == []   # 4% off is noise (min_rel 10%)


def test_prompts_are_reproducible_fresh_and_exact_length():
    a, b = E.PromptMaker(1000, seed=3), E.PromptMaker(1000, seed=3)
    first = a(50)
    assert first == b(50) and len(first) == 50 and all(100 <= t < 1000 for t in first)
    assert a(50) != first                              # each request gets a new prompt


def test_median_by_groups_runs():
    rows = [{"n": 1, "x": 1.0, "tag": "a"}, {"n": 1, "x": 3.0, "tag": "a"}, {"n": 2, "x": 5.0, "tag": "b"}]
    assert E._median_by(rows, "n") == [{"n": 1, "x": 2.0, "tag": "a", "runs": 2},
                                       {"n": 2, "x": 5.0, "tag": "b", "runs": 1}]


@pytest.mark.slow
def test_experiments_on_the_default_model(llm, tmp_path):
    """Every experiment at small settings: exact token counts, sane timings, plots that open as images."""
    import matplotlib.image

    from phasewise.lab.plots import draw

    done = []
    ps = E.prompt_sweep(llm, [8, 40], output_tokens=4, runs=2, progress=done.append)
    assert [r["prompt_tokens"] for r in ps.rows] == [8, 8, 40, 40]
    assert all(r["output_tokens"] == 4 and r["cached_tokens"] == 0 for r in ps.rows)
    assert [r["prompt_len"] for r in ps.table] == [8, 40] and ps.table[0]["runs"] == 2
    assert all(r["prefill_ms"] > 0 and r["decode_tok_s"] > 0 for r in ps.rows)
    os_ = E.output_sweep(llm, [3, 9], prompt_tokens=8, progress=done.append)
    assert [r["output_tokens"] for r in os_.rows] == [3, 9]
    assert os_.rows[1]["decode_ms"] > os_.rows[0]["decode_ms"]   # 8 decode steps take longer than 2
    rp = E.repeat(llm, runs=3, prompt_tokens=8, output_tokens=3, progress=done.append)
    assert [r["run"] for r in rp.rows] == [1, 2, 3]
    assert [r["timing"] for r in rp.table] == list(E.REPEAT_TIMINGS)
    bs = E.batch_sweep(llm, [1, 3], prompt_tokens=8, output_tokens=4, progress=done.append)
    assert [r["output_tokens"] for r in bs.rows] == [4, 12]
    assert all(r["output_tok_s"] == pytest.approx(r["per_request_tok_s"] * r["concurrency"]) for r in bs.rows)
    assert sum(done) == 4 + 2 + 3 + 4                  # progress advanced once per request
    assert llm.engine.core.kv.pool.num_free == llm.engine.core.kv.pool.num_blocks   # nothing leaked
    for exp in (ps, os_, rp, bs):
        folder = tmp_path / exp.name
        folder.mkdir()
        for png in draw(exp, folder):
            image = matplotlib.image.imread(png)
            assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.slow
def test_experiment_command_writes_results_plots_and_trace(tmp_path, capsys):
    out, trace = tmp_path / "bs", tmp_path / "trace.json"
    code = main(["experiment", "batch-sweep", "--max-concurrency", "1,2", "--input-len", "8",
                 "--output-len", "3", "--result-dir", str(out), "--trace", str(trace), "--kv-cache-memory", "0.1"])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["experiment"] == "batch-sweep" and doc["settings"]["concurrencies"] == [1, 2]
    assert [r["output_tokens"] for r in doc["rows"]] == [3, 6]
    with open(out / "results.csv") as f:
        assert [int(r["concurrency"]) for r in csv.DictReader(f)] == [1, 2]
    assert {p.name for p in out.glob("*.png")} == {"throughput_vs_concurrency.png", "tradeoff.png"}
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["name"] == "thread_name" for e in events) == 3      # one track per request
    assert any(e["name"].startswith("step") for e in events)
    assert "batch-sweep" in capsys.readouterr().out                   # the table


@pytest.mark.parametrize("argv, needle", [
    (["prompt-sweep", "--min-len", "500", "--max-len", "100"], "--min-len"),
    (["batch-sweep", "--max-concurrency", "8", "--max-num-seqs", "4"], "--max-num-seqs"),
    (["repeat", "--runs", "0"], "--runs"),
    (["output-sweep", "--input-len", "0"], "--input-len"),
])
def test_bad_settings_fail_in_one_line_before_loading(argv, needle, capsys):
    assert main(["experiment", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("phasewise: error:") and needle in err[0]


@pytest.mark.slow
def test_a_sweep_past_the_context_length_fails_in_one_line(capsys, tmp_path):
    out = tmp_path / "sweep"
    code = main(["experiment", "prompt-sweep", "--lengths", "10,9000", "--output-len", "4",
                 "--max-model-len", "2048", "--num-warmup", "0", "--kv-cache-memory", "0.1", "--result-dir", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "context length 2048" in err and "Traceback" not in err
    assert not out.exists()                       # a failed run leaves no empty results folder behind
