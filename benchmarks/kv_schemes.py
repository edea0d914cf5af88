"""Which KV-cache quantization scheme holds a model's perplexity: K and V fake-quantized (quantized and
dequantized in PyTorch) before attention reads them, over a float cache and fp32 weights, so the scheme
is the only change. For choosing what the int8 and int4 caches store before writing their kernels.

    .venv/bin/python benchmarks/kv_schemes.py --model FILE [--text FILE] [--tokens 2048]
                                              [--schemes none,tok8,blk8x32,kchan8+tok8,...] [--json OUT]

A scheme is `K[+V][/T]` (V the same as K when not given). `/T`: a row reads the keys and values of its
own group of T tokens (positions T⌊L/T⌋ .. L - 1 for a row of length L) as floats, the groups wholly
below it quantized (`/Tk`: its keys only, every value read quantized), as a cache that keeps a sequence's newest partial group in a float tail does
(without it every key and value is read quantized, the partial groups' scales taken over tokens the
row cannot see yet). Each part is `[r]KIND BITS[xG][h|e]`:
    none            float
    tokB            symmetric, one scale per token and head (G = the head size)
    blkBxG          symmetric (codes ±(2^(B-1) - 1)), one scale per G values within a head
    q40             llama.cpp's q4_0 layout as documented: blocks of 32 within a head, one fp16 scale d =
                    (the value of largest |x|) / -8, codes 0..15 read as d·(c - 8)
    ablkBxG         asymmetric (min and step, codes 0..2^B - 1) per G values within a head
    chanBxG         asymmetric per channel over each group of G tokens (positions [G i, G i + G)); G 16
    kchanB          chanBx16 (KIVI's keys, the int8 cache's)
    kmidB           per channel the midpoint over each group of 16 tokens, one symmetric step per group
                    and head around it
  r: a Hadamard rotation over the head first (rotated back after: for K the query is rotated alike, for
  V the output); h: scales (and minimums) in fp16, e: 8-bit scales under an fp32 one per (token or group,
  head) (blk: sub-scales of the largest step, rounded up; chan: steps alike, minimums in fp16).
The text is scored as independent windows of --tokens (one by default), teacher-forced. Each line gives
the scheme's bits per value, scales included (K and V averaged), its perplexity, and against the first
scheme (give `none` first) the mean KL divergence of the next-token distributions and top-1 agreement:
KL is the steadier figure (a window's perplexity moves by ±0.5% with the noise of any scheme).
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
ROWS = 256              # query rows scored at a time by the tail-aware attention
PART = re.compile(r"(r?)(tok|blk|ablk|q40|chan|kchan|kmid)(\d*)(?:x(\d+))?([he]?)")


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(d)


def fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def sub_scaled(step: torch.Tensor, dim: int) -> torch.Tensor:
    """Steps rounded up to 8-bit multiples of the largest one / 255 along `dim` (K-quants' sub-scales)."""
    top = step.amax(dim, keepdim=True) / 255
    top = torch.where(top > 0, top, torch.ones_like(top))
    return torch.ceil(step / top).clamp(1, 255) * top


def scales(step: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    return fp16(step) if fmt == "h" else sub_scaled(step, dim) if fmt == "e" else step


def grouped(x: torch.Tensor, bits: int, group: int, asym: bool, fmt: str = "") -> torch.Tensor:
    """x [..., D] quantized and back in groups of `group` along the head."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    if asym:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        lo = fp16(lo) if fmt else lo
        step = scales((hi - lo) / (2 ** bits - 1), fmt, -2)
        step = torch.where(step > 0, step, torch.ones_like(step))
        return (torch.round((g - lo) / step).clamp(0, 2 ** bits - 1) * step + lo).reshape(x.shape)
    top = 2 ** (bits - 1) - 1
    step = scales(g.abs().amax(-1, keepdim=True) / top, fmt, -2)
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round(g / step).clamp(-top, top) * step).reshape(x.shape)


def q4_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] through llama.cpp's q4_0 layout (blocks of 32, d = the largest-magnitude value / -8)."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    at = g.abs().argmax(-1, keepdim=True)
    d = fp16(torch.gather(g, -1, at) / -8)
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = torch.floor(g * inv + 8.5).clamp(0, 15)
    return ((codes - 8) * d).reshape(x.shape)


def token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """x [T, H, D] → [T' / group, group, H, D] padded with the last token, and T."""
    T, pad = x.shape[0], -x.shape[0] % group
    xp = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])]) if pad else x
    return xp.reshape(-1, group, *x.shape[1:]), T


