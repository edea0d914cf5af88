"""The KV tensors: one (k, v) pair per layer, [num_blocks * block_size, Hkv, D], sized from a memory budget.

The pool's tensor is [P, 2, slots, Hkv, D] for KV groups of P layers (ModelConfig.kv_groups): a
block holds one group's P layers, and layer l reads and writes index `kv_place(l)[1]` through
its group's block table, so layers of different groups share a tensor but never a block. A
model without windows is one group of all its layers. An int8 cache also holds one fp32 scale
per slot and KV head: (k, v, k_scale, v_scale).

A hybrid's recurrent layers keep no K and V: their entry in `layers` is their state, one fp32 tensor
[S, *shape] per shape the layer kind declares (`cfg.recurrent.state_shapes`: a Gated DeltaNet's conv
[K - 1, C] and delta rule [Hv, dk, dv], LFM2's short conv [L - 1, H]) for S state slots, one per running
sequence and checkpoint (`KVCacheManager` hands them out; a layer zeroes a slot when its sequence starts
at position 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phasewise.models.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer; int8 adds a 4-byte scale per KV head."""
    if dtype == torch.int8:
        return 2 * len(cfg.attention_layers) * cfg.num_kv_heads * (cfg.head_dim + 4)
    return cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens in the layers of one KV group."""
    return kv_bytes_per_token(cfg, dtype) * len(cfg.kv_groups[0]) // len(cfg.attention_layers) * block_size


def num_blocks_for_memory(cfg: ModelConfig, block_size: int, dtype: torch.dtype, gib: float) -> int:
    """How many blocks of `block_size` tokens (of one KV group) fit in `gib` GiB of K and V."""
    return max(1, int(gib * 2**30) // kv_bytes_per_block(cfg, block_size, dtype))


def state_slots_for_memory(cfg: ModelConfig, max_seqs: int, gib: float, checkpoints: bool, snapshots: int = 0) -> int:
    """A hybrid's recurrent-state slots for running sequences: one per sequence that may run (max_seqs),
    as many again for checkpoints if `checkpoints` and `snapshots` times as many for speculation's
    snapshots, all within half of the `gib` budget (at least one of each); 0 for a model without
    recurrent layers."""
    per_seq = cfg.state_bytes_per_seq * (1 + int(checkpoints) + snapshots)
    return 0 if not per_seq else max(1, min(max_seqs, int(gib * 2**30 / 2) // per_seq))


class KVCache:
    """dtype: the model's dtype, or torch.int8 (per-token, per-head scales, quantized on write)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, grouped: bool = True, num_state_slots: int = 0) -> None:
        """grouped=False: every layer its own tensor, all read through one table (a draft model
        that follows the target's first KV group). num_state_slots: a hybrid's sequences at once."""
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.bytes_per_token = kv_bytes_per_token(cfg, dtype)    # K and V of one token, every layer
        self.bytes_per_block = kv_bytes_per_block(cfg, block_size, dtype)
        self.num_state_slots = num_state_slots
        self.state_bytes = num_state_slots * cfg.state_bytes_per_seq
        attention = cfg.attention_layers
        slots, P = num_blocks * block_size, len(cfg.kv_groups[0]) if grouped else len(attention)
        index = [cfg.kv_place(i)[1] if grouped else n for n, i in enumerate(attention)]
        # Never-written slots are read under a mask (padding of a decode batch) and must hold no NaN
        # (softmax weight 0 * NaN = NaN), so the pool starts zeroed. On the CPU a large fresh
        # allocation is mapped from the OS as zero pages: `empty` gives zeros without touching
        # gigabytes up front (torch.zeros would spend ~1 s per GiB writing them).
        shape = (P, 2, slots, cfg.num_kv_heads, cfg.head_dim)   # [P, 2, S, Hkv, D]
        fresh_zero_pages = torch.device(device).type == "cpu" and math.prod(shape) >= 2**26
        alloc = torch.empty if fresh_zero_pages else torch.zeros
        self.data = alloc(shape, dtype=dtype, device=device)
        self.layers: list[tuple[torch.Tensor, ...]] = [(self.data[p, 0], self.data[p, 1]) for p in index]
        if dtype == torch.int8:   # unwritten slots: int8 zeros times scale 1 → 0, never NaN
            self.scales = torch.ones(P, 2, slots, cfg.num_kv_heads, device=device)
            self.layers = [(k, v, self.scales[p, 0], self.scales[p, 1]) for p, (k, v) in zip(index, self.layers)]
        self.states: list[tuple[torch.Tensor, ...]] = []   # a hybrid's recurrent state, per recurrent layer
        if cfg.recurrent is not None:     # every layer in order: KV or recurrent state
            shapes = cfg.recurrent.state_shapes
            self.states = [tuple(torch.empty(num_state_slots, *shape, device=device) for shape in shapes)
                           for _ in cfg.recurrent_layers]
            kv, states = iter(self.layers), iter(self.states)
            self.layers = [next(states) if i in cfg.recurrent_layers else next(kv) for i in range(cfg.num_layers)]

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """A hybrid's recurrent-state copies (from slot, to slot), in order, in every recurrent layer."""
        for src, dst in copies:
            for layer in self.states:
                for t in layer:
                    t[dst] = t[src]

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.data.device)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size, device=ids.device)).flatten()

    def read_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """A copy of these blocks' K and V in every layer ("kv": [P, 2, n * block_size, Hkv, D]) and, int8,
        their scales ("scales": [P, 2, n * block_size, Hkv])."""
        slots = self._slots(block_ids)
        out = {"kv": self.data[:, :, slots].clone()}
        if self.dtype == torch.int8:
            out["scales"] = self.scales[:, :, slots].clone()
        return out

    def write_blocks(self, block_ids: list[int], parts: dict[str, torch.Tensor]) -> None:
        """Fill these blocks from read_blocks' output (of a cache laid out as this one)."""
        slots = self._slots(block_ids)
        self.data[:, :, slots] = parts["kv"].to(self.data.device)
        if self.dtype == torch.int8:
            self.scales[:, :, slots] = parts["scales"].to(self.data.device)

    # ---- the prompt cache's disk tier (core/disk_tier.py's BlockIO): one block as bytes ---------

    @property
    def block_layout(self) -> str:
        """What a block's bytes are: the dtype and per-block shape of each part (the disk fingerprint's)."""
        P, _, _, H, D = self.data.shape
        parts = [f"kv:{self.dtype}:{P}x2x{self.block_size}x{H}x{D}"]
        if self.dtype == torch.int8:
            parts.append(f"scales:{self.scales.dtype}:{P}x2x{self.block_size}x{H}")
        parts += [f"state:{t.dtype}:{'x'.join(map(str, t.shape[1:]))}" for layer in self.states for t in layer]
        return ";".join(parts)

    def _block_parts(self) -> list[torch.Tensor]:
        """The parts as [P, 2, num_blocks, block_size, ...] views."""
        P, two, S = self.data.shape[:3]
        parts = [self.data] + ([self.scales] if self.dtype == torch.int8 else [])
        return [t.view(P, two, S // self.block_size, self.block_size, *t.shape[3:]) for t in parts]

    def copy_out(self, block_ids: Sequence[int]) -> list[bytearray]:
        """Each block's K and V in every layer ([P, 2, block_size, Hkv, D]; then, int8, their scales
        [P, 2, block_size, Hkv]) as bytes, copied once."""
        views = self._block_parts()
        sizes = [v[:, :, 0].numel() * v.element_size() for v in views]
        out = []
        for b in block_ids:
            buf = bytearray(sum(sizes))
            raw, at = torch.frombuffer(buf, dtype=torch.uint8), 0
            for v, n in zip(views, sizes):
                raw[at:at + n].view(v.dtype).view(v[:, :, b].shape).copy_(v[:, :, b])
                at += n
            out.append(buf)
        return out

    def fill(self, block_ids: Sequence[int], payloads: Sequence[bytearray]) -> None:
        """Write copy_out's bytes into these blocks; ValueError for bytes of another size."""
        views = self._block_parts()
        sizes = [v[:, :, 0].numel() * v.element_size() for v in views]
        for b, payload in zip(block_ids, payloads):
            if len(payload) != sum(sizes):
                raise ValueError(f"a KV block of {len(payload)} bytes, this cache's are {sum(sizes)}")
            raw, at = torch.frombuffer(payload, dtype=torch.uint8), 0
            for v, n in zip(views, sizes):
                v[:, :, b] = raw[at:at + n].view(v.dtype).view(v[:, :, b].shape).to(v.device)
                at += n

    def copy_state(self, slot: int) -> bytearray:
        """A hybrid's recurrent state in this slot, every recurrent layer's tensors in order, as bytes."""
        parts = [t[slot] for layer in self.states for t in layer]
        buf = bytearray(sum(p.numel() * p.element_size() for p in parts))
        raw, at = torch.frombuffer(buf, dtype=torch.uint8), 0
        for p in parts:
            n = p.numel() * p.element_size()
            raw[at:at + n].view(p.dtype).view(p.shape).copy_(p)
            at += n
        return buf

    def fill_state(self, slot: int, payload: bytearray) -> None:
        """Write copy_state's bytes into this slot; ValueError for bytes of another size."""
        parts = [t[slot] for layer in self.states for t in layer]
        size = sum(p.numel() * p.element_size() for p in parts)
        if len(payload) != size:
            raise ValueError(f"a recurrent state of {len(payload)} bytes, this cache's are {size}")
        raw, at = torch.frombuffer(payload, dtype=torch.uint8), 0
        for p in parts:
            n = p.numel() * p.element_size()
            p.copy_(raw[at:at + n].view(p.dtype).view(p.shape))
            at += n


@dataclass
class KVBlocks:
    """A prompt prefix's KV blocks as they leave one engine for another (prefill/decode
    disaggregation): the tokens they hold (whole blocks) and their contents (KVCache.read_blocks)."""
    token_ids: list[int]
    block_size: int
    parts: dict[str, torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    def block(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's contents alone."""
        bs = self.block_size
        return {name: t[:, :, i * bs:(i + 1) * bs] for name, t in self.parts.items()}
