"""Attention over a paged KV cache, for a flat batch mixing prefill chunks and decode tokens.

The KV cache of one layer is a pair of tensors [num_slots, Hkv, D] (a block of
`block_size` slots per block id, slot = block_id * block_size + offset); an int8
cache adds one fp32 scale per slot and KV head for each. Each step
the new tokens' K and V are written to their slots, then every sequence attends
over its whole context, read back through its slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqAttention:
    """How one sequence of the batch attends; built once per step, shared by every layer."""
    start: int                      # its rows in the flat batch are [start, end)
    end: int
    context_len: int                # tokens of context after this step (cached + new)
    context_blocks: torch.Tensor | None  # [nblk] its block ids; None: the chunk is the whole context
    mask: torch.Tensor | None       # [n, L] bool, True = may attend; None with is_causal or a single query
    is_causal: bool


LayerKV = tuple[torch.Tensor, ...]   # (k, v) [num_slots, Hkv, D]; int8: (k, v, k_scale, v_scale [num_slots, Hkv])


@dataclass
class KernelRows:
    """The batch's query rows as the compiled paged-attention kernel takes them (reading the cache
    in place): decode rows one by one, runs of a prompt chunk in tiles (kernels/csrc)."""
    tables: torch.Tensor            # [N, nblk] int64 block ids of the batch's sequences (padded)
    seq: torch.Tensor               # [T] int64: each row's sequence, an index into tables
    length: torch.Tensor            # [T] int64: how many tokens the row attends to (causal)


@dataclass
class AttentionMetadata:
    """Everything attention needs about the step's batch, passed explicitly to every layer."""
    slot_mapping: torch.Tensor      # [T] int64: the slot each new token's K/V is written to
    block_size: int
    seqs: list[SeqAttention]        # per-sequence plans (used when not decode_only)
    decode_only: bool = False       # every sequence has exactly one new token
    decode_blocks: torch.Tensor | None = None  # [B, nblk] block ids, padded with block 0
    decode_mask: torch.Tensor | None = None    # [B, 1, 1, nblk * block_size] bool; None when nothing is padding
    kernel_rows: KernelRows | None = None      # for the compiled kernel (used when it is loaded)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device) -> AttentionMetadata:
        """query_lens[i] new tokens of sequence i, which then has context_lens[i] tokens in all."""
        slots, seqs, start = [], [], 0
        for n, ctx, table in zip(query_lens, context_lens, block_tables):
            nblk = -(-ctx // block_size)
            for pos in range(ctx - n, ctx):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            blocks = None if n == ctx else torch.tensor(table[:nblk], dtype=torch.int64, device=device)
            plan = SeqAttention(start, start + n, ctx, blocks, None, n == ctx and n > 1)
            if 1 < n < ctx:
                q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
                plan.mask = (torch.arange(ctx).unsqueeze(0) <= q_pos).to(device)
            seqs.append(plan)
            start += n
        meta = cls(torch.tensor(slots, dtype=torch.int64, device=device), block_size, seqs)
        meta.kernel_rows = _kernel_rows(query_lens, context_lens, block_tables, block_size, device)
        if all(n == 1 for n in query_lens):
            meta.decode_only = True
            nblk = -(-max(context_lens) // block_size)
            padded = torch.zeros(len(context_lens), nblk, dtype=torch.int64)
            for i, (ctx, table) in enumerate(zip(context_lens, block_tables)):
                used = -(-ctx // block_size)
                padded[i, :used] = torch.tensor(table[:used])
            meta.decode_blocks = padded.to(device)
            if any(ctx != nblk * block_size for ctx in context_lens):
                valid = torch.arange(nblk * block_size).unsqueeze(0) < torch.tensor(context_lens).unsqueeze(1)
                meta.decode_mask = valid[:, None, None, :].to(device)
        return meta


def _kernel_rows(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                 block_size: int, device: torch.device) -> KernelRows:
    seq, length, tables = [], [], []
    for i, (n, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        seq.extend([i] * n)
        length.extend(range(ctx - n + 1, ctx + 1))
        tables.append(table[: -(-ctx // block_size)])
    padded = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t)
    return KernelRows(padded.to(device), torch.tensor(seq, device=device), torch.tensor(length, device=device))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [S, Hkv, D], blocks [..., nblk] → [..., nblk * block_size, Hkv, D] (whole blocks)."""
    by_block = cache.view(-1, block_size, *cache.shape[1:])          # [num_blocks, bs, Hkv, D]
    out = by_block[blocks]                                           # [..., nblk, bs, Hkv, D]
    return out.flatten(-4, -3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (int8 [..., D], fp32 scale [...]): symmetric, one scale per row (max |x| / 127)."""
    amax = x.abs().amax(-1).float()
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8), scale


def write_kv(kv: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Put k, v [T, Hkv, D] into their cache slots (quantized for an int8 cache)."""
    if len(kv) == 2:
        kv[0].index_copy_(0, slots, k)
        kv[1].index_copy_(0, slots, v)
        return
    for cache, scales, x in ((kv[0], kv[2], k), (kv[1], kv[3], v)):
        xq, xs = quantize_rows(x)
        cache.index_copy_(0, slots, xq)
        scales.index_copy_(0, slots, xs)


def _read(kv: LayerKV, which: int, blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """K (which=0) or V (1) of whole blocks: [..., nblk * block_size, Hkv, D], dequantized."""
    x = _gather(kv[which], blocks, block_size)
    if len(kv) == 2:
        return x
    return x.to(dtype) * _gather(kv[2 + which].unsqueeze(-1), blocks, block_size).to(dtype)   # [..., L, Hkv, 1]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
                    ops=None, written: bool = False) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv: the layer's cache (k, v [num_slots, Hkv, D], and for an
    int8 cache their scales [num_slots, Hkv]) → out [T, Hq * D].

    `written`: k and v are already in their cache slots. `ops`: the compiled CPU ops, which
    then serve every row straight from the cache (`meta.kernel_rows`)."""
    if not written:
        write_kv(kv, meta.slot_mapping, k, v)
    T, Hq, D = q.shape
    Hkv, bs = k.shape[1], meta.block_size
    rows = meta.kernel_rows
    if ops is not None and rows is not None:        # one kernel call
        scales = (kv[2], kv[3]) if len(kv) == 4 else (None, None)
        return ops.paged_attention(q.contiguous(), kv[0], kv[1], rows.tables, rows.seq, rows.length,
                                   bs, D ** -0.5, *scales).view(T, Hq * D)
    if meta.decode_only:
        # Grouped-query trick: the G query heads sharing a KV head ride in the query-length axis.
        B, G = T, Hq // Hkv
        qg = q.view(B, Hkv, G, D)                                      # [B, Hkv, G, D]
        kc = _read(kv, 0, meta.decode_blocks, bs, q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        vc = _read(kv, 1, meta.decode_blocks, bs, q.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=meta.decode_mask)
        return out.reshape(T, Hq * D)
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    for s in meta.seqs:
        qs = q[s.start:s.end].transpose(0, 1).unsqueeze(0)            # [1, Hq, n, D]
        if s.context_blocks is None:
            ks, vs = k[s.start:s.end], v[s.start:s.end]                # [n, Hkv, D]
        else:
            ks = _read(kv, 0, s.context_blocks, bs, q.dtype)[: s.context_len]  # [L, Hkv, D]
            vs = _read(kv, 1, s.context_blocks, bs, q.dtype)[: s.context_len]
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, is_causal=s.is_causal,
                                           enable_gqa=Hq != Hkv)
        out[s.start:s.end] = o[0].transpose(0, 1)
    return out.view(T, Hq * D)
