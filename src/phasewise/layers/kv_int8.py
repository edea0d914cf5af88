"""The int8 KV cache's reference (docs/architecture.md, "int8 KV cache"): writing a step's keys and
values into it, and attention over it, as the kernels compute them (csrc/cpu_ops.cpp's writer,
csrc/attention.h's readers), up to the order of float sums.

A layer's cache is (k, v, k_groups, v_scale, tails, tail_groups) (layers/attention.py LayerKV). V: int8
per token and KV head with one scale. K: per group of 16 tokens (positions [16 i, 16 i + 16)) and KV
head, each channel's midpoint and step (k_groups, by slot // 16), the codes in -127..127; a group is
quantized when the step that fills it writes it. Until then its keys are fp32: the step's own (`fresh`)
or, from earlier steps, the sequence's tail slot (two groups of 16 keys, tail_groups saying which).
A row of length L reads the groups wholly below L as int8 and its own group's keys as floats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from phasewise.layers.attention import AttentionMetadata, LayerKV

GROUP = 16
ROWS = 16          # query rows scored at a time (bounds the reference's memory)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (int8 [..., D], fp32 scale [...]): symmetric, one scale per row (max |x| / 127)."""
    amax = x.abs().amax(-1).float()
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8), scale


def int8_steps(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] rounded to the nearest (even) step of max |x| / 127 per row, as the kernels round a
    query (csrc/attention.h quantize_query)."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return torch.round(x * inv) * (amax / 127)


def quantize_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's keys x [16, Hkv, D] → (codes int8 [16, Hkv, D], [Hkv, 2, D] each channel's midpoint and step):
    x ≈ mid + step · code, code in -127..127."""
    lo, hi = x.amin(0), x.amax(0)
    mid, step = (lo + hi) * 0.5, (hi - lo) * (1 / 254)
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = torch.round((x - mid) * inv).clamp_(-127, 127).to(torch.int8)
    return codes, torch.stack([mid, step], dim=-2)


def tail_halves(held: list[int], g0: int, gl: int) -> tuple[int, int]:
    """Which of a tail slot's two groups hold g0 (the group of a sequence's first new token) and gl (of its
    last): g0 where it is held already, else in place of the older; gl in the other (the same when gl is g0).
    `held` (the group each holds) is updated. csrc/cpu_ops.cpp's writer decides alike."""
    h0 = 0 if held[0] == g0 else 1 if held[1] == g0 else (0 if held[0] <= held[1] else 1)
    hl = h0 if gl == g0 else 1 - h0
    held[h0], held[hl] = g0, gl
    return h0, hl


