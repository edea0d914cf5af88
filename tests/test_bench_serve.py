"""`phasewise bench serve` against a live phasewise server.

No timed assertions: every wait is bounded, none is measured.
"""

from __future__ import annotations

import json

import pytest

from live_server import free_port

pytestmark = pytest.mark.slow

def test_bench_serve_counts_tokens_from_the_servers_usage(server, tmp_path, capsys):
    from phasewise.cli import main

    out = tmp_path / "bench"
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "8", "--input-len", "32",
                 "--output-len", "8", "--max-concurrency", "4", "--num-warmup", "1", "--goodput", "e2e:600000",
                 "--result-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert (run["completed"], run["failed"]) == (8, 0)
    assert run["prompt_tokens"] == 8 * 32 and run["output_tokens"] == 8 * 8 and run["usage_reported"]
    assert run["goodput"]["requests"] == 8
    assert 0 < run["ttft_ms"]["median"] <= run["e2e_ms"]["median"]
    assert run["tpot_ms"]["median"] > 0 and run["itl_ms"]["p99"] >= run["itl_ms"]["median"]
    rows = (out / "requests.csv").read_text().splitlines()
    assert len(rows) == 1 + 8 and rows[0].split(",")[2:5] == ["prompt_tokens", "cached_tokens", "output_tokens"]
    assert "TTFT median ms" in capsys.readouterr().out


def test_a_shared_prefix_run_priced_from_its_record(server, tmp_path, capsys):
    """bench serve records each request's cached tokens; cost --from-run prices them (reads at 0.1x)."""
    import csv

    from phasewise.cli import main

    out = tmp_path / "shared"
    assert main(["bench", "serve", "--base-url", server.url, "--dataset", "shared-prefix", "--num-prefixes", "1",
                 "--suffixes-per-prefix", "4", "--prefix-len", "64", "--suffix-len", "8", "--output-len", "2",
                 "--max-concurrency", "1", "--num-warmup", "0", "--result-dir", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "requests.csv")))
    read = sum(int(r["cached_tokens"]) for r in rows)
    assert len(rows) == 4 and read >= 3 * 64 // 16 * 16 - 16      # each later request reads the prefix's blocks
    assert main(["cost", "--from-run", str(out), "--input-price", "3", "--output-price", "15"]) == 0
    doc = json.loads((out / "cost.json").read_text())
    assert doc["tokens"]["read"] == read and doc["tokens"]["prompt"] == 4 * 72
    assert doc["with_cache"]["total"] < doc["without_cache"]["total"] and doc["roi"] is None


def test_bench_serve_sweep_over_chat_draws_the_trade_off(server, tmp_path):
    import matplotlib.image

    from phasewise.cli import main

    out = tmp_path / "sweep"
    code = main(["bench", "serve", "--base-url", server.url + "/v1", "--endpoint", "chat", "--num-prompts", "4",
                 "--input-len", "12", "--output-len", "4", "--sweep", "1,4", "--num-warmup", "0",
                 "--result-dir", str(out)])
    assert code == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 4]
    assert all(r["completed"] == 4 and r["output_tokens"] == 16 for r in runs)
    image = matplotlib.image.imread(out / "sweep.png")
    assert image.ndim == 3 and image.shape[1] > 500


def test_bench_serve_against_no_server_fails_in_one_line(capsys):
    from phasewise.cli import main

    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("phasewise: error: cannot reach")


