"""What one tensor-parallel rank reads: load time and peak memory of rank 0's part of a model
against the whole model, each loaded in a fresh process.

    .venv/bin/python benchmarks/shard_loading.py [--model gemma-3-270m] [--sizes 1 2] [--dtype fp32]

A rank reads only its part of each tensor from the file (loading/sharding.py): the ratios to the
first size show what that saves. No process group is made: rank 0's part is loaded alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, time
from phasewise.distributed import TensorParallel
from phasewise.loading.loader import load_model, resolve_model_path
model, size, dtype = sys.argv[1] or None, int(sys.argv[2]), sys.argv[3]
path = resolve_model_path(model)
started = time.perf_counter()
load_model(path, dtype, tp=TensorParallel(0, size) if size > 1 else None)
print(json.dumps({"seconds": time.perf_counter() - started,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(model: str | None, size: int, dtype: str, repeats: int) -> dict:
    runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD, model or "", str(size), dtype], check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
            for _ in range(repeats)]
    return {"seconds": min(r["seconds"] for r in runs), "peak_mib": min(r["peak_mib"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--repeats", type=int, default=3, help="best of")
    args = ap.parse_args()
    rows = [(size, measure(args.model, size, args.dtype, args.repeats)) for size in args.sizes]
    base = rows[0][1]
    print(f"{'ranks':>5} {'load s':>8} {'ratio':>6} {'peak MiB':>9} {'ratio':>6}")
    for size, r in rows:
        print(f"{size:>5} {r['seconds']:>8.2f} {r['seconds'] / base['seconds']:>6.2f} "
              f"{r['peak_mib']:>9.0f} {r['peak_mib'] / base['peak_mib']:>6.2f}")


if __name__ == "__main__":
    main()
