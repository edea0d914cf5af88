"""phasewise and llama.cpp on a busy machine: decode, prefill and the ITL of 8 concurrent streams with
0, 1 and 2 busy-looping processes beside them (issue 44), in one run.

    .venv/bin/python benchmarks/busy_machine.py [--model M] [--busy 0 1 2] [--llama-cpp .peers/avx512/bin]
        [--input-len 512] [--output-len 128] [--repeats 2] [--no-served] [--ab-rounds 3] [--pairs 4]
        [--json docs/results/busy_machine_<model>_<isa>.json]

A busy process is `python -c "while True: pass"` (nice 0, as a browser tab or a compile job is),
started before and killed after each measurement, whatever happens. phasewise runs in this process
with its default threads (auto: runner/thread_governor.py); llama.cpp's `llama-bench` runs on the
same file with `-t 2` and `-t 1` (the best of the two is what a user who knew the load would pick).
Figures:

- decode tok/s: (--output-len − 1) / first-to-last-token time from an 8-token prompt (llama-bench
  tg<output-len>); prefill tok/s: --input-len distinct ids / time to the first token (pp<input-len>);
  phasewise's are medians of --repeats, llama-bench's means of -r --repeats;
- ITL p50 / p99 (ms): 8 streams decoding --output-len tokens together (phasewise offline, the gaps
  between each request's tokens); and served: `phasewise serve` (default threads) loaded by
  `phasewise bench serve` with 16 requests of 128-token prompts, 8 at a time;
- idle A/B: at each of --ab-rounds, decode and prefill with the thread count adapting, pinned at the
  maximum and pinned at one thread (the same engine, alternating): adapting should cost nothing on a
  free machine, and one thread against the maximum is the most "kept" can be with one core busy;
- "kept": the share of phasewise's idle figure left under load, from --pairs rounds that each
  measure the free machine and then the loaded one (a ratio a minute apart: this VM's idle speed
  drifts by a third between minutes), median and range; "vs best": against the better of
  llama-bench -t 1 and -t 2 under the same load.

Before each loaded measurement the engine decodes for SETTLE_S, so that the governor has seen the
load (and after it, the free machine again): what is measured is the count it chose, not its first
look.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTLE_S = 0.6           # three of the governor's windows (runner/thread_governor.py)


@contextmanager
def busy(n: int):
    """n busy-looping processes for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)                    # let them reach the run queue
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def settle(llm, run: int) -> None:
    """Decode for SETTLE_S: the thread governor looks at the CPUs only between steps."""
    from phasewise import SamplingParams

    started = time.monotonic()
    while time.monotonic() - started < SETTLE_S:
        llm.generate([[900 + run % 50, 901, 902]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))


