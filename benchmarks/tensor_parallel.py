"""Tensor parallelism on this machine: one request's prefill and decode with the model split over N
ranks (gloo over loopback), against one rank, in one run.

    .venv/bin/python benchmarks/tensor_parallel.py [--sizes 1 3] [--input-len 256] [--output-len 64]
                                                   [--dtype auto] [--repeats 3]

Each size loads the default model (or --model) split over N processes on this machine (the
threads shared evenly), runs --repeats requests of --input-len random tokens and --output-len
greedy tokens (ignore_eos, the prefix cache off), and prints TTFT and the median inter-token
latency (medians over the repeats) and their ratio to the first size.
"""

from __future__ import annotations

import argparse
import random
import statistics

from phasewise import LLM
from phasewise.core.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for size in args.sizes:
        weights = {"quantization": args.dtype} if args.dtype in ("int8", "q4") else {"dtype": args.dtype}
        with LLM(args.model, **weights, tensor_parallel_size=size, enable_prefix_caching=False,
                 kv_cache_memory=0.25) as llm:
            vocab = llm.model_config.vocab_size
            rng = random.Random(0)
            ttft, itl = [], []
            for _ in range(args.repeats):
                prompt = [rng.randrange(100, vocab) for _ in range(args.input_len)]
                out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))[0]
                m = out.metrics
                ttft.append(m.ttft_ms)
                itl.append(statistics.median(m.itl_ms))
            rows.append((size, llm.engine.precision.weights, statistics.median(ttft), statistics.median(itl)))
            print(f"N={size}: TTFT {rows[-1][2]:.1f} ms, ITL median {rows[-1][3]:.1f} ms", flush=True)
    base = rows[0]
    print(f"{'ranks':>5} {'weights':>8} {'TTFT ms':>9} {'ITL ms':>8} {'TTFT x':>7} {'ITL x':>6}"
          f"   ({args.input_len}-token prompt, {args.output_len} tokens, medians of {args.repeats})")
    for size, weights, t, i in rows:
        print(f"{size:>5} {weights:>8} {t:>9.1f} {i:>8.1f} {t / base[2]:>7.2f} {i / base[3]:>6.2f}")


if __name__ == "__main__":
    main()
