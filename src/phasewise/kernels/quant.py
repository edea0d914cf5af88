"""Packed weights (csrc/quant_linear.cpp) and their pure-PyTorch reference.

A `PackedWeight` holds a linear layer's weight [N, K] in blocks of 32 along K, rows in tiles of
16, each (tile, block) one run of bytes with its scales after the quants, so a tile streams from
memory in one sequence (the layout the C++ kernel reads; see the top of quant_linear.cpp). Each
format is one record of kernels/weight_formats.py (its id, bytes, scales, value width, activation
grouping, what it unpacks to), which everything here reads: no format is named in this file.

The 6-bit bytes of k6 (and q5's, unpacked to bytes in the kernel) multiply unbiased on every ISA
(AVX2's vpmaddubsw without saturating), where q8's need a slower path on AVX2. A fused projection
whose parts differ in block type keeps each part in its own format, chained (`rest`), but for a
widening format's parts before its target's: q5 parts before q8 ones become q8 tiles holding U5
bytes (u = q + 16, `u5_tiles`).

Packing only moves bytes and widens scales (no second rounding of GGUF weights). `dequantize` is
the device-agnostic reference; `emulate` computes in PyTorch what the kernel computes
(activations quantized per block of 32 too), for tests. kernels/gguf_blocks.py reads GGUF blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from phasewise.kernels.weight_formats import (FORMATS, INT8, QK, SUPER, TILE, Scales, Unpack,
                                              WeightFormat, widened)

__all__ = ["FORMATS", "QK", "SUPER", "TILE", "PackedWeight", "WeightFormat", "concat", "dequantize",
           "dequantize_rows", "emulate", "pack", "quantize_activations", "quantize_i8"]


@dataclass(kw_only=True)
class PackedWeight:
    fmt: str                           # a name in FORMATS: q4 | q8 | i8 | k4 | k8 | q5 | k6 | q6k
    n: int                             # output features (rows of W)
    k: int                             # input features, a multiple of 32
    blocks: torch.Tensor               # [NT, KB, block_bytes] uint8: quants, then the scales
    # [NT * 16] fp32 (a row scale); [NT, KB / 8, 16 super_scales] fp16 (k4: d, then dmin; q6k: d)
    scale: torch.Tensor | None = None
    u5_tiles: int = 0                  # q8: its first tiles hold q5 values as u = q + 16 (concat)
    rest: tuple[PackedWeight, ...] = ()  # the rows that follow, each part in its own format (concat)

    @property
    def format(self) -> WeightFormat:
        return FORMATS[self.fmt]

    @property
    def rows(self) -> int:
        """Output features of every part."""
        return self.n + sum(p.n for p in self.rest)

    @property
    def parts(self) -> list[PackedWeight]:
        """Each part on its own (one for a weight of one format)."""
        return [replace(self, rest=()), *self.rest]

    @property
    def n_padded(self) -> int:
        return self.blocks.shape[0] * TILE

    @property
    def qs(self) -> torch.Tensor:
        """[NT, KB, quant_bytes] uint8 (a view)."""
        return self.blocks[..., :self.format.quant_bytes]

    def scales(self, i: int) -> torch.Tensor:
        """[Np, KB] the i-th per-block scale of every row, in the order of its format's `scales`."""
        f = self.format
        if i >= len(f.scales):
            raise IndexError(f"{f.name} has {len(f.scales)} scales per block")
        nt, kb, _ = self.blocks.shape
        dt = f.scales[i]
        lo = f.quant_bytes + TILE * sum(d.itemsize for d in f.scales[:i])
        s = self.blocks[..., lo:lo + TILE * dt.itemsize].contiguous().view(dt)    # [NT, KB, 16]
        return s.permute(0, 2, 1).reshape(nt * TILE, kb)

    def super_scales(self) -> list[torch.Tensor]:
        """[Np, KB] fp32 of each super-block scale (k4: d, dmin; q6k: d), for every block."""
        assert self.scale is not None               # a super-block format's
        nt, ks, _ = self.scale.shape
        n = self.format.super_scales
        each = self.scale.float().reshape(nt, ks, n, TILE).permute(2, 0, 3, 1).reshape(n, nt * TILE, ks)
        return [e.repeat_interleave(SUPER, dim=1) for e in each]

    def block_scales(self) -> list[torch.Tensor]:
        """Every per-block scale as [Np, KB] fp32, a super-block format's resolved with its
        super-block's (k4: d sc, -dmin m; q6k: k6's d, sc of each half, m = 0)."""
        f = self.format
        s = [self.scales(i).float() for i in range(len(f.scales))]
        return f.resolve(s, self.super_scales()) if f.resolve is not None else s

    def values(self) -> torch.Tensor:
        """[Np, KB, 32] int16: each weight's integer q (u - offset)."""
        f = self.format
        nt, kb, _ = self.blocks.shape
        if f.nibbles:       # chunk j < 4: byte j's low nibbles, j >= 4: byte j - 4's high; then its high bits
            nib = self.qs[..., :256].reshape(nt, kb, 4, 64)
            u = torch.cat([nib & 0x0F, nib >> 4], dim=2)                                    # [NT, KB, 8, 64]
            if f.bits > 4:
                h = f.bits - 4
                planes = self.qs[..., 256:].reshape(nt, kb, h, 1, 64)
                shift = (h * torch.arange(8 // h, dtype=torch.uint8, device=u.device)).reshape(1, 1, 1, -1, 1)
                u = u | (((planes >> shift) & ((1 << h) - 1)).reshape(nt, kb, 8, 64) << 4)
        else:
            u = self.qs
        q = _untile(u, nt, kb).to(torch.int16)
        if self.u5_tiles:           # its first tiles hold the values of the format that widens into it
            cut = TILE * self.u5_tiles
            narrow = next(n for n in FORMATS.values() if n.widens_into == f.name)
            return torch.cat([q[:cut] - narrow.offset, q[cut:] - f.offset])
        return q - f.offset

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.parts for t in (p.blocks, p.scale)
                   if t is not None)


def _integers(s: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether every value of s is an integer in lo..hi (an empty s: yes)."""
    return not s.numel() or bool(s.min() >= lo and s.max() <= hi and torch.equal(s, s.round()))


def _pad_rows(t: torch.Tensor, n_padded: int) -> torch.Tensor:
    if t.shape[0] == n_padded:
        return t
    return torch.cat([t, t.new_zeros(n_padded - t.shape[0], *t.shape[1:])])


def _tile_scales(s: torch.Tensor) -> torch.Tensor:
    """[Np, KB] → [NT, KB, 16 * itemsize] bytes: each (tile, block)'s 16 values."""
    np_, kb = s.shape
    return s.reshape(np_ // TILE, TILE, kb).permute(0, 2, 1).contiguous().view(torch.uint8)


def _tile_bytes(u: torch.Tensor) -> torch.Tensor:
    """[Np, KB, 32] bytes (one per k) → [NT, KB, 512]: chunks of 16 rows x 4 k."""
    np_, kb, _ = u.shape
    chunks = u.reshape(np_ // TILE, TILE, kb, 8, 4).permute(0, 2, 3, 1, 4)
    return chunks.reshape(np_ // TILE, kb, 512).contiguous()


def _untile(b: torch.Tensor, nt: int, kb: int) -> torch.Tensor:
    """[NT, KB, 512] bytes (or [NT, KB, 8, 64]) → [Np, KB, 32]: `_tile_bytes` undone."""
    return b.reshape(nt, kb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(nt * TILE, kb, QK)


def _nibble_planes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[NT, KB, 512] bytes u → [NT, KB, quant_bytes]: u's low nibbles (chunk j and j + 4 in one byte),
    then planes of its higher bits (plane P, bits h j..: chunk (8 / h) P + j's)."""
    nt, kb, _ = u.shape
    chunks = u.reshape(nt, kb, 8, 64)
    nib = (chunks[:, :, :4] & 0x0F) | ((chunks[:, :, 4:] & 0x0F) << 4)
    if bits == 4:
        return nib.reshape(nt, kb, 256)
    h = bits - 4
    shift = (h * torch.arange(8 // h, dtype=torch.uint8, device=u.device)).reshape(1, 1, 1, -1, 1)
    planes = ((chunks >> 4).reshape(nt, kb, h, 8 // h, 64) << shift).sum(dim=3, dtype=torch.uint8)
    return torch.cat([nib.reshape(nt, kb, 256), planes.reshape(nt, kb, 64 * h)], dim=-1)


def _check(f: WeightFormat, q: torch.Tensor, scales: list[torch.Tensor],
           sb: Sequence[torch.Tensor] | None) -> None:
    """ValueError for what format f cannot hold as it is given."""
    if f.row_scale:
        raise ValueError(f"{f.name} weights come from quantize_i8 (one scale per row, not per block)")
    if len(scales) != len(f.scales):
        raise ValueError(f"{f.name} takes {len(f.scales)} scales per block, got {len(scales)}")
    if f.super_scales and (sb is None or len(sb) != f.super_scales or q.shape[1] % SUPER):
        raise ValueError(f"{f.name} takes {f.super_scales} super-block scales and a multiple of {SUPER} "
                         "blocks")
    if f.sc_range is not None and not all(_integers(s, *f.sc_range) for s, dt in zip(scales, f.scales)
                                          if not dt.is_floating_point):
        raise ValueError(f"{f.name}'s sub-block scales are integers in {f.sc_range[0]}..{f.sc_range[1]}")
    lo, hi = f.q_range
    if q.numel() and (q.min() < lo or q.max() > hi):
        raise ValueError(f"{f.name} holds values in {lo}..{hi}, got {q.min().item()}..{q.max().item()}")


def pack(fmt: str, q: torch.Tensor, scales: list[torch.Tensor],
         sb: Sequence[torch.Tensor] | None = None) -> PackedWeight:
    """q [N, KB, 32] integers in the format's range (q4, k4: 0..15; q8, k8: -128..127; q5: -16..15;
    k6, q6k: -32..31) and its scales, each [N, KB] (cast to the format's dtype: pass values it holds
    exactly); a super-block format also takes `sb`, each [N, KB / 8] (fp16 values: k4's d and dmin,
    q6k's d) → a PackedWeight."""
    f = FORMATS[fmt]
    _check(f, q, scales, sb)
    n, kb, _ = q.shape
    np_ = -(-n // TILE) * TILE
    quants = _tile_bytes((_pad_rows(q.to(torch.int16), np_) + f.offset).to(torch.uint8))
    if f.nibbles:
        quants = _nibble_planes(quants, f.bits)
    tiles = [_tile_scales(_pad_rows(s.to(dtype), np_)) for s, dtype in zip(scales, f.scales)]
    side = None
    if f.super_scales and sb is not None:  # [NT, KB / 8, 16 each]: each (tile, super-block)'s 16 rows
        f16 = torch.float16
        side = torch.cat([_tile_scales(_pad_rows(s.to(f16), np_)).view(f16) for s in sb], dim=-1)
    return PackedWeight(fmt=fmt, n=n, k=kb * QK, blocks=torch.cat([quants, *tiles], dim=-1), scale=side)


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
    u = (_pad_rows(q, np_) + INT8.offset).to(torch.uint8).reshape(np_, k // QK, QK)
    return PackedWeight(fmt=INT8.name, n=n, k=k, blocks=_tile_bytes(u),
                        scale=_pad_rows(scale, np_).contiguous())


def concat(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights along N (a fused projection); every part but the last fills whole tiles.
    Consecutive parts of one format become one; parts of different formats stay each in its own
    (`rest`: a Q4_K_M file's Q4_K q and k and Q6_K v, each at the file's width), but for a widening
    format's parts before its target's: q5 parts before q8 ones become q8 tiles of U5 bytes
    (u5_tiles: the same bytes per block as q8's, with q5's cheaper products where the ISA has no
    unsigned-by-signed int8 product)."""
    formats = [p.format for p in parts]
    if any(p.k != parts[0].k for p in parts) or any(p.n % TILE for p in parts[:-1]) or \
            (len({f.name for f in formats}) > 1 and any(f.row_scale for f in formats)) or \
            any(p.u5_tiles or p.rest for p in parts):
        raise ValueError("cannot fuse these weights")
    into = widened(formats)
    if into is not None:
        cut = next(i for i, f in enumerate(formats) if f is into)
        narrow, wide = concat(parts[:cut]), concat(parts[cut:])
        u = _tile_bytes((narrow.values() + narrow.format.offset).to(torch.uint8))   # into's layout
        scales = [_tile_scales(narrow.scales(i)) for i in range(len(narrow.format.scales))]
        blocks = torch.cat([torch.cat([u, *scales], dim=-1), wide.blocks])
        return PackedWeight(fmt=into.name, n=narrow.n + wide.n, k=narrow.k, u5_tiles=narrow.blocks.shape[0],
                            blocks=blocks)
    if len({f.name for f in formats}) > 1:           # runs of one format, chained
        runs = [[parts[0]]]
        for p in parts[1:]:
            (runs[-1].append(p) if p.fmt == runs[-1][0].fmt else runs.append([p]))
        first, *rest = [concat(r) for r in runs]
        return replace(first, rest=tuple(rest))
    scales = [p.scale for p in parts if p.scale is not None]     # one format: every part has one, or none
    return PackedWeight(fmt=parts[0].fmt, n=sum(p.n for p in parts), k=parts[0].k,
                        blocks=torch.cat([p.blocks for p in parts]),
                        scale=torch.cat(scales) if scales else None)


def _halves(q: torch.Tensor, d0: torch.Tensor, d1: torch.Tensor) -> torch.Tensor:
    """q [Np, KB, 32] times d0 on each block's first 16 values, d1 on its last 16 (each [Np, KB, 1])."""
    return q * torch.cat([d0.expand(-1, -1, 16), d1.expand(-1, -1, 16)], dim=-1)


# What each Unpack form computes of q [Np, KB, 32] and the resolved scales, each [Np, KB, 1]
UNPACK: dict[Unpack, Callable[[torch.Tensor, Scales], torch.Tensor]] = {
    "d q": lambda q, s: q * s[0],
    "d q + m": lambda q, s: q * s[0] + s[1],
    "d_h q + m": lambda q, s: _halves(q, s[0], s[1]) + s[-1],
    "d sc_h q + m": lambda q, s: _halves(q, s[0] * s[1], s[0] * s[2]) + s[-1],
}


def dequantize(w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as [N, K] in dtype, exactly the stored values (the reference path)."""
    if w.rest:
        return torch.cat([dequantize(p, dtype) for p in w.parts])
    q = w.values().float()                                                      # [Np, KB, 32]
    if w.format.row_scale:
        assert w.scale is not None                                              # the row scales
        out = q * w.scale.reshape(-1, 1, 1)
    else:
        out = UNPACK[w.format.unpacks_to](q, [t[..., None] for t in w.block_scales()])
    return out.reshape(w.n_padded, w.k)[: w.n].to(dtype)


def dequantize_rows(w: PackedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` [T] of the weight as [T, K] (the reference of the kernels' dequantize_rows): only
    the tiles holding them are dequantized."""
    if w.u5_tiles or w.rest:
        raise ValueError("dequantize_rows takes a table, not a fused projection")
    flat = ids.reshape(-1)
    tiles, lanes = torch.unique(flat // TILE, return_inverse=True)
    scale = None if w.scale is None else w.scale[tiles] if w.format.super_scales else \
        w.scale.reshape(-1, TILE)[tiles].reshape(-1)
    part = PackedWeight(fmt=w.fmt, n=tiles.numel() * TILE, k=w.k, blocks=w.blocks[tiles], scale=scale)
    rows = dequantize(part, dtype)[lanes * TILE + flat % TILE]
    return rows.reshape(*ids.shape, w.k)


def quantize_activations(x: torch.Tensor, group: int = QK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 → xq [M, K] int8, dx, sx [M, K/32]: symmetric int8 with one scale dx = max|x| / 127
    per group of `group` values (a format's `activation_group`: 32, or 256 for the super-block formats,
    llama.cpp's Q8_K, whose integer sub-block scales then sum in integers across the super-block:
    csrc/quant_tile.h), repeated for each block of 32 of the group, and sx = dx Σ xq over the block."""
    m, k = x.shape
    xg = x.float().reshape(m, k // group, group)
    amax = xg.abs().amax(dim=-1)
    # 127 / t, not 1/t * 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv[..., None]).clamp(-127, 127).reshape(m, k // QK, QK)
    dx = (amax / 127).repeat_interleave(group // QK, dim=1)
    return xq.to(torch.int8).reshape(m, k), dx, dx * xq.sum(-1)


def emulate(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in PyTorch: x quantized per its format's activation group, times the
    exact weights; each part of a fused weight with its own activations."""
    outs = []
    for part in w.parts:
        xq, dx, _ = quantize_activations(x, part.format.activation_group)
        xd = (xq.float().reshape(x.shape[0], -1, QK) * dx[..., None]).reshape(x.shape)
        outs.append(torch.nn.functional.linear(xd, dequantize(part)))
    y = torch.cat(outs, dim=-1)
    return y if bias is None else y + bias