def measure_phasewise(llm, args, run: int, itl: bool = True) -> dict:
    """run: this measurement's number, so that its prompts share no prefix with an earlier one's
    (a prefix-cache hit would skip the prefill it measures)."""
    from phasewise import SamplingParams

    vocab, n, first = llm.model_config.vocab_size, args.input_len, 1000 + 97 * run
    greedy = dict(temperature=0, ignore_eos=True)
    decode, prefill = [], []
    for r in range(args.repeats):                     # fresh prompts: no prefix-cache hits
        out = llm.generate([[first + r] + [1000 + 8 * r + i for i in range(7)]],
                           SamplingParams(max_tokens=args.output_len, **greedy))[0]
        decode.append((len(out.token_ids) - 1) / (out.metrics.decode_ms / 1e3))
        out = llm.generate([[first + 50 + r] + [(2000 + n * r + i) % vocab for i in range(n - 1)]],
                           SamplingParams(max_tokens=1, **greedy))[0]
        prefill.append(n / (out.metrics.prompt_ms / 1e3))
    rates = {"decode_tps": statistics.median(decode), "prefill_tps": statistics.median(prefill)}
    if not itl:
        return rates
    outs = llm.generate([[first + 60 + i] + [(3000 + 8 * i + j) % vocab for j in range(7)] for i in range(8)],
                        SamplingParams(max_tokens=args.output_len, **greedy))
    gaps = sorted(g for o in outs for g in o.metrics.itl_ms)
    return {**rates, "threads": llm.engine.threads.threads, "itl_p50_ms": gaps[len(gaps) // 2], "itl_p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]}


def idle_ab(llm, args) -> dict:
    """Decode and prefill tok/s on the free machine, alternating: the governor adapting, pinned at its
    maximum, and pinned at one thread (what one busy core leaves at best: the ceiling of "kept")."""
    governor = llm.engine.threads
    modes = {"adapting": None, "pinned": governor.max_threads, "one thread": 1}
    out = {mode: [] for mode in modes}
    for i in range(args.ab_rounds):
        for j, (mode, threads) in enumerate(modes.items()):
            governor.pin(threads)
            out[mode].append(measure_phasewise(llm, args, 100 + 3 * i + j, itl=False))
    governor.pin(None)
    return out


def kept_pairs(llm, args, n: int) -> dict:
    """--pairs rounds of: decode and prefill on the free machine, then beside n busy loops (both after
    settling); each round's loaded figure over its idle one."""
    kept = {"decode_tps": [], "prefill_tps": []}
    for i in range(args.pairs):
        settle(llm, i)
        idle = measure_phasewise(llm, args, 300 + 2 * i + 40 * n, itl=False)
        with busy(n):
            settle(llm, i)
            loaded = measure_phasewise(llm, args, 301 + 2 * i + 40 * n, itl=False)
        for k in kept:
            kept[k].append(loaded[k] / idle[k])
        print(f"pair {i}, busy {n}: decode {idle['decode_tps']:.1f} -> {loaded['decode_tps']:.1f}, prefill "
              f"{idle['prefill_tps']:.1f} -> {loaded['prefill_tps']:.1f} tok/s", flush=True)
    return kept


def measure_served(model: str | None, busy_levels: list[int], output_len: int) -> dict:
    """ITL of 8 concurrent streams through `phasewise serve` (default threads) at each busy level."""
    import serving

    cmd = [sys.executable, "-m", "phasewise.cli", "serve", "--port", "{port}", "--max-num-seqs", "8",
           "--no-access-log", *(["--model", model] if model else [])]
    out = {}
    with serving.running(cmd) as url:
        for n in busy_levels:
            with busy(n):
                run = serving.bench(url, num_prompts=16, input_len=128, output_len=output_len, concurrency=8)
            out[n] = {"itl_p50_ms": run["itl_ms"]["median"], "itl_p99_ms": run["itl_ms"]["p99"],
                      "output_tps": run["output_token_throughput"]}
            print(f"served, busy {n}: ITL p50 {out[n]['itl_p50_ms']:.1f} p99 {out[n]['itl_p99_ms']:.1f} ms", flush=True)
    return out


def measure_llama_bench(path: Path, threads: int, args) -> dict:
    exe = args.llama_cpp / "llama-bench"
    done = subprocess.run([str(exe), "-m", str(path), "-p", str(args.input_len), "-n", str(args.output_len),
                           "-t", str(threads), "-r", str(args.repeats), "-o", "json"], capture_output=True, text=True,
                          timeout=1200)      # -t 2 beside two busy loops decoded 0.3 tok/s here: minutes a run
    if done.returncode != 0:
        return {"skipped": f"llama-bench failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"}
    ts = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in json.loads(done.stdout)}
    return {"decode_tps": ts.get((0, args.output_len)), "prefill_tps": ts.get((args.input_len, 0))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or a packaged model's name (default: the default model)")
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="busy-looping processes beside")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="folder of llama-bench (default: .peers/avx512/bin "
                                                                  "if built, else .peers/native/bin)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-served", dest="served", action="store_false", help="skip the served ITL")
    ap.add_argument("--ab-rounds", type=int, default=3, help="idle A/B rounds, adapting against pinned (0: none)")
    ap.add_argument("--pairs", type=int, default=4, help="idle-then-loaded rounds behind \"kept\"")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    if args.llama_cpp is None:
        level = "avx2" if os.environ.get("PHASEWISE_ISA") == "avx2" else \
            "avx512" if (ROOT / ".peers" / "avx512" / "bin").exists() else "native"
        args.llama_cpp = ROOT / ".peers" / level / "bin"
    from run_record import run_record

    import torch

    from phasewise import LLM

    record = run_record("busy_machine", torch.get_num_threads())
    llm = LLM(args.model)
    path = llm.engine.model_path
    peer = (args.llama_cpp / "llama-bench").exists()
    ab = idle_ab(llm, args) if args.ab_rounds else None      # first: the governor has seen only a free machine
    rows = []
    for n in args.busy:
        with busy(n):
            settle(llm, len(rows))
            row = {"busy": n, "phasewise": measure_phasewise(llm, args, len(rows))}
            for t in (2, 1):
                if peer:
                    row[f"llama_bench_t{t}"] = measure_llama_bench(path, t, args)
        rows.append(row)
        pw = row["phasewise"]
        print(f"busy {n}: phasewise decode {pw['decode_tps']:.1f} prefill {pw['prefill_tps']:.1f} tok/s, ITL p50 "
              f"{pw['itl_p50_ms']:.1f} p99 {pw['itl_p99_ms']:.1f} ms" +
              "".join(f"; llama-bench -t {t} decode {row[f'llama_bench_t{t}'].get('decode_tps') or 0:.1f} prefill "
                      f"{row[f'llama_bench_t{t}'].get('prefill_tps') or 0:.1f}" for t in (2, 1) if peer), flush=True)
    for r in rows:
        if r["busy"] and args.pairs:
            r["kept_pairs"] = kept_pairs(llm, args, r["busy"])
    served = measure_served(args.model, args.busy, args.output_len) if args.served else {}
    for r in rows:
        if r["busy"] in served:
            r["served"] = served[r["busy"]]
    if ab:
        for k in ("decode_tps", "prefill_tps"):
            rng = {m: (min(x[k] for x in v), max(x[k] for x in v)) for m, v in ab.items()}
            print(f"idle A/B {k}: " + ", ".join(f"{m} {lo:.0f}-{hi:.0f}" for m, (lo, hi) in rng.items()))
    idle = next((r["phasewise"] for r in rows if r["busy"] == 0), None)
    idle_served = served.get(0)
    print(f"\n{'busy':>4} {'decode kept':>12} {'prefill kept':>13} {'decode vs best':>15} {'prefill vs best':>16} "
          f"{'ITL p99 / idle':>15} {'served p99 / idle':>18}")
    for r in rows:
        pw = r["phasewise"]
        best = {k: max((r.get(f"llama_bench_t{t}", {}).get(k) or 0) for t in (1, 2)) for k in ("decode_tps", "prefill_tps")}
        r["vs_best"] = {k: pw[k] / best[k] if best[k] else None for k in best}
        if "kept_pairs" in r:
            r["kept"] = {k: statistics.median(v) for k, v in r["kept_pairs"].items()}
        else:
            r["kept"] = {k: pw[k] / idle[k] for k in ("decode_tps", "prefill_tps")} if idle else None
        kept = r["kept"] or {}
        fmt = lambda x, pct=False: "—" if x is None else (f"{x:.0%}" if pct else f"{x:.2f}x")  # noqa: E731
        print(f"{r['busy']:>4} {fmt(kept.get('decode_tps'), True):>12} {fmt(kept.get('prefill_tps'), True):>13} "
              f"{fmt(r['vs_best']['decode_tps']):>15} {fmt(r['vs_best']['prefill_tps']):>16} "
              f"{fmt(pw['itl_p99_ms'] / idle['itl_p99_ms'] if idle else None):>15} "
              f"{fmt(r['served']['itl_p99_ms'] / idle_served['itl_p99_ms'] if idle_served and 'served' in r else None):>18}")
    for r in rows:
        if "kept_pairs" in r:
            print(f"busy {r['busy']}, kept over {args.pairs} pairs: " + ", ".join(
                f"{k.split('_')[0]} {min(v):.0%}-{max(v):.0%}" for k, v in r["kept_pairs"].items()))
    if args.json:
        args.json.write_text(json.dumps({**record, "model": args.model or path.name, "llama_cpp": str(args.llama_cpp),
                                         "input_len": args.input_len, "output_len": args.output_len,
                                         "rows": rows, "idle_ab": ab}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
