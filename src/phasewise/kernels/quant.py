"""Quantized weight formats (csrc/quant_linear.cpp) and their pure-PyTorch reference.

A `PackedWeight` holds a linear layer's weight [N, K] in blocks of 32 along K, rows in
tiles of 16, each (tile, block) one run of bytes with its fp16 scales after the quants, so
a tile streams from memory in one sequence (the layout the C++ kernel reads; see the top of
quant_linear.cpp):

- "q4": GGUF Q4_1 (w = d q + m) and Q4_0 (m = -8 d), the file's bytes and fp16 scales as they are;
- "q8": GGUF Q8_0 (w = d q), q stored as q + 128; GGUF Q5_0 (w = d (q - 16), 5-bit q) as the same;
- "i8": our own int8 per output channel (w = s_n q), from fp32 weights.

Packing only moves bytes (no second rounding for the GGUF formats). `dequantize` is the
device-agnostic reference; `emulate` computes in PyTorch what the kernel computes (activations
quantized per block of 32 too), for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32                                   # values per block
TILE = 16                                 # output rows per tile (one vector lane each)
FORMAT_IDS = {"q4": 0, "q8": 1, "i8": 2}
QUANT_BYTES = {"q4": 256, "q8": 512, "i8": 512}   # quants per (tile, block); then d (q4, q8), m (q4)
BLOCK_BYTES = {"q4": 256 + 64, "q8": 512 + 32, "i8": 512}
# GGUF block types we read as they are: name → (format, bytes per block of 32).
GGUF_BLOCKS = {"Q4_0": ("q4", 18), "Q4_1": ("q4", 20), "Q8_0": ("q8", 34), "Q5_0": ("q8", 22)}


@dataclass(kw_only=True)
class PackedWeight:
    fmt: str                       # q4 | q8 | i8
    n: int                         # output features (rows of W)
    k: int                         # input features, a multiple of 32
    blocks: torch.Tensor               # [NT, KB, BLOCK_BYTES] uint8: quants, then d and m
    scale: torch.Tensor | None = None  # [NT * 16] fp32 (i8)

    @property
    def n_padded(self) -> int:
        return self.blocks.shape[0] * TILE

    @property
    def qs(self) -> torch.Tensor:
        """[NT, KB, QUANT_BYTES] uint8 (a view)."""
        return self.blocks[..., :QUANT_BYTES[self.fmt]]

    @property
    def d(self) -> torch.Tensor | None:
        """[NT, KB, 16] fp16 block scales (a view; q4, q8)."""
        q = QUANT_BYTES[self.fmt]
        return None if self.fmt == "i8" else self.blocks[..., q:q + 32].view(torch.float16)

    @property
    def m(self) -> torch.Tensor | None:
        """[NT, KB, 16] fp16 block mins (a view; q4)."""
        return self.blocks[..., 288:320].view(torch.float16) if self.fmt == "q4" else None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.scale) if t is not None)


def _pad_rows(t: torch.Tensor, n_padded: int) -> torch.Tensor:
    if t.shape[0] == n_padded:
        return t
    return torch.cat([t, t.new_zeros(n_padded - t.shape[0], *t.shape[1:])])


def _tile_scales(s: torch.Tensor) -> torch.Tensor:
    """[Np, KB] fp16 → [NT, KB, 32] bytes: each (tile, block)'s 16 values."""
    np_, kb = s.shape
    return s.reshape(np_ // TILE, TILE, kb).permute(0, 2, 1).contiguous().view(torch.uint8)


def _tile_bytes(u: torch.Tensor) -> torch.Tensor:
    """[Np, KB, 32] bytes (one per k) → [NT, KB, 512]: chunks of 16 rows x 4 k."""
    np_, kb, _ = u.shape
    return u.reshape(np_ // TILE, TILE, kb, 8, 4).permute(0, 2, 3, 1, 4).reshape(np_ // TILE, kb, 512).contiguous()


def _untile_bytes(qs: torch.Tensor) -> torch.Tensor:
    nt, kb, _ = qs.shape
    return qs.reshape(nt, kb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(nt * TILE, kb, QK)


def pack_q4(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> PackedWeight:
    """GGUF Q4 blocks: qs [N, KB, 16] uint8 (byte i: k = i low nibble, k = i + 16 high), d, m [N, KB] fp16."""
    n, kb, _ = qs.shape
    np_ = -(-n // TILE) * TILE
    qs, d, m = _pad_rows(qs, np_), _pad_rows(d, np_), _pad_rows(m, np_)
    # byte 4j + p of a row's block → chunk j, lane (row), position p
    tiled = qs.reshape(np_ // TILE, TILE, kb, 4, 4).permute(0, 2, 3, 1, 4).reshape(np_ // TILE, kb, 256)
    return PackedWeight(fmt="q4", n=n, k=kb * QK, blocks=torch.cat([tiled, _tile_scales(d), _tile_scales(m)], dim=-1))


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> PackedWeight:
    """GGUF Q8_0 blocks: q [N, KB, 32] int8, d [N, KB] fp16."""
    n, kb, _ = q.shape
    np_ = -(-n // TILE) * TILE
    u = (_pad_rows(q, np_).to(torch.int16) + 128).to(torch.uint8)
    return PackedWeight(fmt="q8", n=n, k=kb * QK,
                        blocks=torch.cat([_tile_bytes(u), _tile_scales(_pad_rows(d, np_))], dim=-1))


def quantize_i8(w: torch.Tensor) -> PackedWeight:
    """fp32 W [N, K] (K a multiple of 32) → int8 per output channel, symmetric: s_n = max|w_n| / 127."""
    n, k = w.shape
    if k % QK:
        raise ValueError(f"in_features {k} is not a multiple of {QK}")
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int16)
    np_ = -(-n // TILE) * TILE
    u = (_pad_rows(q, np_) + 128).to(torch.uint8).reshape(np_, k // QK, QK)
    return PackedWeight(fmt="i8", n=n, k=k, blocks=_tile_bytes(u), scale=_pad_rows(scale, np_).contiguous())


def pack_gguf(type_name: str, raw: np.ndarray | torch.Tensor) -> PackedWeight:
    """Raw GGUF rows [N, KB * block bytes] uint8 of type Q4_0, Q4_1, Q8_0 or Q5_0 → a PackedWeight."""
    raw = torch.from_numpy(np.array(raw, dtype=np.uint8)) if isinstance(raw, np.ndarray) else raw  # a copy
    fmt, size = GGUF_BLOCKS[type_name]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if type_name == "Q4_1":
        return pack_q4(blocks[..., 4:20], d, blocks[..., 2:4].contiguous().view(torch.float16)[..., 0])
    if type_name == "Q4_0":
        return pack_q4(blocks[..., 2:18], d, d * -8)  # exact: a power of two times an fp16
    if type_name == "Q5_0":   # low nibbles as Q4_0's; bit j of the 32-bit qh is value j's fifth bit
        qh = blocks[..., 2:6].contiguous().view(torch.int32)                  # [N, KB, 1]
        qs = blocks[..., 6:22]
        low = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int16)        # [N, KB, 32]
        high = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.int16) << 4
        return pack_q8(((low | high) - 16).to(torch.int8), d)
    return pack_q8(blocks[..., 2:34].contiguous().view(torch.int8), d)


def concat(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights of one format along N (a fused projection); every part but the last fills whole tiles."""
    fmt = parts[0].fmt
    if any(p.fmt != fmt or p.k != parts[0].k for p in parts) or any(p.n % TILE for p in parts[:-1]):
        raise ValueError("cannot fuse these weights")
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return PackedWeight(fmt=fmt, n=sum(p.n for p in parts), k=parts[0].k, blocks=cat([p.blocks for p in parts]),
                        scale=cat([p.scale for p in parts]))


def dequantize(w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as [N, K] in dtype, exactly the stored values (the reference path)."""
    nt, kb, _ = w.blocks.shape
    if w.fmt == "q4":
        b = w.qs.reshape(nt, kb, 4, TILE, 4).permute(0, 3, 1, 2, 4).reshape(nt * TILE, kb, 16)
        q = torch.cat([b & 0x0F, b >> 4], dim=-1).float()                       # [Np, KB, 32]
        d, m = (s.permute(0, 2, 1).reshape(nt * TILE, kb, 1).float() for s in (w.d, w.m))
        out = q * d + m
    else:
        q = _untile_bytes(w.qs).float() - 128
        if w.fmt == "q8":
            out = q * w.d.permute(0, 2, 1).reshape(nt * TILE, kb, 1).float()
        else:
            out = q * w.scale.reshape(-1, 1, 1)
    return out.reshape(nt * TILE, kb * QK)[: w.n].to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 → xq [M, K] int8, dx, sx [M, K/32]: per block of 32, dx = max|x| / 127, sx = dx Σ xq."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    amax = xb.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127)
    dx = amax / 127
    return xq.to(torch.int8).reshape(m, k), dx, dx * xq.sum(-1)


def emulate(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in PyTorch: x quantized per block of 32, times the exact weights."""
    xq, dx, _ = quantize_activations(x)
    xd = (xq.float().reshape(x.shape[0], -1, QK) * dx[..., None]).reshape(x.shape)
    return torch.nn.functional.linear(xd, dequantize(w), bias)
