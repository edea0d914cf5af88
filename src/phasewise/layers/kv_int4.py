"""The int4 KV cache's reference (docs/architecture.md, "int4 KV cache"): the int8 cache's shape
(layers/kv_int8.py) with 4-bit codes, as the kernels compute it (csrc/kv_write.cpp's writer, csrc/attention.h's
readers), up to the order of float sums.

A layer's cache is (k, v, k_groups, v_scale, tails, tail_groups). Codes are two to a byte: in each 64 values
of a row, byte i holds value i (low nibble) and value i + 32 (high). K: per group of 64 tokens (positions
[64 i, 64 i + 64)) and KV head, each channel's minimum and step in fp16 (k_groups [slots / 64, Hkv, 2, D]),
k = min + step code, code 0..15. V: per token and KV head in blocks of 32 values, each with one fp16 scale
d = -m / 8 for m the block's value of largest magnitude (v_scale [slots, Hkv, D / 32]), v = d (code - 8),
code 0..15 (llama.cpp's q4_0 rounding). A group's keys and values are quantized
when the step that fills it writes it; until then they are fp32 (the step's own, `fresh`, or the
sequence's tail slot: two groups of 64 keys and values, tails [2 S, 2, 64, Hkv, D]). A row of length L
reads the groups wholly below L as int4 and its own group's keys and values as floats; its query against
a group is scale·q∘step rounded to int8 (kv_int8.int8_steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from phasewise.layers.kv_int8 import int8_steps, tail_halves

if TYPE_CHECKING:
    from phasewise.layers.attention import AttentionMetadata, LayerKV

GROUP = 64         # tokens per key group
V_BLOCK = 32       # values per V scale
ROWS = 16          # query rows scored at a time (bounds the reference's memory)
F16_MAX = 65504.0


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., D] (0..15, D % 64 == 0) → uint8 [..., D / 2]: per 64 values, byte i = code i | code i + 32 << 4."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2, 32)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*codes.shape[:-1], -1)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: uint8 [..., D / 2] → codes uint8 [..., D]."""
    p = packed.reshape(*packed.shape[:-1], -1, 32)
    return torch.stack([p & 15, p >> 4], dim=-2).reshape(*packed.shape[:-1], -1)


def quantize_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [..., D] → (packed codes uint8 [..., D / 2], fp16 scales [..., D / 32]): per block of 32 values
    d = m / -8 for m the value of largest magnitude (its first), code = round(v / d) + 8 in 0..15."""
    b = v.float().reshape(*v.shape[:-1], -1, V_BLOCK)
    m = b.gather(-1, b.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = (m * -0.125).clamp(-F16_MAX, F16_MAX).half()
    df = d.float()
    inv = torch.where(df != 0, 1 / df, torch.zeros_like(df))
    codes = (torch.round(b * inv[..., None]) + 8).clamp_(0, 15)
    return pack(codes.reshape(v.shape)), d


def values(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """quantize_values' inverse: the fp32 values [..., D]."""
    c = unpack(packed).float().reshape(*packed.shape[:-1], -1, V_BLOCK)
    return ((c - 8) * scales.float()[..., None]).flatten(-2)


