"""Offline throughput under concurrency, and what prefix caching does to TTFT.

    .venv/bin/python benchmarks/offline_throughput.py [--max-concurrency 1 8 32 64] [--input-len 128]
                                                      [--output-len 128] [--shared-requests 8]

Part 1: for each concurrency c, c requests of random prompt tokens (distinct, so
no prefix is shared) arrive together and each generates exactly --output-len
tokens (ignore_eos); throughput = all output tokens / wall time from submission
to the last token. Part 2: --shared-requests requests, one after another, share
a ~400-token system prompt and differ in the question; mean TTFT of all but the
first, with prefix caching on and off.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

SYSTEM = ("You are a meticulous assistant for a museum of maritime history. " * 34).strip()
QUESTIONS = ["When was the first lighthouse built?", "What is a sextant?", "Who was Magellan?",
             "What is a clipper ship?", "How do tides work?", "What is a galleon?", "Why is the sea salty?",
             "What does a harbour master do?", "How did sailors navigate by the stars?", "What is a knot?"]


def throughput(llm, concurrency: int, prompt_tokens: int, output_tokens: int, seed: int) -> dict:
    from phasewise import SamplingParams

    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    steps_before = llm.engine.core.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    steps = list(llm.engine.core.steps)[steps_before - llm.engine.core.num_steps:]
    n_out = sum(len(o.token_ids) for o in outs)
    itl = [g for o in outs for g in o.metrics.itl_ms]
    return {
        "concurrency": concurrency, "output_tokens": n_out, "wall_s": wall, "tok_per_s": n_out / wall,
        "ttft_ms_median": statistics.median(o.metrics.ttft_ms for o in outs),
        "itl_ms_median": statistics.median(itl) if itl else 0.0,
        "max_batch": max(s.batch_size for s in steps),
    }


def shared_prefix_ttft(llm, n: int) -> tuple[float, float, int]:
    """(TTFT of the first request, mean TTFT of the others, mean cached tokens of the others)."""
    from phasewise import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % 10]}],
                     params) for i in range(n)]
    rest = outs[1:]
    return (outs[0].metrics.ttft_ms, statistics.mean(o.metrics.ttft_ms for o in rest),
            round(statistics.mean(o.cached_tokens for o in rest)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--shared-requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from phasewise import LLM

    llm = LLM()
    print(f"offline throughput: {args.input_len} prompt tokens, {args.output_len} output tokens "
          f"per request (ignore_eos), fp32, max_num_batched_tokens 512, max_num_seqs 64")
    print(f"{'concurrency':>11} {'output tok/s':>13} {'wall s':>8} {'TTFT med ms':>12} {'ITL med ms':>11} "
          f"{'max batch':>10}")
    base = None
    for c in args.max_concurrency:
        r = throughput(llm, c, args.input_len, args.output_len, args.seed + c)
        base = base or r["tok_per_s"]
        print(f"{c:>11} {r['tok_per_s']:>13.1f} {r['wall_s']:>8.1f} {r['ttft_ms_median']:>12.1f} "
              f"{r['itl_ms_median']:>11.1f} {r['max_batch']:>10}   ({r['tok_per_s'] / base:.1f}x c=1)")

    print(f"\nshared-prefix workload: {args.shared_requests} requests one after another, "
          "same ~400-token system prompt, different questions")
    on = shared_prefix_ttft(llm, args.shared_requests)
    off_llm = LLM(enable_prefix_caching=False)
    off = shared_prefix_ttft(off_llm, args.shared_requests)
    print(f"{'prefix caching':>15} {'first TTFT ms':>14} {'later TTFT ms':>14} {'cached tokens':>14}")
    for name, (first, later, cached) in (("on", on), ("off", off)):
        print(f"{name:>15} {first:>14.1f} {later:>14.1f} {cached:>14}")
    print(f"later-request TTFT with caching: {on[1] / off[1]:.2f}x of without ({off[1] / on[1]:.1f}x faster)")


if __name__ == "__main__":
    main()