def per_channel(x: torch.Tensor, bits: int, group: int = BLOCK, fmt: str = "") -> torch.Tensor:
    """x [T, H, D] (one sequence from position 0) quantized and back per channel over groups of tokens."""
    g, T = token_groups(x, group)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    lo = fp16(lo) if fmt else lo
    step = scales((hi - lo) / (2 ** bits - 1), fmt, -1)
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round((g - lo) / step).clamp(0, 2 ** bits - 1) * step + lo).reshape(-1, *x.shape[1:])[:T]


def mid_channel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [T, H, D] quantized and back as kmidB: per group of 16 tokens and head, each channel's midpoint
    and one step for all channels (the largest half-range / (2^(bits-1) - 1))."""
    g, T = token_groups(x, BLOCK)                               # [groups, 16, H, D]
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    mid, top = (lo + hi) / 2, 2 ** (bits - 1) - 1
    half = ((hi - lo) / 2).amax(-1, keepdim=True)
    step = torch.where(half > 0, half / top, torch.ones_like(half))
    return (torch.round((g - mid) / step).clamp(-top, top) * step + mid).reshape(-1, *x.shape[1:])[:T]


def parse(spec: str, head_dim: int) -> tuple[bool, str, int, int, str]:
    m = PART.fullmatch(spec)
    if m is None or (m[2] != "q40" and not m[3]):
        raise SystemExit(f"unknown scheme part {spec!r} (see --help)")
    kind = "chan" if m[2] == "kchan" else m[2]
    group = int(m[4]) if m[4] else BLOCK if kind == "chan" else 32 if kind == "q40" else head_dim
    return bool(m[1]), kind, int(m[3] or 4), group, m[5]


def bits_per_value(spec: str, head_dim: int) -> float:
    """What one part stores per value, scales included."""
    if spec == "none":
        return 32.0
    _, kind, bits, group, fmt = parse(spec, head_dim)
    scale = {"h": 16, "e": 8}.get(fmt, 32)
    extra = 32 / (group * head_dim) if fmt == "e" else 0.0     # the fp32 scale above 8-bit ones
    if kind == "chan":                      # min and step per channel and group of tokens
        return bits + ((16 if fmt == "e" else scale) + scale) / group + extra
    per = {"tok": scale / head_dim, "blk": scale / group, "q40": 16 / 32, "ablk": 2 * scale / group,
           "kmid": 32 / BLOCK + 32 / (BLOCK * head_dim)}[kind]
    return bits + per + extra


def quantizer(spec: str, head_dim: int):
    """The fake quantizer of one scheme part: x [T, H, D] → the values read back."""
    if spec == "none":
        return lambda x: x
    if spec.startswith("rot"):              # the old name of a rotated blk
        spec = "rblk" + spec[3:]
    rotate, kind, bits, group, fmt = parse(spec, head_dim)
    if kind == "chan":
        f = lambda x: per_channel(x, bits, group, fmt)  # noqa: E731
    elif kind == "kmid":
        f = lambda x: mid_channel(x, bits)  # noqa: E731
    elif kind == "q40":
        f = q4_0
    else:
        f = lambda x: grouped(x, bits, head_dim if kind == "tok" else group, kind == "ablk", fmt)  # noqa: E731
    if not rotate:
        return f
    h = hadamard(head_dim)
    return lambda x: f(x @ h) @ h.T


def tail_attention(q, k, v, kq, vq, tail: int, scale: float, float_values: bool = True) -> torch.Tensor:
    """Causal attention of one sequence from position 0: q [T, Hq, D]; k, v [T, Hkv, D] float, kq, vq the
    same read back quantized. A row of length L reads keys (and with float_values values) at positions
    below T⌊L/T⌋ quantized, the rest float."""
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    k, v, kq, vq = (x.repeat_interleave(G, 1) for x in (k, v, kq, vq))
    out, pos = torch.empty_like(q), torch.arange(T)
    for r0 in range(0, T, ROWS):
        lens = torch.arange(r0 + 1, min(T, r0 + ROWS) + 1)
        qs = q[r0:r0 + len(lens)] * scale
        floats = (pos[None] >= lens[:, None] // tail * tail)[:, None]          # [r, 1, T]
        s = torch.where(floats, torch.einsum("rhd,phd->rhp", qs, k), torch.einsum("rhd,phd->rhp", qs, kq))
        p = s.masked_fill((pos[None] >= lens[:, None])[:, None], float("-inf")).softmax(-1)
        if not float_values:
            floats = torch.zeros_like(floats)
        out[r0:r0 + len(lens)] = (torch.einsum("rhp,phd->rhd", p * floats, v)
                                  + torch.einsum("rhp,phd->rhd", p * ~floats, vq))
    return out


def scheme_attention(scheme: str, head_dim: int, attend):
    """The model's paged_attention with the scheme's K and V in place of the cache's."""
    parts, _, tail = scheme.partition("/")
    k_spec, _, v_spec = parts.partition("+")
    fk, fv = quantizer(k_spec, head_dim), quantizer(v_spec or k_spec, head_dim)
    if not tail:
        return lambda q, k, v, *a, **kw: attend(q, fk(k), fv(v), *a, **kw)

    def attention(q, k, v, kv, meta, *a, scale=None, **kw):
        assert meta.query_lens == meta.context_lens, "one prefill chunk per window"
        attend(q, k, v, kv, meta, *a, scale=scale, **kw)        # writes the cache as usual
        out = tail_attention(q.float(), k.float(), v.float(), fk(k.float()), fv(v.float()), int(tail.rstrip("k")),
                             head_dim ** -0.5 if scale is None else scale, not tail.endswith("k"))
        return out.reshape(q.shape[0], -1).to(q.dtype)
    return attention


