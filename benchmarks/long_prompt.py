"""Long prompts, where users wait longest (issue 56): time to first token, prefill tok/s and decode at depth
against llama-bench on the same GGUF, in one run:

    .venv/bin/python benchmarks/long_prompt.py [--models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
        [--lengths 512,4096,16384] [--llama-cpp .peers/avx512/bin] [--repeats 2] [--depth-tokens 32]
    PHASEWISE_ISA=avx2 .venv/bin/python benchmarks/long_prompt.py --llama-cpp .peers/avx2/bin

For each model and prompt length N, phasewise in a fresh process (packed cache warm; one warm-up
prompt): a prompt of N distinct random ids, then --depth-tokens more tokens. TTFT is the wall time from
submitting to the first token; prefill tok/s is N over the prompt's time (first scheduled to first
token; the engine's chunks of --max-num-batched-tokens); decode at depth is the output tokens after the
first over their time. llama-bench: `-p N -n 0` (pp N) and `-p 0 -n D -d N` (tg D at depth N), its
means of --repeats runs. The int8 efficiency is what prefill achieves of the int8 dot-product peak
`phasewise roofline` measured on this machine: 2 x the decoder's linear weights x N / prefill seconds /
peak (the output head runs on the last row only; attention's work is not counted, so long prompts
show it as lost efficiency; benchmarks/prefill_profile.py splits the time by part). Writes
docs/results/long_prompt[-<isa>].json. Run it alone: another process changes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from scaling import ROOT, run                                              # noqa: E402

MARK = "@@long_prompt "
PEER_KV = {"model": "f16", "int8": "q8_0", "int4": "q4_0"}   # llama.cpp's cache type for each of ours (-fa on)


def child(model: str, args: argparse.Namespace) -> None:
    """phasewise's figures for every length, in this process: one MARK + JSON line."""
    import torch

    from phasewise import LLM, SamplingParams
    from phasewise.lab.roofline import head_params, linear_params

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    llm = LLM(model=model, max_model_len=max(lengths) + args.depth_tokens + 16,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_dtype=args.kv_dtype)
    cfg = llm.model_config
    rng = random.Random(0)
    llm.generate([[rng.randrange(1000, cfg.vocab_size - 1000) for _ in range(64)]], SamplingParams(max_tokens=2))
    rows = []
    for n in lengths:
        ttft, prefill, decode = [], [], []
        for _ in range(args.repeats):                  # fresh ids every time: no prefix-cache hit
            prompt = [rng.randrange(1000, cfg.vocab_size - 1000) for _ in range(n)]
            params = SamplingParams(max_tokens=1 + args.depth_tokens, temperature=0, ignore_eos=True)
            t = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            m = out.metrics
            ttft.append(m.first_token - m.arrival if m.first_token is not None else time.perf_counter() - t)
            prefill.append(n / (m.prompt_ms / 1e3))
            decode.append((len(out.token_ids) - 1) / (m.decode_ms / 1e3))
        rows.append({"tokens": n, "ttft_s": statistics.median(ttft), "prefill_tps": statistics.median(prefill),
                     "decode_tps_at_depth": statistics.median(decode), "ttft_all_s": ttft, "prefill_all_tps": prefill})
    print(MARK + json.dumps({"rows": rows, "linear_params": linear_params(cfg) - head_params(cfg), "path": str(llm.engine.model_path),
                             "isa": llm.engine.kernels.isa if llm.engine.kernels is not None else "torch",
                             "precision": llm.engine.precision.weights, "kv": llm.engine.precision.kv}), flush=True)


def phasewise(model: str, kv: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}"
             for k in ("lengths", "repeats", "depth_tokens", "threads", "max_num_batched_tokens")] + [f"--kv-dtype={kv}"]
    rc, out, err, peak = run([sys.executable, __file__, "--child", model, *flags])
    line = next((x for x in out.splitlines() if x.startswith(MARK)), None)
    if rc != 0 or line is None:
        raise RuntimeError(f"phasewise on {model} failed (exit {rc}): {err.strip()[-800:]}")
    return {**json.loads(line[len(MARK):]), "peak_rss_gb": peak}


