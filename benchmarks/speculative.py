"""Speculative decoding: decode tokens/s with and without each proposer, on an input-grounded task and on
open-ended generation, alone and with several requests at once.

    .venv/bin/python benchmarks/speculative.py [--model M] [--proposers none ngram draft] [--tasks grounded open code]
                                               [--batches 1 8] [--requests 8] [--max-tokens 128] [-k 4]
                                               [--draft-model PATH] [--draft-dtype q4] [--temperature 0] [--fixed]

Tasks: "grounded" summarizes a paragraph of benchmarks/data/lighthouses.txt (the
answer reuses the input's words: prompt lookup can find them); "open" writes a
short story on a topic (nothing to look up); "code" writes a small program (what a
code model is asked). Every request is greedy by default
and stops at the end of its answer or --max-tokens; greedy outputs with
speculation must equal those without (the table says so per row).

Batch 1: --requests requests one after another; batch B: the same requests
submitted B at a time. Decode tok/s = output tokens after each request's first /
the time from the first of those tokens to the last (summed over the sequential
runs at batch 1; the whole wave's span at batch B, which includes prefills that
overlap the decodes). Acceptance rate = accepted / proposed draft tokens; mean
accepted length = tokens committed per verification step (accepted + the target's
own), from 1 to k + 1. The proposers' engines are built first and run in turn within each round
(--rounds), so drift on a noisy machine falls on all alike: the speed-up is the median (and range) of
each round's ratio to plain decoding. Each request's drafts adapt (core/spec_policy.py) up to k; "mean k" is the
drafts chosen per decode on average (--fixed: always k).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "lighthouses.txt"
TOPICS = ["a robot who finds a flower", "a lighthouse keeper's last night", "a cat who learns to swim",
          "a city without clocks", "the first snow of winter", "a letter lost for fifty years",
          "a baker who cannot sleep", "a train that never stops"]
PROGRAMS = ["a Python function that checks whether a number is prime", "a quicksort in Python with type hints",
            "a C function that reverses a linked list", "a Python class for a bank account with deposit and withdraw",
            "a JavaScript function that debounces another function", "a Python function that parses a CSV line",
            "a Rust function that counts the words of a string", "a SQL query for the ten best-selling products"]


def prompts(task: str, n: int) -> list[list[dict]]:
    if task == "grounded":
        paras = [p for p in TEXT.read_text().split("\n\n") if len(p) > 300]
        texts = [f"Summarize the following text in three sentences.\n\n{paras[i % len(paras)]}" for i in range(n)]
    elif task == "code":
        texts = [f"Write {PROGRAMS[i % len(PROGRAMS)]}." for i in range(n)]
    else:
        texts = [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]
    return [[{"role": "user", "content": t}] for t in texts]


def run(llm, chats: list[list[dict]], batch: int, params) -> dict:
    """Submit the chats `batch` at a time; decode rate, acceptance and the outputs."""
    outs, decode_s, n_decode = [], 0.0, 0
    core = llm.engine.core
    before = (core.spec.num_steps, core.spec.num_draft_tokens, core.spec.num_accepted_tokens)
    started = time.perf_counter()
    for i in range(0, len(chats), batch):
        wave = llm.chat(chats[i:i + batch], params)
        firsts = [o.metrics.first_token for o in wave if o.metrics.token_times]
        lasts = [o.metrics.token_times[-1] for o in wave if o.metrics.token_times]
        decode_s += max(lasts) - min(firsts)
        n_decode += sum(max(len(o.token_ids) - 1, 0) for o in wave)
        outs += wave
    steps, drafts, accepted = (a - b for a, b in zip(
        (core.spec.num_steps, core.spec.num_draft_tokens, core.spec.num_accepted_tokens), before))
    chosen = [(k, n) for o in outs for k, n in o.metrics.spec_k_chosen.items()]
    mean_k = sum(k * n for k, n in chosen) / sum(n for _, n in chosen) if chosen else None
    return {"tok_s": n_decode / decode_s if decode_s else 0.0, "wall_s": time.perf_counter() - started,
            "mean_k": mean_k,
            "tokens": sum(len(o.token_ids) for o in outs), "drafts": drafts,
            "acceptance": accepted / drafts if drafts else 0.0,
            "mean_len": 1 + accepted / steps if steps else 0.0,
            "token_ids": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proposers", nargs="+", default=["none", "ngram", "draft"],
                    help="none | ngram | draft (the draft model below) | mtp (the model's own MTP layer)")
    ap.add_argument("--tasks", nargs="+", default=["grounded", "open"], choices=["grounded", "open", "code"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=8, help="requests per (proposer, task, batch)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--model", default=None, help="the target: a .gguf file or a packaged model (default: the "
                    "default model)")
    ap.add_argument("--draft-model", default=None, help="default: the target's own file")
    ap.add_argument("--draft-dtype", default="q4", choices=["fp32", "bf16", "fp16", "int8", "q4"])
    ap.add_argument("--dtype", default="fp32", help="the target's weights")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs must match)")
    ap.add_argument("--fixed", action="store_true", help="always draft k (no adaptation)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per row, the proposers alternating in each")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from phasewise import LLM, SamplingParams
    from phasewise.config import SpeculativeConfig

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0 if args.temperature
                            else None)
    engines = {}
    for proposer in args.proposers:                  # all built first: their runs alternate, round by round
        spec = SpeculativeConfig(method=None if proposer == "none" else proposer,
                                 num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min,
                                 ngram_max=args.ngram_max, draft_model=args.draft_model, draft_dtype=args.draft_dtype,
                                 adaptive=not args.fixed)
        weights = {"quantization": args.dtype} if args.dtype in ("int8", "q4") else {"dtype": args.dtype}
        engines[proposer] = LLM(args.model, **weights, kv_cache_memory=0.5, speculative=spec)
        engines[proposer].chat(prompts("open", 1)[0], SamplingParams(temperature=0, max_tokens=16))   # warm every path
    results: dict[tuple, list[dict]] = {}
    for task in args.tasks:
        chats = prompts(task, args.requests)
        for batch in args.batches:
            for _ in range(args.rounds):
                for proposer, llm in engines.items():
                    results.setdefault((proposer, task, batch), []).append(run(llm, chats, batch, params))
    report(args, results)


def report(args: argparse.Namespace, results: dict[tuple, list[dict]]) -> None:
    """The table (medians of the rounds; speed-up: the median of each round's ratio to plain decoding in
    the same round, and its range), and the JSON."""
    draft = f"draft = {args.draft_model or 'the target'} at {args.draft_dtype}"
    print(f"speculative decoding: {args.dtype} target, k {'=' if args.fixed else '<='} {args.num_speculative_tokens}, n-gram "
          f"{args.ngram_min}..{args.ngram_max}, {draft}; {args.requests} requests per row, up to "
          f"{args.max_tokens} tokens, temperature {args.temperature}; {args.rounds} rounds, alternating")
    print(f"{'proposer':>8} {'task':>9} {'batch':>5} {'decode tok/s':>12} {'speedup':>16} {'accept':>7} "
          f"{'mean len':>8} {'mean k':>6} {'drafts':>7} {'tokens':>7} {'same':>5}")
    rows = []
    for (proposer, task, batch), runs in results.items():
        base = results.get(("none", task, batch))
        tok_s = statistics.median(r["tok_s"] for r in runs)
        ratios = sorted(r["tok_s"] / b["tok_s"] for r, b in zip(runs, base) if b["tok_s"]) if base else []
        speedup = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})" if ratios else "-"
        same = "-" if base is None or args.temperature else \
            ("yes" if all(r["token_ids"] == base[0]["token_ids"] for r in runs) else "NO")
        r = runs[-1]
        accept = f"{r['acceptance']:.1%}" if r["drafts"] else "-"
        mean_len = f"{r['mean_len']:.2f}" if r["drafts"] else "-"
        mean_k = "-" if r["mean_k"] is None else f"{r['mean_k']:.2f}"
        print(f"{proposer:>8} {task:>9} {batch:>5} {tok_s:>12.1f} {speedup:>16} {accept:>7} {mean_len:>8} "
              f"{mean_k:>6} {r['drafts']:>7} {r['tokens']:>7} {same:>5}")
        rows.append({"proposer": proposer, "task": task, "batch": batch, "tok_s": [x["tok_s"] for x in runs],
                     "speedup": ratios, "acceptance": r["acceptance"], "mean_len": r["mean_len"],
                     "mean_k": r["mean_k"], "same": same})
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")

if __name__ == "__main__":
    main()