def scheme_bits(scheme: str, head_dim: int) -> float:
    k_spec, _, v_spec = scheme.partition("/")[0].partition("+")
    return (bits_per_value(k_spec, head_dim) + bits_per_value(v_spec or k_spec, head_dim)) / 2


def window_logprobs(model, seq: list[int], cache: KVCache) -> torch.Tensor:
    """One window (its n + 1 tokens) as one prefill chunk over a float paged cache → log-probs [n, V]."""
    n = len(seq) - 1
    meta = AttentionMetadata.build([n], [n], [list(range(cache.num_blocks))], BLOCK, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(seq[:n]), torch.arange(n), meta, cache.layers)
        return torch.log_softmax(model.compute_logits(hidden).float(), -1)


def score(model, ids: list[int], window: int, schemes: list[str], head_dim: int) -> dict[str, dict[str, float]]:
    """Each scheme over independent windows of `window` tokens: perplexity, and against the first scheme
    (the reference, `none`) the mean KL divergence of its next-token distributions and how often its
    top token is the reference's."""
    cache = KVCache(model.config, -(-window // BLOCK) + 1, BLOCK, torch.float32, "cpu", grouped=False)
    attend = llama.paged_attention
    sums = {s: {"nll": 0.0, "kl": 0.0, "top1": 0.0} for s in schemes}
    scored = 0
    for w in range(0, len(ids) - 1, window):
        seq, ref = ids[w:w + window + 1], None
        target = torch.tensor(seq[1:])
        for scheme in schemes:
            llama.paged_attention = scheme_attention(scheme, head_dim, attend)
            try:
                lp = window_logprobs(model, seq, cache)
            finally:
                llama.paged_attention = attend
            ref = lp if ref is None else ref
            acc = sums[scheme]
            acc["nll"] -= lp.gather(1, target[:, None]).sum().item()
            acc["kl"] += (ref.exp() * (ref - lp)).sum().item()
            acc["top1"] += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
        scored += len(seq) - 1
    return {s: {"ppl": math.exp(a["nll"] / scored), "kl": a["kl"] / scored, "top1": a["top1"] / scored}
            for s, a in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    ap.add_argument("--tokens", type=int, default=2048, help="window length (and tokens scored: one window)")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--schemes", default=DEFAULT, help="comma-separated; the first is the reference (none)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    ids = Tokenizer.load(path).encode(args.text.read_text())[:args.tokens * args.windows + 1]
    model, cfg = load_prepared(path, "fp32", "cpu", None, plain=True)    # the reference attention, fp32
    print(f"{path.name}: {len(ids) - 1} tokens of {args.text.name} in windows of {args.tokens}", flush=True)
    schemes = args.schemes.split(",")
    rows = score(model, ids, args.tokens, schemes, cfg.head_dim)
    base = rows[schemes[0]]["ppl"]
    for scheme, r in rows.items():
        r["delta"], r["bits"] = r["ppl"] / base - 1, scheme_bits(scheme, cfg.head_dim)
        print(f"{scheme:>32}  {r['bits']:5.2f} bits  ppl {r['ppl']:8.4f}  {r['delta']:+8.2%}  KL {r['kl']:.5f}"
              f"  top-1 {r['top1']:.2%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "text": str(args.text), "tokens": len(ids) - 1,
                                         "schemes": rows}, indent=1))


if __name__ == "__main__":
    main()
