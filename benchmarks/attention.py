"""Prefill attention over the paged KV cache, one layer: a T-token prompt attending causally to
itself, the compiled tile kernel (kernels/csrc/tile_attention.cpp) at an ISA level.

    .venv/bin/python benchmarks/attention.py                       # Gemma 3 270M's heads, int8 cache
    .venv/bin/python benchmarks/attention.py --heads 9,3 --head-size 64 --level avx2

Prints the best of --repeats timings (each the mean of 10 calls) and GFLOP/s (QK and PV: 4 Hq D
per query-key pair, T (T + 1) / 2 pairs).
"""

from __future__ import annotations

import argparse
import time

import torch

from phasewise.kernels import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", default="4,1", help="query heads, KV heads")
    ap.add_argument("--head-size", type=int, default=256)
    ap.add_argument("--float-cache", action="store_true", help="fp32 KV cache (default: int8)")
    ap.add_argument("--level", default=None, help="ISA level (default: the best this CPU runs)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ops = build.load(args.level)
    hq, hkv = (int(v) for v in args.heads.split(","))
    t, d, bs = args.tokens, args.head_size, 16
    slots = -(-t // bs) * bs
    q = torch.randn(t, hq, d)
    fresh = torch.randn(t, hkv, d)                # the prompt's own keys (an int8 cache's partial groups)
    if args.float_cache:
        kv = [torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)]
    else:                                         # runner/kv_cache.py's layout, one tail slot
        kv = [torch.randint(-127, 128, (slots, hkv, d), dtype=torch.int8) for _ in range(2)]
        kv += [torch.rand(slots // 16, hkv, 2, d) * 0.01, torch.rand(slots, hkv) * 0.01,
               torch.zeros(2, 16, hkv, d), torch.full((1, 2), -1, dtype=torch.int64)]
    tables = torch.arange(slots // bs, dtype=torch.int64)[None]
    seq, lens = torch.zeros(t, dtype=torch.int64), torch.arange(1, t + 1, dtype=torch.int64)
    seqs = torch.tensor([[0, t, 0, 0]], dtype=torch.int64)   # one sequence: all its tokens new, tail slot 0

    def call():
        return ops.paged_attention(q, kv, tables, seq, lens, seqs, bs, d ** -0.5, fresh=fresh)

    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(10):
            call()
        best = min(best, (time.perf_counter() - start) / 10)
    flops = 4 * hq * d * t * (t + 1) / 2
    cache = "fp32" if args.float_cache else "int8"
    print(f"{ops.isa}: {t} tokens, {hq}/{hkv} heads of {d}, {cache} cache: {best * 1e3:.2f} ms a layer, "
          f"{flops / best / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
