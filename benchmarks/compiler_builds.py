"""Decode speed of the kernels built three ways: GCC with OpenMP (the default on Linux), GCC and clang
with the kernels' own threads (PHASEWISE_OPENMP=0, as a Mac without libomp builds them), on one model.

    .venv/bin/python benchmarks/compiler_builds.py [--model PATH] [--rounds 2] [--out docs/results/compiler_builds.json]

Each round runs benchmarks/decode_rate.py once per build, alternating processes (a VM's bandwidth
drifts over minutes); a build's figure is the median of its runs. The builds sit in the kernel
cache under their own hashes (flags and compiler are hashed), so the first round also builds them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BUILDS = {"gcc-openmp": {"CXX": "g++", "PHASEWISE_OPENMP": "1"},
          "gcc-own-threads": {"CXX": "g++", "PHASEWISE_OPENMP": "0"},
          "clang-own-threads": {"CXX": "clang++", "PHASEWISE_OPENMP": "0"}}


def decode_rates(env: dict[str, str], model: str | None) -> list[float]:
    cmd = [sys.executable, str(HERE / "decode_rate.py"), "--runs", "4"] + (["--model", model] if model else [])
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return [float(x) for x in re.search(r"decode tok/s ([\d. ]+)", done.stdout).group(1).split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    missing = [b["CXX"] for b in BUILDS.values() if shutil.which(b["CXX"]) is None]
    if missing:
        print(f"error: {', '.join(missing)} not found (Debian: apt-get install clang)", file=sys.stderr)
        return 2
    rates: dict[str, list[float]] = {name: [] for name in BUILDS}
    for r in range(args.rounds):
        for name, env in BUILDS.items():
            rates[name] += decode_rates(env, args.model)
            print(f"round {r + 1} {name}: " + " ".join(f"{x:.1f}" for x in rates[name][-4:]), flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    base = medians["gcc-openmp"]
    print("decode tok/s, median: " + ", ".join(f"{n} {m:.1f} ({m / base:.2f}x)" for n, m in medians.items()))
    if args.out:
        args.out.write_text(json.dumps({"model": args.model or "default", "rates": rates, "medians": medians,
                                        "over_gcc_openmp": {n: m / base for n, m in medians.items()}},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
