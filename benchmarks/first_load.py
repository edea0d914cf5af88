"""What a user waits for before the first token: a GGUF never seen and the same file cached, each in a
fresh process, as the Python API and as the command line.

    .venv/bin/python benchmarks/first_load.py [--model qwen2.5-coder-1.5b] [--rounds 3] [--json FILE]

Each round copies the GGUF (same name) into an empty folder and points $PHASEWISE_CACHE at an empty
cache (its `kernels` linked to the real one: compiling the kernels is a first install's, not a new
model's), then runs, each in its own process:
- "python": `import phasewise`, `LLM(path)` (the whole constructor: tokenizer, weights packed or
  mapped, KV cache, warm-up) and a one-token `generate`, each timed inside the process;
- "cli": `phasewise generate PROMPT --model PATH -n 1`, its wall time seen from outside;
first on the new copy ("new": nothing cached, the packed-weight cache written), then again ("cached").
Peak RSS is each process's own (getrusage: the API's in-process, the command's from wait4). The copy
was just written, so the page cache holds it: the disk's own reading is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_record import ROOT, run_record                                    # noqa: E402

PROMPT = "Say hello."
CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from phasewise import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1])
t2 = time.perf_counter()
out = "".join(d.text for d in llm.stream([{"role": "user", "content": sys.argv[2]}],
                                         SamplingParams(max_tokens=1, temperature=0)))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1, "generate_s": t3 - t2, "total_s": t3 - t0,
                  "load_ms": llm.load_ms, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PHASEWISE_CACHE": str(cache),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


def python_case(path: Path, cache: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), PROMPT], capture_output=True, text=True,
                         timeout=1800, env=_env(cache))
    if out.returncode != 0:
        raise RuntimeError(f"LLM({path}) failed: {out.stderr.strip()[-600:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cli_case(path: Path, cache: Path) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "generate", PROMPT, "--model", str(path),
                             "-n", "1", "--temperature", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=_env(cache))
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"phasewise generate --model {path} failed: {err.decode()[-600:]}")
    return {"total_s": seconds, "peak_gb": usage.ru_maxrss / 2**20}


def fresh(source: Path, work: Path) -> tuple[Path, Path]:
    """A new copy of `source` and an empty cache (kernels linked) under `work`."""
    from phasewise.config import default_cache_dir

    shutil.rmtree(work, ignore_errors=True)
    (work / "model").mkdir(parents=True)
    copy = Path(shutil.copyfile(source, work / "model" / source.name))
    cache = work / "cache"
    cache.mkdir()
    if (default_cache_dir() / "kernels").is_dir():
        (cache / "kernels").symlink_to(default_cache_dir() / "kernels")
    return copy, cache


def _summary(runs: list[dict[str, float]]) -> str:
    keys = [k for k in ("import_s", "llm_s", "generate_s", "total_s") if k in runs[0]]
    parts = [f"{k.removesuffix('_s')} {statistics.median(r[k] for r in runs):6.2f} s" for k in keys]
    return ", ".join(parts) + f"; peak RSS {statistics.median(r['peak_gb'] for r in runs):.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a packaged model's name or a .gguf file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from phasewise.loading.loader import resolve_model_path

    source = resolve_model_path(args.model)
    file_gb = source.stat().st_size / 2**30
    runs: dict[str, dict[str, list[dict[str, float]]]] = {c: {"python": [], "cli": []} for c in ("new", "cached")}
    with tempfile.TemporaryDirectory(prefix="first_load-") as tmp:
        for _ in range(args.rounds):
            for way, case in (("python", python_case), ("cli", cli_case)):
                copy, cache = fresh(source, Path(tmp) / "round")
                runs["new"][way].append(case(copy, cache))
                runs["cached"][way].append(case(copy, cache))
    result = {**run_record("first_load", 0), "model": args.model, "file": source.name, "file_gb": round(file_gb, 3),
              "rounds": args.rounds, "cases": runs}
    print(f"{args.model}: file {file_gb:.2f} GiB, {args.rounds} rounds (medians)")
    for case, ways in runs.items():
        for way, got in ways.items():
            print(f"{case:>6} {way:>6}: {_summary(got)} (file + {statistics.median(r['peak_gb'] for r in got) - file_gb:.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
