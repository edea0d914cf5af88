"""benchmarks/soak.py in its short mode: a mixed load (streamed and not, n > 1, shared prefixes,
hang-ups, invalid requests) on its own server for 8 s, then its invariants: nothing running or
waiting, every KV block free, every status as expected (no 500), no traceback in the server's log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SOAK = Path(__file__).parent.parent / "benchmarks" / "soak.py"


def test_short_soak_leaves_nothing_behind():
    done = subprocess.run([sys.executable, str(SOAK), "--duration", "6", "--max-concurrency", "6"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   every KV block free or evictable" in done.stdout and "FAIL" not in done.stdout
    statuses = done.stdout.split("statuses:", 1)[1].splitlines()[0]
    assert '"200"' in statuses