def llama_bench(path: str, kv: str, args: argparse.Namespace) -> dict[str, Any]:
    exe = args.llama_cpp / "llama-bench"
    if not exe.exists():
        return {"skipped": f"no llama-bench in {args.llama_cpp} (make peers-avx512 / peers-avx2)"}
    lengths = args.lengths
    cache = ["-fa", "1", "-ctk", PEER_KV[kv], "-ctv", PEER_KV[kv]] if kv in PEER_KV else []
    rc, out, err, _ = run([str(exe), "-m", path, "-p", lengths, "-n", "0", "-t", str(args.threads),
                           "-r", str(args.repeats), "-o", "json", *cache])
    if rc != 0:
        return {"skipped": f"llama-bench -p failed (exit {rc}): {err.strip()[-400:]}"}
    prefill = {r["n_prompt"]: r["avg_ts"] for r in json.loads(out)}
    rc, out, err, _ = run([str(exe), "-m", path, "-p", "0", "-n", str(args.depth_tokens), "-d", lengths,
                           "-t", str(args.threads), "-r", str(args.repeats), "-o", "json", *cache])
    depth = {r.get("n_depth"): r["avg_ts"] for r in json.loads(out)} if rc == 0 else {}
    return {"prefill_tps": {str(k): v for k, v in prefill.items()},
            "decode_tps_at_depth": {str(k): v for k, v in depth.items()},
            "depth_skipped": None if rc == 0 else f"llama-bench -d failed (exit {rc}): {err.strip()[-300:]}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--lengths", default="512,4096,16384")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--depth-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="phasewise's prefill chunk")
    ap.add_argument("--llama-cpp", type=Path, help="llama-bench's folder (default .peers/<isa>/bin)")
    ap.add_argument("--kv-dtypes", default="auto", help="phasewise KV dtypes to run, e.g. model,int8,int4; "
                    "each against llama-bench's f16 / q8_0 / q4_0 cache with -fa on (auto: defaults on both sides)")
    ap.add_argument("--kv-dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args)

    import torch

    from phasewise.kernels.isa import chosen_level
    from phasewise.lab.roofline import load_machine, measure_machine, save_machine
    from run_record import run_record

    level = chosen_level()
    isa = level.name if level is not None else "torch"
    args.llama_cpp = args.llama_cpp or ROOT / ".peers" / ("avx2" if isa == "avx2" else "avx512") / "bin"
    torch.set_num_threads(args.threads)
    if (machine := load_machine(torch.float32)) is None or not machine.int8_gops:
        print("measuring the machine's roofs (kept for next time) ...", flush=True)
        save_machine(machine := measure_machine(torch.float32), torch.float32)
    record = run_record("long_prompt", args.threads)
    report: dict[str, Any] = {**record, "llama_cpp": str(args.llama_cpp), "int8_peak_gops": machine.int8_gops,
                              "models": {}}
    for model, kv in [(m, kv) for m in args.models.split(",") if m for kv in args.kv_dtypes.split(",")]:
        print(f"{model} (kv {kv}): phasewise ...", flush=True)
        pw = phasewise(model, kv, args)
        print(f"{model} (kv {kv}, llama.cpp {PEER_KV.get(kv, 'default')}): llama-bench ...", flush=True)
        lc = llama_bench(pw["path"], kv, args)
        for row in pw["rows"]:
            row["int8_efficiency"] = 2 * pw["linear_params"] * row["prefill_tps"] / (machine.int8_gops * 1e9)
            peer = lc.get("prefill_tps", {}).get(str(row["tokens"]))
            row["prefill_vs_llama_bench"] = row["prefill_tps"] / peer if peer else None
            depth = lc.get("decode_tps_at_depth", {}).get(str(row["tokens"]))
            row["decode_vs_llama_bench"] = row["decode_tps_at_depth"] / depth if depth else None
            print(f"  {row['tokens']:>6} tokens: TTFT {row['ttft_s']:6.2f} s, prefill {row['prefill_tps']:7.1f} tok/s "
                  f"({row['int8_efficiency']:.0%} of int8 peak; llama-bench {peer or 0:.1f}, "
                  f"{row['prefill_vs_llama_bench'] or 0:.2f}x), decode at depth {row['decode_tps_at_depth']:.1f} "
                  f"(llama-bench {depth or 0:.1f})", flush=True)
        key = model if args.kv_dtypes == "auto" else f"{model} kv={kv}"
        report["models"][key] = {"phasewise": pw, "llama_cpp": lc, "kv_dtype": kv, "llama_cpp_kv": PEER_KV.get(kv)}
    out = args.json or ROOT / "docs" / "results" / f"long_prompt{'' if isa != 'avx2' else '-avx2'}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
