"""benchmarks/prompt_cache_overhead.py at a tiny size: it runs both engines in alternating rounds and
writes its results, the disk tier's engine having written blocks and dropped none, with what the tier cost
each phase on the engine's thread and the writer's and the bound they make."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).parent.parent / "benchmarks" / "prompt_cache_overhead.py"


def test_a_tiny_run_alternates_the_engines_and_writes_its_results(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(BENCH), "--rounds", "2", "--prompts", "1", "--prompt-len", "48",
                           "--batch", "2", "--output-len", "20", "--kv-cache-memory", "0.1", "--dir",
                           str(tmp_path / "cache"), "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.split("disk tier ")[1].split(":")[0].strip() for line in done.stdout.splitlines()
             if line.startswith("round ")]
    assert order == ["on", "off", "off", "on"]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "prompt_cache_overhead" and result["threads"] >= 1
    for kind in ("prefill_tps", "decode_tps"):
        assert all(len(result["figures"][k][kind]) == 2 and min(result["figures"][k][kind]) > 0 for k in ("on", "off"))
        s = result["summary"][kind]
        pairs = [a / b for a, b in zip(result["figures"]["on"][kind], result["figures"]["off"][kind])]
        assert s["slowdown"] == pytest.approx(1 - sum(pairs) / 2)      # the median of each round's on / off
    # each round's prompts (3 whole blocks each) and replies were written; nothing was read (all new)
    assert result["disk"]["blocks_written"] >= 2 * 3 and result["disk"]["dropped"] == 0
    assert result["disk"]["blocks_read"] == 0
    assert len(list((tmp_path / "cache").rglob("*.kvb"))) == result["disk"]["blocks_written"]
    for kind in ("prefill_tps", "decode_tps"):
        for c in result["costs"]["on"][kind]:                # every phase looked up, saved and wrote blocks
            assert c["engine_cpu_s"] > 0 and c["lookups_calls"] >= 1 and c["saves_calls"] >= 1
            assert c["writer_calls"] >= 2 and c["writer_cpu_s"] > 0
        c = result["summary"][kind]["cost"]
        calls = sum(x[f"{s}_wall_s"] for x in result["costs"]["on"][kind] for s in ("lookups", "saves"))
        writer = sum(x["writer_cpu_s"] for x in result["costs"]["on"][kind])
        assert c["bound"] == pytest.approx((calls + writer) / c["engine_cpu_s"]) and len(c["bounds"]) == 2
    assert "slowdown at most" in done.stdout
