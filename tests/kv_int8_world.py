"""Int8 and int4 KV caches with a history, for the kernel tests: each sequence's earlier tokens written in
steps of varied sizes as an engine writes them (layers/kv_int8.py's and kv_int4.py's writers, the kernels'
reference), with keys that have a few large, nearly constant channels, as Qwen2's do."""

from __future__ import annotations

import torch

from phasewise.layers.attention import AttentionMetadata, write_kv

CPU = torch.device("cpu")


def int8_cache(num_blocks: int, block_size: int, Hkv: int, D: int, tail_slots: int = 8) -> list[torch.Tensor]:
    """An empty int8 cache (runner/kv_cache.py's layout for one layer): k, v, k_groups, v_scale, tails, tail_groups."""
    S = num_blocks * block_size
    return [torch.zeros(S, Hkv, D, dtype=torch.int8), torch.zeros(S, Hkv, D, dtype=torch.int8),
            torch.zeros(S // 16, Hkv, 2, D), torch.ones(S, Hkv), torch.zeros(2 * tail_slots, 16, Hkv, D),
            torch.full((tail_slots, 2), -1, dtype=torch.int64)]


def int4_cache(num_blocks: int, block_size: int, Hkv: int, D: int, tail_slots: int = 8) -> list[torch.Tensor]:
    """An empty int4 cache (runner/kv_cache.py's layout for one layer)."""
    S = num_blocks * block_size
    return [torch.zeros(S, Hkv, D // 2, dtype=torch.uint8), torch.zeros(S, Hkv, D // 2, dtype=torch.uint8),
            torch.zeros(S // 64, Hkv, 2, D, dtype=torch.float16), torch.zeros(S, Hkv, D // 32, dtype=torch.float16),
            torch.zeros(2 * tail_slots, 2, 64, Hkv, D), torch.full((tail_slots, 2), -1, dtype=torch.int64)]


def key_offsets(Hkv: int, D: int, g: torch.Generator) -> torch.Tensor:
    """[Hkv, D]: per channel a constant every key carries, three channels of each head large."""
    off = torch.randn(Hkv, D, generator=g)
    off[:, :3] *= 40
    return off


def keys(n: int, off: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, *off.shape, generator=g) + off


def tables_for(context_lens: list[int], block_size: int, g: torch.Generator) -> tuple[list[list[int]], int]:
    """Each sequence's blocks, shuffled over a pool (its block count also returned)."""
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for ctx in context_lens:
        n = -(-ctx // block_size)
        tables.append(perm[used:used + n])
        used += n
    return tables, num_blocks


def write_history(kv: list[torch.Tensor], tables: list[list[int]], lens: list[int], block_size: int,
                  off: torch.Tensor, g: torch.Generator, chunks: tuple[int, ...] = (1, 3, 16, 40)) -> None:
    """Sequence i's first lens[i] tokens (tail slot i), in steps of sizes drawn from `chunks`."""
    for i, (table, n) in enumerate(zip(tables, lens)):
        pos = 0
        while pos < n:
            m = min(chunks[int(torch.randint(len(chunks), (1,), generator=g))], n - pos)
            meta = AttentionMetadata.build([m], [pos + m], [table], block_size, CPU, tail_slots=[i])
            write_kv(tuple(kv), meta, keys(m, off, g), torch.randn(m, *off.shape, generator=g))
            pos += m
