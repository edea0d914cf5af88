"""What every benchmark's results JSON opens with: where and when it was measured, on which code,
with which command, so that docs/benchmarks.md's "current figures" (benchmarks/current_figures.py)
name their source."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_record(benchmark: str, threads: int) -> dict:
    """benchmark, commit, date, cpu, isa (the kernels' level), threads, load average before, command."""
    from phasewise.kernels.isa import chosen_level

    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), "unknown")
    level = chosen_level()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"benchmark": benchmark, "commit": commit,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": cpu,
            "isa": level.name if level else None, "threads": threads, "loadavg_before": os.getloadavg()[0],
            "command": " ".join(["benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]])}