def quantize_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's keys x [64, Hkv, D] → (packed codes uint8 [64, Hkv, D / 2], fp16 [Hkv, 2, D] each channel's
    minimum and step): x ≈ min + step · code, code in 0..15."""
    lo = x.amin(0).clamp(-F16_MAX, F16_MAX).half()
    lf = lo.float()
    step = ((x.amax(0) - lf) * (1 / 15)).clamp(max=F16_MAX).half()
    sf = step.float()
    inv = torch.where(sf > 0, 1 / sf, torch.zeros_like(sf))
    codes = torch.round((x - lf) * inv).clamp_(0, 15)
    return pack(codes), torch.stack([lo, step], dim=-2)


def _group_slot(table: list[int], g: int, block_size: int) -> int:
    """The slot of group g's first token."""
    return table[GROUP * g // block_size] * block_size + GROUP * g % block_size


def _floats(kv: LayerKV, slot: int, h0: int, start: int, k: torch.Tensor, part: int) -> torch.Tensor:
    """A sequence's fp32 keys (part 0) or values (part 1) from its first new token's group on: [ctx - 64 g0,
    Hkv, D], the older ones from its tail, then its new ones k [n, Hkv, D]."""
    return torch.cat([kv[4][2 * slot + h0, part, :start % GROUP], k])


def write(kv: LayerKV, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
    """The step's k, v [T, Hkv, D] into an int4 cache: the groups that fill in this step quantized, and each
    sequence's groups it may still read as floats kept in its tail slot."""
    seqs = meta.kernel_rows.seqs.tolist()
    for (start, n, row0, slot), table in zip(seqs, meta.block_tables):
        ctx, g0 = start + n, start // GROUP
        held = kv[5][slot].tolist()
        h0, hl = tail_halves(held, g0, (ctx - 1) // GROUP)
        x = _floats(kv, slot, h0, start, k[row0:row0 + n].float(), 0)      # positions 64 g0 .. ctx - 1
        y = _floats(kv, slot, h0, start, v[row0:row0 + n].float(), 1)
        for g in range(g0, ctx // GROUP):
            codes, params = quantize_group(x[(g - g0) * GROUP:(g - g0 + 1) * GROUP])
            at = _group_slot(table, g, meta.block_size)
            kv[0][at:at + GROUP] = codes
            kv[2][at // GROUP] = params
            kv[1][at:at + GROUP], kv[3][at:at + GROUP] = quantize_values(y[(g - g0) * GROUP:(g - g0 + 1) * GROUP])
        for part, z in enumerate((x, y)):
            tail = kv[4]
            tail[2 * slot + h0, part, :min(GROUP, len(z))] = z[:GROUP]
            if hl != h0:
                rest = z[(ctx - 1) // GROUP * GROUP - g0 * GROUP:]
                tail[2 * slot + hl, part, :len(rest)] = rest
        kv[5][slot] = torch.tensor(held, dtype=kv[5].dtype)


def _int4_scores(kv: LayerKV, table: list[int], full: int, qs: torch.Tensor, block_size: int) -> torch.Tensor:
    """Scores [r, Hq, 64 full] of scaled queries qs [r, Hq, D] against the first `full` groups as the kernels
    take them: qs·min + (qs∘step rounded to int8 steps)·codes, per group."""
    at = [_group_slot(table, g, block_size) for g in range(full)]
    G = qs.shape[1] // kv[0].shape[1]
    params = kv[2][torch.tensor([a // GROUP for a in at], dtype=torch.int64)].float().repeat_interleave(G, 1)
    codes = torch.stack([unpack(kv[0][a:a + GROUP]) for a in at]).float().repeat_interleave(G, 2)  # [full, 64, Hq, D]
    base = torch.einsum("rhd,ghd->rhg", qs, params[:, :, 0])
    y = int8_steps(qs[:, None] * params[None, :, :, 1])                                       # [r, full, Hq, D]
    dots = torch.einsum("rghd,gjhd->rhgj", y, codes) + base[..., None]
    return dots.flatten(-2)


def attend(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, fresh: torch.Tensor, fresh_v: torch.Tensor,
           scale: float, window: int | None) -> torch.Tensor:
    """q [T, Hq, D] over an int4 cache (written for this step; fresh, fresh_v: its new keys and values [T, Hkv,
    D]) → [T, Hq, D]."""
    T, Hq, D = q.shape
    G = Hq // kv[0].shape[1]
    out = torch.empty(T, Hq, D, dtype=torch.float32)
    for (start, n, row0, slot), table in zip(meta.kernel_rows.seqs.tolist(), meta.block_tables):
        ctx, g0 = start + n, start // GROUP
        h0 = 0 if kv[5][slot, 0].item() == g0 else 1
        x = _floats(kv, slot, h0, start, fresh[row0:row0 + n].float(), 0).repeat_interleave(G, 1)
        y = _floats(kv, slot, h0, start, fresh_v[row0:row0 + n].float(), 1).repeat_interleave(G, 1)
        slots = torch.tensor([table[p // meta.block_size] * meta.block_size + p % meta.block_size for p in range(ctx)])
        quantized = values(kv[1][slots], kv[3][slots]).repeat_interleave(G, 1)                # [ctx, Hq, D]
        for r0 in range(0, n, ROWS):
            lens = torch.arange(start + r0 + 1, start + min(n, r0 + ROWS) + 1)                   # [r]
            qs = q[row0 + r0:row0 + r0 + len(lens)].float() * scale
            full = int(lens[-1]) // GROUP
            scores = torch.full((len(lens), Hq, ctx), float("-inf"))
            if full:
                scores[..., :full * GROUP] = _int4_scores(kv, table, full, qs, meta.block_size)
            floats = torch.einsum("rhd,phd->rhp", qs, x)                                         # [r, Hq, ctx - 64 g0]
            pos = torch.arange(ctx)
            as_float = (pos[None] >= lens[:, None] // GROUP * GROUP) & (pos[None] >= g0 * GROUP)
            padded = torch.cat([torch.zeros(len(lens), Hq, g0 * GROUP), floats], -1)
            scores = torch.where(as_float[:, None], padded, scores)
            seen = pos[None] < lens[:, None]
            if window is not None:
                seen &= pos[None] > lens[:, None] - 1 - window
            p = scores.masked_fill(~seen[:, None], float("-inf")).softmax(-1)                     # [r, Hq, ctx]
            w_float = p * as_float[:, None]
            out[row0 + r0:row0 + r0 + len(lens)] = (torch.einsum("rhp,phd->rhd", p - w_float, quantized)
                                                    + torch.einsum("rhp,phd->rhd", w_float[..., g0 * GROUP:], y))
    return out.to(q.dtype)
