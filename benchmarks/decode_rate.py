"""Decode tokens/s of the engine at batch 1, a few runs in one process, for A/B runs across processes.

    PHASEWISE_ISA=avx2 .venv/bin/python benchmarks/decode_rate.py [--model gemma-3-270m] [--output-len 128] [--runs 4]

Alternate levels (or builds) process by process: a VM's bandwidth drifts over minutes, so one
process per side measured far apart says little.
"""

from __future__ import annotations

import argparse

from phasewise import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory=0.5, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rates = []
    for i in range(args.runs):
        out = llm.generate([[2, 100 + i]], params)[0]          # a one-token prompt after BOS-like id 2
        rates.append((len(out.token_ids) - 1) / (out.metrics.decode_ms / 1e3))
    isa = llm.engine.kernels.isa if llm.engine.kernels is not None else "torch"
    print(f"{isa}: decode tok/s " + " ".join(f"{r:.1f}" for r in rates))


if __name__ == "__main__":
    main()