def _group_slot(table: list[int], g: int, block_size: int) -> int:
    """The slot of group g's first token."""
    return table[GROUP * g // block_size] * block_size + GROUP * g % block_size


def _float_keys(kv: LayerKV, slot: int, h0: int, start: int, k: torch.Tensor) -> torch.Tensor:
    """A sequence's fp32 keys from its first new token's group on: [ctx - 16 g0, Hkv, D], the older ones
    from its tail, then its new ones k [n, Hkv, D]."""
    old = kv[4][2 * slot + h0, :start % GROUP]
    return torch.cat([old, k])


def write(kv: LayerKV, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
    """The step's k, v [T, Hkv, D] into an int8 cache: V per token; K's groups that fill in this step
    quantized, and each sequence's groups it may still read as floats kept in its tail slot."""
    vq, vs = quantize_rows(v)
    kv[1].index_copy_(0, meta.slot_mapping, vq)
    kv[3].index_copy_(0, meta.slot_mapping, vs)
    seqs = meta.kernel_rows.seqs.tolist()
    for (start, n, row0, slot), table in zip(seqs, meta.block_tables):
        ctx, g0 = start + n, start // GROUP
        held = kv[5][slot].tolist()
        h0, hl = tail_halves(held, g0, (ctx - 1) // GROUP)
        x = _float_keys(kv, slot, h0, start, k[row0:row0 + n])            # positions 16 g0 .. ctx - 1
        for g in range(g0, ctx // GROUP):
            codes, params = quantize_group(x[(g - g0) * GROUP:(g - g0 + 1) * GROUP])
            at = _group_slot(table, g, meta.block_size)
            kv[0][at:at + GROUP] = codes
            kv[2][at // GROUP] = params
        tail = kv[4]
        tail[2 * slot + h0, :min(GROUP, len(x))] = x[:GROUP]
        if hl != h0:
            rest = x[(ctx - 1) // GROUP * GROUP - g0 * GROUP:]
            tail[2 * slot + hl, :len(rest)] = rest
        kv[5][slot] = torch.tensor(held, dtype=kv[5].dtype)


def _dequantized_values(kv: LayerKV, table: list[int], ctx: int, block_size: int) -> torch.Tensor:
    """A sequence's values [ctx, Hkv, D] in fp32."""
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
    return kv[1][slots].float() * kv[3][slots].unsqueeze(-1)


def _int8_scores(kv: LayerKV, table: list[int], full: int, qs: torch.Tensor, block_size: int) -> torch.Tensor:
    """Scores [r, Hq, 16 full] of scaled queries qs [r, Hq, D] against the first `full` groups as the kernels
    take them: qs·mid + (qs∘step rounded to int8 steps)·codes, per group."""
    at = [_group_slot(table, g, block_size) for g in range(full)]
    G = qs.shape[1] // kv[0].shape[1]
    params = kv[2][torch.tensor([a // GROUP for a in at], dtype=torch.int64)].repeat_interleave(G, 1)  # [full, Hq, 2, D]
    codes = torch.stack([kv[0][a:a + GROUP] for a in at]).float().repeat_interleave(G, 2)   # [full, 16, Hq, D]
    base = torch.einsum("rhd,ghd->rhg", qs, params[:, :, 0])
    y = int8_steps(qs[:, None] * params[None, :, :, 1])                                       # [r, full, Hq, D]
    dots = torch.einsum("rghd,gjhd->rhgj", y, codes) + base[..., None]
    return dots.flatten(-2)


def attend(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, fresh: torch.Tensor, scale: float,
           window: int | None) -> torch.Tensor:
    """q [T, Hq, D] over an int8 cache (written for this step; fresh: its new keys [T, Hkv, D]) → [T, Hq, D]."""
    T, Hq, D = q.shape
    G = Hq // kv[0].shape[1]
    out = torch.empty(T, Hq, D, dtype=torch.float32)
    seqs = meta.kernel_rows.seqs.tolist()
    for (start, n, row0, slot), table in zip(seqs, meta.block_tables):
        ctx, g0 = start + n, start // GROUP
        h0 = 0 if kv[5][slot, 0].item() == g0 else 1
        x = _float_keys(kv, slot, h0, start, fresh[row0:row0 + n].float()).repeat_interleave(G, 1)
        values = _dequantized_values(kv, table, ctx, meta.block_size).repeat_interleave(G, 1)   # [ctx, Hq, D]
        for r0 in range(0, n, ROWS):
            lens = torch.arange(start + r0 + 1, start + min(n, r0 + ROWS) + 1)                   # [r]
            qs = q[row0 + r0:row0 + r0 + len(lens)].float() * scale
            full = int(lens[-1]) // GROUP
            scores = torch.full((len(lens), Hq, ctx), float("-inf"))
            if full:
                scores[..., :full * GROUP] = _int8_scores(kv, table, full, qs, meta.block_size)
            floats = torch.einsum("rhd,phd->rhp", qs, x)                                         # [r, Hq, ctx - 16 g0]
            pos = torch.arange(ctx)
            as_float = (pos[None] >= lens[:, None] // GROUP * GROUP) & (pos[None] >= g0 * GROUP)
            padded = torch.cat([torch.zeros(len(lens), Hq, g0 * GROUP), floats], -1)
            scores = torch.where(as_float[:, None], padded, scores)
            seen = pos[None] < lens[:, None]
            if window is not None:
                seen &= pos[None] > lens[:, None] - 1 - window
            scores = scores.masked_fill(~seen[:, None], float("-inf"))
            out[row0 + r0:row0 + r0 + len(lens)] = torch.einsum("rhp,phd->rhd", scores.softmax(-1), values)
    return out.to(q.dtype)
