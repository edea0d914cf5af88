"""Which KV-cache quantization scheme holds a model's perplexity: K and V fake-quantized (quantized and
dequantized in PyTorch) before attention reads them, over a float cache and fp32 weights, so the scheme
is the only change. For choosing what the int8 and int4 caches store before writing their kernels.

    .venv/bin/python benchmarks/kv_schemes.py --model FILE [--text FILE] [--tokens 2048]
                                              [--schemes none,tok8,blk8x32,kchan8+tok8,...] [--json OUT]

A scheme is `K` or `K+V` (the same for both when one is given), each one of:
    none            float
    tokB            symmetric, one scale per token and head (phasewise's int8 cache today), B bits
    blkBxG          symmetric, one scale per G values within a head (llama.cpp's q8_0 / q4_0: G = 32)
    ablkBxG         asymmetric (min and step) per G values within a head
    rotBxG          a Hadamard rotation over the head, then blkBxG (rotated back after)
    kchanB          asymmetric per channel over each block of 16 tokens (KIVI's keys, a paged block's)
    kmidB           per channel the midpoint over each block of 16 tokens, one symmetric step per block
                    and head around it (the int8 cache's keys: one query scale serves every block)
The text is scored as independent windows of --tokens (one by default), teacher-forced.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import torch

import phasewise.models.llama as llama
from phasewise.layers.attention import AttentionMetadata
from phasewise.loading.loader import load_prepared, resolve_model_path
from phasewise.runner.kv_cache import KVCache
from phasewise.tokenization.tokenizer import Tokenizer

DEFAULT = "none,tok8,blk8x32,rot8x32,kchan8+tok8,kchan8+ablk8x32,kchan4+ablk4x32,kchan4+none,none+ablk4x32"
BLOCK = 16


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(d)


def grouped(x: torch.Tensor, bits: int, group: int, asym: bool) -> torch.Tensor:
    """x [..., D] quantized and back in groups of `group` along the head."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    if asym:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        step = torch.where(hi > lo, (hi - lo) / (2 ** bits - 1), torch.ones_like(hi))
        return (torch.round((g - lo) / step).clamp(0, 2 ** bits - 1) * step + lo).reshape(x.shape)
    top = 2 ** (bits - 1) - 1
    amax = g.abs().amax(-1, keepdim=True)
    step = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    return (torch.round(g / step).clamp(-top, top) * step).reshape(x.shape)


def per_channel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [T, H, D] (one sequence from position 0) quantized and back per channel over blocks of 16 tokens."""
    T, pad = x.shape[0], -x.shape[0] % BLOCK
    xp = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])]) if pad else x
    g = xp.reshape(-1, BLOCK, *x.shape[1:])
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    step = torch.where(hi > lo, (hi - lo) / (2 ** bits - 1), torch.ones_like(hi))
    return (torch.round((g - lo) / step).clamp(0, 2 ** bits - 1) * step + lo).reshape(xp.shape)[:T]


def mid_channel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [T, H, D] quantized and back as kmidB: per block of 16 tokens and head, each channel's midpoint
    and one step for all channels (the largest half-range / (2^(bits-1) - 1))."""
    T, pad = x.shape[0], -x.shape[0] % BLOCK
    xp = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])]) if pad else x
    g = xp.reshape(-1, BLOCK, *x.shape[1:])                     # [blocks, 16, H, D]
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    mid, top = (lo + hi) / 2, 2 ** (bits - 1) - 1
    half = ((hi - lo) / 2).amax(-1, keepdim=True)
    step = torch.where(half > 0, half / top, torch.ones_like(half))
    return (torch.round((g - mid) / step).clamp(-top, top) * step + mid).reshape(xp.shape)[:T]


def quantizer(spec: str, head_dim: int):
    """The fake quantizer of one scheme part."""
    if spec == "none":
        return lambda x: x
    m = re.fullmatch(r"(tok|blk|ablk|rot|kchan|kmid)(\d+)(?:x(\d+))?", spec)
    if m is None:
        raise SystemExit(f"unknown scheme {spec!r} (see --help)")
    kind, bits, group = m[1], int(m[2]), int(m[3] or head_dim)
    if kind == "kchan":
        return lambda x: per_channel(x, bits)
    if kind == "kmid":
        return lambda x: mid_channel(x, bits)
    if kind == "rot":
        h = hadamard(head_dim)
        return lambda x: grouped(x @ h, bits, group, False) @ h.T
    return lambda x: grouped(x, bits, head_dim if kind == "tok" else group, kind == "ablk")


def perplexity(model, ids: list[int], window: int) -> float:
    """Independent windows of `window` tokens, each one prefill chunk over a float paged cache."""
    cache = KVCache(model.config, -(-window // BLOCK) + 1, BLOCK, torch.float32, "cpu", grouped=False)
    table, nll = list(range(cache.num_blocks)), []
    with torch.inference_mode():
        for w in range(0, len(ids) - 1, window):
            seq = ids[w:w + window + 1]
            n = len(seq) - 1
            meta = AttentionMetadata.build([n], [n], [table], BLOCK, torch.device("cpu"))
            hidden = model(torch.tensor(seq[:n]), torch.arange(n), meta, cache.layers)
            logits = model.compute_logits(hidden).float()
            nll.append(torch.nn.functional.cross_entropy(logits, torch.tensor(seq[1:]), reduction="none"))
    return math.exp(torch.cat(nll).mean().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    ap.add_argument("--tokens", type=int, default=2048, help="window length (and tokens scored: one window)")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--schemes", default=DEFAULT)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    ids = Tokenizer.load(path).encode(args.text.read_text())[:args.tokens * args.windows + 1]
    model, cfg = load_prepared(path, "fp32", "cpu", None, plain=True)    # the reference attention, fp32
    attend, rows, base = llama.paged_attention, {}, None
    print(f"{path.name}: {len(ids) - 1} tokens of {args.text.name} in windows of {args.tokens}")
    for scheme in args.schemes.split(","):
        k_spec, _, v_spec = scheme.partition("+")
        fk, fv = quantizer(k_spec, cfg.head_dim), quantizer(v_spec or k_spec, cfg.head_dim)
        llama.paged_attention = lambda q, k, v, *a, **kw: attend(q, fk(k), fv(v), *a, **kw)  # noqa: E731
        try:
            ppl = perplexity(model, ids, args.tokens)
        finally:
            llama.paged_attention = attend
        base = base or ppl
        rows[scheme] = {"ppl": ppl, "delta": ppl / base - 1}
        print(f"{scheme:>20}  ppl {ppl:8.4f}  {ppl / base - 1:+8.2%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "text": str(args.text), "tokens": len(ids) - 1,
                                         "schemes": rows}, indent=1))


if __name__ == "__main__":
    main()
