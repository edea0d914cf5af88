"""Attention over a paged KV cache, for a flat batch mixing prefill chunks and decode tokens.

The KV cache of one layer is a pair of tensors [num_slots, Hkv, D] (a block of
`block_size` slots per block id, slot = block_id * block_size + offset). An int8 cache
(docs/architecture.md, "int8 KV cache") holds V per token with a scale per slot and KV head, and K
per channel over groups of 16 tokens with a midpoint and a step each; a sequence's newest, partial
group stays in fp32 (the step's own keys, or its tail slot's) until it fills. An int4 cache ("int4 KV
cache") is the same shape with 4-bit codes (uint8 tensors, two a byte) and key groups of 64. Each step
the new tokens' K and V are written to their slots, then every sequence attends
over its whole context, read back through its slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from phasewise.layers import kv_int4, kv_int8

if TYPE_CHECKING:
    from phasewise.kernels.kernel_api import Kernels


@dataclass(kw_only=True)
class SeqAttention:
    """How one sequence of the batch attends; built once per step, shared by every layer."""
    start: int                      # its rows in the flat batch are [start, end)
    end: int
    context_len: int                # tokens of context after this step (cached + new)
    context_blocks: torch.Tensor | None  # [nblk] its block ids; None: the chunk is the whole context
    mask: torch.Tensor | None       # [n, L] bool, True = may attend; None with is_causal or a single query
    is_causal: bool


# (k, v) [num_slots, Hkv, D];
# int8: (k, v, k_groups [num_slots / 16, Hkv, 2, D] (midpoint, step), v_scale [num_slots, Hkv],
#        tails [2 tail slots, 16, Hkv, D] fp32, tail_groups [tail slots, 2] int64);
# int4: (k, v uint8 [num_slots, Hkv, D / 2], k_groups fp16 [num_slots / 64, Hkv, 2, D] (minimum, step),
#        v_scale fp16 [num_slots, Hkv, D / 32], tails [2 tail slots, 2, 64, Hkv, D] (keys, values),
#        tail_groups)
LayerKV = tuple[torch.Tensor, ...]
KEY_GROUP = 16                       # an int8 cache's keys: tokens per group of per-channel scales


@dataclass
class KernelRows:
    """The batch's query rows as the compiled paged-attention kernel takes them (reading the cache
    in place): decode rows one by one, runs of a prompt chunk in tiles (kernels/csrc)."""
    tables: torch.Tensor            # [N, nblk] int64 block ids of the batch's sequences (padded)
    seq: torch.Tensor               # [T] int64: each row's sequence, an index into tables
    length: torch.Tensor            # [T] int64: how many tokens the row attends to (causal)
    # [N, 4] int64 per sequence, what a quantized cache's writer and readers need: its first new position,
    # its new tokens, the row of its first new token, its tail slot
    seqs: torch.Tensor


@dataclass(kw_only=True)
class AttentionMetadata:
    """Everything attention needs about the step's batch, passed explicitly to every layer.

    The compiled kernel needs only `slot_mapping` and `kernel_rows`; the PyTorch path's
    per-sequence plans are built on first use (they cost about a millisecond a step at batch 32)."""
    slot_mapping: torch.Tensor      # [T] int64: the slot each new token's K/V is written to
    block_size: int
    kernel_rows: KernelRows         # every row, as the compiled kernel takes them
    query_lens: list[int]           # new tokens per sequence
    context_lens: list[int]         # tokens of context per sequence after this step
    block_tables: list[list[int]]   # each sequence's blocks for its context (copies)
    device: torch.device
    groups: list[AttentionMetadata] | None = None   # per KV group (the first is this one); None: one group
    state_slots: list[int] | None = None  # a hybrid's recurrent layers: each sequence's state slot
    # and the slots its state is copied to after each of its rows but the last ([]: none), for a verify step
    state_snapshots: list[list[int]] | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of a KV group's layers (their own block tables and slots)."""
        return self if self.groups is None else self.groups[group]

    @classmethod
    def build_groups(cls, query_lens: list[int], context_lens: list[int], group_tables: list[list[list[int]]],
                     block_size: int, device: torch.device,
                     tail_slots: list[int] | None = None) -> AttentionMetadata:
        """group_tables[g][i]: sequence i's blocks in KV group g (NULL entries, < 0, behind a window:
        never read; they become block 0 in the kernel's tables); tail_slots: as `build` takes them."""
        rows = cls.row_tensors(query_lens, context_lens, device, tail_slots)   # the same for every group
        metas = [cls.build(query_lens, context_lens, [t if not t or min(t) >= 0 else [max(b, 0) for b in t]
                                                      for t in tables], block_size, device, rows=rows)
                 for tables in group_tables]
        if len(metas) > 1:
            metas[0].groups = metas
        return metas[0]

    @staticmethod
    def row_tensors(query_lens: list[int], context_lens: list[int], device: torch.device,
                    tail_slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's sequence and how many tokens it attends to ([T] int64 each), and the sequences
        ([N, 4]): KernelRows'."""
        seq: list[int] = []
        length: list[int] = []
        seqs: list[list[int]] = []
        for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
            seqs.append([ctx - n, n, len(seq), i if tail_slots is None else tail_slots[i]])
            seq.extend([i] * n)
            length.extend(range(ctx - n + 1, ctx + 1))
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return as_tensor(seq), as_tensor(length), as_tensor(seqs).view(-1, 4)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, tail_slots: list[int] | None = None,
              rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> AttentionMetadata:
        """query_lens[i] new tokens of sequence i, which then has context_lens[i] tokens in all; an int8
        cache keeps its partial key group in tail slot tail_slots[i] (default i: the same sequences at the
        same places every step) (`rows`: row_tensors of these lengths, when the caller has them already)."""
        slots: list[int] = []
        tables: list[list[int]] = []
        for n, ctx, table in zip(query_lens, context_lens, block_tables):
            slots.extend(table[pos // block_size] * block_size + pos % block_size
                         for pos in range(ctx - n, ctx))
            tables.append(table[: -(-ctx // block_size)])
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
        if rows is None:
            rows = cls.row_tensors(query_lens, context_lens, device, tail_slots)
        seq, length, seqs = rows
        return cls(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_size=block_size,
                   kernel_rows=KernelRows(padded, seq, length, seqs), query_lens=list(query_lens),
                   context_lens=list(context_lens), block_tables=tables, device=device)

    @cached_property
    def decode_only(self) -> bool:
        """Every sequence has exactly one new token."""
        return all(n == 1 for n in self.query_lens)

    @cached_property
    def seqs(self) -> list[SeqAttention]:
        """Per-sequence plans for the PyTorch path."""
        bs, plans, start = self.block_size, [], 0
        for n, ctx, table in zip(self.query_lens, self.context_lens, self.block_tables):
            nblk = -(-ctx // bs)
            blocks = None if n == ctx else torch.tensor(table[:nblk], dtype=torch.int64, device=self.device)
            plan = SeqAttention(start=start, end=start + n, context_len=ctx, context_blocks=blocks, mask=None,
                                is_causal=n == ctx and n > 1)
            if 1 < n < ctx:
                q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
                plan.mask = (torch.arange(ctx).unsqueeze(0) <= q_pos).to(self.device)
            plans.append(plan)
            start += n
        return plans

    @property
    def decode_blocks(self) -> torch.Tensor:
        """[B, nblk] block ids of a decode-only batch, padded with block 0 (the kernel's tables)."""
        return self.kernel_rows.tables

    def decode_window_mask(self, window: int) -> torch.Tensor:
        """decode_mask, also hiding keys before each sequence's window (its last `window` tokens)."""
        masks = self.__dict__.setdefault("_window_masks", {})
        if window not in masks:
            span = self.decode_blocks.shape[1] * self.block_size
            pos, ctx = torch.arange(span).unsqueeze(0), torch.tensor(self.context_lens).unsqueeze(1)
            masks[window] = ((pos < ctx) & (pos >= ctx - window))[:, None, None, :].to(self.device)
        return masks[window]

    @cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """[B, 1, 1, nblk * block_size] bool for a decode-only batch; None when nothing is padding."""
        span = self.decode_blocks.shape[1] * self.block_size
        if all(ctx == span for ctx in self.context_lens):
            return None
        valid = torch.arange(span).unsqueeze(0) < torch.tensor(self.context_lens).unsqueeze(1)
        return valid[:, None, None, :].to(self.device)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [S, Hkv, D], blocks [..., nblk] → [..., nblk * block_size, Hkv, D] (whole blocks)."""
    by_block = cache.view(-1, block_size, *cache.shape[1:])          # [num_blocks, bs, Hkv, D]
    out = by_block[blocks]                                           # [..., nblk, bs, Hkv, D]
    return out.flatten(-4, -3)


def write_kv(kv: LayerKV, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor,
             ops: Kernels | None = None) -> None:
    """Put k, v [T, Hkv, D] into their cache slots (an int8 or int4 cache: layers/kv_int8.py,
    kv_int4.py; `ops`: by the kernel)."""
    if ops is not None:
        rows = meta.kernel_rows
        ops.write_kv(k.contiguous(), v.contiguous(), list(kv), meta.slot_mapping, rows.tables, rows.seqs,
                     meta.block_size)
    elif len(kv) == 2:
        kv[0].index_copy_(0, meta.slot_mapping, k)
        kv[1].index_copy_(0, meta.slot_mapping, v)
    else:
        (kv_int4 if kv[0].dtype == torch.uint8 else kv_int8).write(kv, meta, k, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
                    ops: Kernels | None = None, written: bool = False, window: int | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] the step's keys and values; kv: the layer's cache (LayerKV) → out
    [T, Hq * D].

    `written`: k and v are already in their cache slots (a quantized cache still reads its partial key
    groups from k, an int4 cache their values from v). `ops`: the compiled CPU ops, which then serve every
    row straight from the cache (`meta.kernel_rows`). `window`: a query at position p sees only keys
    p - window + 1 .. p (a sliding-window layer). `scale`: of the scores (default 1/sqrt(D))."""
    if not written:
        write_kv(kv, meta, k, v, ops)
    T, Hq, D = q.shape
    Hkv, bs = k.shape[1], meta.block_size
    scale = D ** -0.5 if scale is None else scale
    if ops is not None:                             # one kernel call
        rows = meta.kernel_rows
        int4 = kv[0].dtype == torch.uint8
        return ops.paged_attention(q.contiguous(), list(kv), rows.tables, rows.seq, rows.length, rows.seqs,
                                   bs, scale, fresh=k.contiguous() if len(kv) > 2 else None,
                                   window=window or 0,
                                   fresh_v=v.contiguous() if int4 else None).view(T, Hq * D)
    if kv[0].dtype == torch.uint8:                  # an int4 cache
        return kv_int4.attend(q, kv, meta, k, v, scale, window).view(T, Hq * D)
    if len(kv) > 2:                                 # an int8 cache
        return kv_int8.attend(q, kv, meta, k, scale, window).view(T, Hq * D)
    if meta.decode_only:
        # Grouped-query trick: the G query heads sharing a KV head ride in the query-length axis.
        B, G = T, Hq // Hkv
        qg = q.view(B, Hkv, G, D)                                      # [B, Hkv, G, D]
        kc = _gather(kv[0], meta.decode_blocks, bs).transpose(1, 2)    # [B, Hkv, L, D]
        vc = _gather(kv[1], meta.decode_blocks, bs).transpose(1, 2)
        mask = meta.decode_mask if window is None else meta.decode_window_mask(window)
        out = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=scale)
        return out.reshape(T, Hq * D)
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    for s in meta.seqs:
        qs = q[s.start:s.end].transpose(0, 1).unsqueeze(0)            # [1, Hq, n, D]
        if s.context_blocks is None:
            ks, vs = k[s.start:s.end], v[s.start:s.end]                # [n, Hkv, D]
        else:
            ks = _gather(kv[0], s.context_blocks, bs)[: s.context_len]  # [L, Hkv, D]
            vs = _gather(kv[1], s.context_blocks, bs)[: s.context_len]
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        mask, causal = s.mask, s.is_causal
        if window is not None and s.context_len > window:
            mask, causal = _window_mask(s.end - s.start, s.context_len, window, q.device), False
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=Hq != Hkv)
        out[s.start:s.end] = o[0].transpose(0, 1)
    return out.view(T, Hq * D)


def _window_mask(n: int, ctx: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, ctx] bool: the last n positions of a ctx-token context, each seeing its window of keys."""
    q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
    k_pos = torch.arange(ctx).unsqueeze(0)
    return ((k_pos <= q_pos) & (k_pos > q_pos - window)).to(device)
