"""What a load costs in time and memory: the first (packing the GGUF into the packed-weight cache), a
cached one (mapping it), and one without the cache, each in a fresh process, alternating.

    .venv/bin/python benchmarks/first_load.py [--model qwen2.5-coder-1.5b] [--rounds 3] [--json FILE]

A load is `load_prepared` at the default q4 weights with the kernels (the model alone: no tokenizer,
no KV cache, no warm-up); its seconds, and the process's peak RSS (VmHWM) against the file's size.
The cache entry of the file is removed before each "first" load (and after the run); the page cache
stays warm, so the file's own reading is not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_record import run_record                                           # noqa: E402
from scaling import forget_packed                                           # noqa: E402

MODES = ("first", "cached", "no cache")
CHILD = """
import json, sys, time
from phasewise.kernels import build
from phasewise.loading.loader import load_prepared
kernels, path = build.load(), sys.argv[1]
start = time.perf_counter()
model, _ = load_prepared(__import__("pathlib").Path(path), "q4", "cpu", kernels, packed_cache=sys.argv[2] != "no cache")
model.build_stack(kernels)
seconds = time.perf_counter() - start
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 2**20
print(json.dumps({"load_s": seconds, "peak_gb": peak}))
"""


def load(path: Path, mode: str) -> dict[str, float]:
    if mode == "first":
        forget_packed(path)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"a {mode} load failed: {out.stderr.strip()[-600:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from phasewise.loading.loader import resolve_model_path

    path = resolve_model_path(args.model)
    file_gb = path.stat().st_size / 2**30
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                runs[mode].append(load(path, mode))
    finally:
        forget_packed(path)
    result = {**run_record("first_load", 0), "model": args.model, "file_gb": round(file_gb, 3), "modes": {}}
    print(f"{args.model}: file {file_gb:.2f} GiB, {args.rounds} rounds")
    for mode in MODES:
        secs, peaks = [r["load_s"] for r in runs[mode]], [r["peak_gb"] for r in runs[mode]]
        result["modes"][mode] = {"load_s": secs, "peak_gb": peaks}
        print(f"{mode:>9}: load {statistics.median(secs):5.2f} s ({min(secs):.2f}-{max(secs):.2f}), "
              f"peak RSS {statistics.median(peaks):.2f} GiB ({min(peaks):.2f}-{max(peaks):.2f}; "
              f"file + {statistics.median(peaks) - file_gb:.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
