"""The KV tensors: one (k, v) pair per layer, [num_blocks * block_size, Hkv, D], sized from a memory budget.

The pool's tensor is [P, 2, slots, Hkv, D] for KV groups of P layers (ModelConfig.kv_groups): a
block holds one group's P layers, and layer l reads and writes index `kv_place(l)[1]` through
its group's block table, so layers of different groups share a tensor but never a block. A
model without windows is one group of all its layers. An int8 cache (docs/architecture.md, "int8 KV
cache") also holds each 16-token group's per-channel midpoint and step of K (`k_groups`), one fp32
scale per slot and KV head of V (`v_scale`), and per tail slot (one per running sequence) the fp32
keys of its last two groups (`tails`, per layer) with the group each holds (`tail_groups`); a layer's
entry is then (k, v, k_groups, v_scale, tails, tail_groups). An int4 cache (dtype INT4, "int4 KV cache") is
the same with 4-bit codes two to a byte (k and v uint8 [slots, Hkv, D / 2]), key groups of 64 tokens
(k_groups fp16 [slots / 64, Hkv, 2, D]: minimum, step), fp16 V scales per 32 values ([slots, Hkv, D / 32])
and tails of 64 keys and their values ([2 tail slots, 2, 64, Hkv, D]).

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


KEY_GROUP = 16          # an int8 cache's keys: tokens per group of per-channel scales (the kernels' KEYS)
KEY_GROUP4 = 64         # an int4 cache's
INT4 = torch.uint8      # the dtype that names an int4 cache (its codes, two to a byte)
V4_BLOCK = 32           # an int4 cache's values per fp16 scale


def key_group(dtype: torch.dtype) -> int:
    """Tokens per key group of a quantized cache (the block size must be a multiple); 0 for a float one."""
    return KEY_GROUP if dtype == torch.int8 else KEY_GROUP4 if dtype == INT4 else 0


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer; int8 adds V's 4-byte scale per KV head and K's midpoint and
    step per channel, 8 bytes per 16 tokens (D / 2 a token); int4 holds D / 2 bytes each of K and V, K's
    fp16 minimum and step per channel over 64 tokens (D / 16 a token) and V's fp16 scale per 32 values
    (D / 16): 4.5 bits a value."""
    D = cfg.head_dim
    if dtype == torch.int8:
        return len(cfg.attention_layers) * cfg.num_kv_heads * (2 * D + 8 * D // KEY_GROUP + 4)
    if dtype == INT4:
        return len(cfg.attention_layers) * cfg.num_kv_heads * (D + 4 * D // KEY_GROUP4 + 2 * D // V4_BLOCK)
    return cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def tail_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """A quantized cache's tail slot (a running sequence's last two key groups in fp32, int4 their values
    too, every layer); 0 otherwise."""
    parts = 2 if dtype == INT4 else 1
    return len(cfg.attention_layers) * 2 * parts * key_group(dtype) * cfg.num_kv_heads * cfg.head_dim * 4


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


def tail_slots_for_memory(cfg: ModelConfig, dtype: torch.dtype, max_seqs: int, gib: float) -> int:
    """A quantized cache's tail slots: one per sequence that may run (max_seqs), within a quarter of the `gib`
    budget (at least one; an int4 tail is 1,024 D bytes a layer and KV head); 0 for a float cache."""
    per_seq = tail_bytes(cfg, dtype)
    return 0 if not per_seq else max(1, min(max_seqs, int(gib * 2**30 / 4) // per_seq))


class KVCache:
    """dtype: the model's dtype, or torch.int8 (V per token and head, K per channel over 16-token groups,
    quantized as they are written; block_size a multiple of 16), or INT4 (the same in 4 bits, key groups
    of 64 tokens; block_size a multiple of 64)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, grouped: bool = True, num_state_slots: int = 0,
                 num_tail_slots: int = 16) -> None:
        """grouped=False: every layer its own tensor, all read through one table (a draft model
        that follows the target's first KV group). num_state_slots: a hybrid's sequences at once.
        num_tail_slots: a quantized cache's sequences at once (each a tail of fp32 keys)."""
        group = key_group(dtype)
        if group and block_size % group:
            raise ValueError(f"an {'int8' if dtype == torch.int8 else 'int4'} KV cache needs a block size that is a "
                             f"multiple of {group}, got {block_size}")
        if dtype == INT4 and cfg.head_dim % 64:
            raise ValueError(f"an int4 KV cache needs a head size that is a multiple of 64, got {cfg.head_dim}")
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
        H, D = cfg.num_kv_heads, cfg.head_dim
        shape = (P, 2, slots, H, D // 2 if dtype == INT4 else D)   # [P, 2, S, Hkv, D]
        self.data = _zeros(shape, dtype, device)
        self.layers: list[tuple[torch.Tensor, ...]] = [(self.data[p, 0], self.data[p, 1]) for p in index]
        self.num_tail_slots = num_tail_slots if group else 0
        self.tail_bytes = self.num_tail_slots * tail_bytes(cfg, dtype)
        if group:   # unwritten: codes 0 in groups of step 0, V scale 1 (int4: 0) → 0, never NaN
            scale = torch.float32 if dtype == torch.int8 else torch.float16
            self.k_groups = _zeros((P, 1, slots // group, H, 2, D), scale, device)
            self.v_scale = (torch.ones(P, 1, slots, H, device=device) if dtype == torch.int8 else
                            _zeros((P, 1, slots, H, D // V4_BLOCK), scale, device))
            tail = (2, group) if dtype == INT4 else (group,)        # int4: keys, then values
            self.tails = torch.zeros(len(attention), 2 * num_tail_slots, *tail, H, D, device=device)
            self.tail_groups = torch.full((num_tail_slots, 2), -1, dtype=torch.int64, device=device)
            self.layers = [(k, v, self.k_groups[p, 0], self.v_scale[p, 0], self.tails[n], self.tail_groups)
                           for n, (p, (k, v)) in enumerate(zip(index, self.layers))]
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

    @property
    def _parts(self) -> dict[str, torch.Tensor]:
        """What a block holds, each [P, 2 or 1, rows, ...] with a block's rows consecutive along dim 2: K and V
        (block_size rows), and a quantized cache's K group scales (block_size / 16, int4: / 64) and V scales
        (block_size)."""
        if not key_group(self.dtype):
            return {"kv": self.data}
        return {"kv": self.data, "k_groups": self.k_groups, "v_scale": self.v_scale}

    def _rows(self, t: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """The rows of these blocks along dim 2 of part t."""
        per = t.shape[2] // self.num_blocks
        ids = torch.tensor(block_ids, dtype=torch.int64, device=t.device)
        return (ids[:, None] * per + torch.arange(per, device=t.device)).flatten()

    def read_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """A copy of these blocks' parts (`_parts`) in every layer, e.g. "kv": [P, 2, n * block_size, Hkv, D]."""
        return {name: t[:, :, self._rows(t, block_ids)].clone() for name, t in self._parts.items()}

    def write_blocks(self, block_ids: list[int], parts: dict[str, torch.Tensor]) -> None:
        """Fill these blocks from read_blocks' output (of a cache laid out as this one)."""
        for name, t in self._parts.items():
            t[:, :, self._rows(t, block_ids)] = parts[name].to(t.device)

    # ---- the prompt cache's disk tier (core/disk_tier.py's BlockIO): one block as bytes ---------

    @property
    def block_layout(self) -> str:
        """What a block's bytes are: the dtype and per-block shape of each part (the disk fingerprint's)."""
        parts = [f"{name}:{t.dtype}:{'x'.join(map(str, v.shape[:2] + v.shape[3:]))}"
                 for (name, t), v in zip(self._parts.items(), self._block_parts())]
        parts += [f"state:{t.dtype}:{'x'.join(map(str, t.shape[1:]))}" for layer in self.states for t in layer]
        return ";".join(parts)

    def _block_parts(self) -> list[torch.Tensor]:
        """The parts as [P, 2 or 1, num_blocks, rows per block, ...] views."""
        return [t.view(*t.shape[:2], self.num_blocks, t.shape[2] // self.num_blocks, *t.shape[3:])
                for t in self._parts.values()]

    def copy_out(self, block_ids: Sequence[int]) -> list[bytearray]:
        """Each block's parts in every layer (K and V [P, 2, block_size, Hkv, D]; then, quantized, the K group
        scales and the V scales) as bytes, copied once."""
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


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor; on the CPU a large one as fresh zero pages (torch.empty), never written up front."""
    fresh_zero_pages = torch.device(device).type == "cpu" and math.prod(shape) >= 2**26
    return (torch.empty if fresh_zero_pages else torch.zeros)(shape, dtype=dtype, device=device)


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
        """Block i's contents alone (each part's rows of it along dim 2)."""
        out = {}
        for name, t in self.parts.items():
            per = t.shape[2] // self.num_blocks
            out[name] = t[:, :, i * per:(i + 1) * per]
        return out
