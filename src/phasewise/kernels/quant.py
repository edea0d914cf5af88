"""Quantized weight formats (csrc/quant_linear.cpp) and their pure-PyTorch reference.

A `PackedWeight` holds a linear layer's weight [N, K] in blocks of 32 along K, rows in
tiles of 16, each (tile, block) one run of bytes with its scales after the quants, so a tile
streams from memory in one sequence (the layout the C++ kernel reads; see the top of
quant_linear.cpp):

- "q4": GGUF Q4_1 (w = d q + m) and Q4_0 (m = -8 d), the file's bytes and fp16 scales as they are;
- "q8": GGUF Q8_0 (w = d q), q stored as q + 128;
- "q5": GGUF Q5_0 (w = d (u - 16), u in 0..31) in 5.5 bits a weight: u's low 4 bits as q4's
  nibbles, then 64 bytes of fifth bits (bit g: k = 4g..4g+3 at that byte of a chunk), fp16 d;
- "i8": our own int8 per output channel (w = s_n q), from fp32 weights;
- "k4": GGUF Q4_K at the file's width (4.625 bits a weight against its 4.5): the nibbles as q4's,
  each block's 6-bit sc and m as bytes, and per super-block of 256 (8 blocks) the file's fp16 d and
  dmin in `scale` ([NT, KB/8, 32]: 16 rows' d, then their dmin), so w = d sc q - dmin m;
- "k8": bytes with an fp32 d per 16-wide half of a block and an fp32 m: w = d_h q + m;
- "k6": q in -32..31 stored as q + 32, w = d sc_h q + m: fp32 d and m, and an integer sc
  (|sc| <= 128, int16) per 16-wide half h: GGUF Q5_K (sc = 1, d its sub-block's d_K sc_K) and Q6_K
  (d = d_K, sc its sub-blocks' int8 scales), so AVX2's kernel sums both halves in one integer sum.
- "q6k": GGUF Q6_K at the file's width (6.5625 bits): u = q + 32 as q4's nibbles, then two 64-byte
  planes of high bit pairs (plane P, bits 2j..2j+1: chunk 4P + j's), each half's int8 sc, and the
  super-block's fp16 d in `scale` ([NT, KB/8, 16]); the kernels unpack it to k6 tiles in L1/L2.
The 6-bit bytes of k6 (and q5's, unpacked to bytes in the kernel) multiply unbiased on every ISA
(AVX2's vpmaddubsw without saturating), where q8's need a slower path on AVX2. A fused projection
whose parts differ in block type keeps each part in its own format, chained (`rest`), but for q5
parts before q8 ones: q8 tiles holding U5 bytes (u = q + 16, `u5_tiles`). No load path makes k8
(it holds any mix of bytes); the tests pack it directly.

Packing only moves bytes and widens scales (no second rounding of GGUF weights). `dequantize` is
the device-agnostic reference; `emulate` computes in PyTorch what the kernel computes
(activations quantized per block of 32 too), for tests. kernels/gguf_blocks.py reads GGUF blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

QK = 32                                   # values per block
TILE = 16                                 # output rows per tile (one vector lane each)
FORMAT_IDS = {"q4": 0, "q8": 1, "i8": 2, "k4": 3, "k8": 4, "q5": 5, "k6": 6, "q6k": 8}
NIBBLES = ("q4", "k4")                    # quants as 4-bit values; q5 as q + 16 in 5 bits; the others bytes
OFFSET = {"q8": 128, "i8": 128, "k8": 128, "q5": 16, "k6": 32, "q6k": 32}
# each format's per-block scales after the quants, in pack's order: one 16-row vector each, of this dtype
_F16, _F32, _I16, _U8, _I8 = torch.float16, torch.float32, torch.int16, torch.uint8, torch.int8
SCALES = {"q4": (_F16, _F16), "q8": (_F16,), "i8": (), "k4": (_U8, _U8), "k8": (_F32, _F32, _F32),
          "q5": (_F16,), "k6": (_F32, _I16, _I16, _F32), "q6k": (_I8, _I8)}
QUANT_BYTES = {f: 256 if f in NIBBLES else 320 if f == "q5" else 384 if f == "q6k" else 512
               for f in FORMAT_IDS}       # per (tile, block)
BLOCK_BYTES = {f: QUANT_BYTES[f] + 16 * sum(dt.itemsize for dt in SCALES[f]) for f in FORMAT_IDS}
K6_SC = 128                               # k6's largest |sc|: AVX2's int16 pair sums times sc stay in int32
SUPER = 8                                 # k4's, q6k's blocks per super-block (their fp16 d, and
                                          # k4's dmin, in `scale`)
SUPER_SCALES = {"k4": 2, "q6k": 1}        # fp16 vectors of 16 per (tile, super-block)


@dataclass(kw_only=True)
class PackedWeight:
    fmt: str                       # q4 | q8 | i8 | k4 | k8 | q5 | k6 | q6k
    n: int                         # output features (rows of W)
    k: int                         # input features, a multiple of 32
    blocks: torch.Tensor               # [NT, KB, BLOCK_BYTES] uint8: quants, then the scales
    # [NT * 16] fp32 (i8); [NT, KB / 8, 32] fp16 (k4: d, then dmin; q6k: [.., 16] d)
    scale: torch.Tensor | None = None
    u5_tiles: int = 0                  # q8: its first tiles hold q5 values as u = q + 16 (concat)
    rest: tuple[PackedWeight, ...] = ()  # the rows that follow, each part in its own format (concat)

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
        """[NT, KB, QUANT_BYTES] uint8 (a view)."""
        return self.blocks[..., :QUANT_BYTES[self.fmt]]

    def scales(self, i: int) -> torch.Tensor:
        """[Np, KB] the i-th per-block scale of every row (q4: d, m; k4: sc, m; q8, q5: d; k8: d of each
        half, m; k6: d, sc of each half, m)."""
        dtypes = SCALES[self.fmt]
        if i >= len(dtypes):
            raise IndexError(f"{self.fmt} has {len(dtypes)} scales per block")
        nt, kb, _ = self.blocks.shape
        lo = QUANT_BYTES[self.fmt] + 16 * sum(dt.itemsize for dt in dtypes[:i])
        s = self.blocks[..., lo:lo + 16 * dtypes[i].itemsize].contiguous().view(dtypes[i])    # [NT, KB, 16]
        return s.permute(0, 2, 1).reshape(nt * TILE, kb)

    def super_scales(self) -> list[torch.Tensor]:
        """k4: [Np, KB] fp32 d and dmin of every block's super-block; q6k: its d."""
        assert self.scale is not None               # k4's, q6k's super-block scales
        nt, ks, _ = self.scale.shape
        n = SUPER_SCALES[self.fmt]
        each = self.scale.float().reshape(nt, ks, n, TILE).permute(2, 0, 3, 1).reshape(n, nt * TILE, ks)
        return [e.repeat_interleave(SUPER, dim=1) for e in each]

    def block_scales(self) -> list[torch.Tensor]:
        """Every per-block scale as [Np, KB] fp32, k4's resolved to d sc and -dmin m (exact in fp32),
        q6k's in k6's order (d, sc of each half, m = 0)."""
        s = [self.scales(i).float() for i in range(len(SCALES[self.fmt]))]
        if self.fmt == "k4":
            d, dmin = self.super_scales()
            return [d * s[0], -(dmin * s[1])]
        if self.fmt == "q6k":
            d, = self.super_scales()
            return [d, s[0], s[1], torch.zeros_like(d)]
        return s

    def values(self) -> torch.Tensor:
        """[Np, KB, 32] int16: each weight's integer (nibble formats 0..15, the others u - OFFSET)."""
        nt, kb, _ = self.blocks.shape
        if self.fmt in NIBBLES:
            b = self.qs.reshape(nt, kb, 4, TILE, 4).permute(0, 3, 1, 2, 4).reshape(nt * TILE, kb, 16)
            return torch.cat([b & 0x0F, b >> 4], dim=-1).to(torch.int16)
        if self.fmt == "q6k":     # chunk g: its nibbles as q4's, bits 2 (g % 4) of pair plane g / 4
            nib = self.qs[..., :256].reshape(nt, kb, 4, 64)
            low = torch.cat([nib & 0x0F, nib >> 4], dim=2)                                  # [NT, KB, 8, 64]
            planes = self.qs[..., 256:].reshape(nt, kb, 2, 1, 64)
            shift = (2 * torch.arange(4, dtype=torch.uint8, device=planes.device)).reshape(1, 1, 1, 4, 1)
            pairs = ((planes >> shift) & 3).reshape(nt, kb, 8, 64)
            return _untile(low | (pairs << 4), nt, kb).to(torch.int16) - OFFSET["q6k"]
        if self.fmt == "q5":       # nibbles as q4's, bit g of the plane's byte: chunk g's fifth bit
            nib = self.qs[..., :256].reshape(nt, kb, 4, 64)
            low = torch.cat([nib & 0x0F, nib >> 4], dim=2)                                  # [NT, KB, 8, 64]
            plane = self.qs[..., 256:].reshape(nt, kb, 1, 64)
            bit = torch.arange(8, dtype=torch.uint8, device=plane.device).reshape(1, 1, 8, 1)
            fifth = (plane >> bit) & 1
            return _untile(low | (fifth << 4), nt, kb).to(torch.int16) - OFFSET["q5"]
        u = _untile(self.qs, nt, kb).to(torch.int16)
        if self.u5_tiles:
            cut = TILE * self.u5_tiles
            return torch.cat([u[:cut] - OFFSET["q5"], u[cut:] - OFFSET["q8"]])
        return u - OFFSET[self.fmt]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.parts for t in (p.blocks, p.scale)
                   if t is not None)


def bits_per_weight(fmt: str) -> float:
    """What a packed weight of `fmt` streams per weight: its blocks and per-block scales (k4's and
    q6k's super-block scales spread over their 8 blocks; i8's row scale left out)."""
    return (BLOCK_BYTES[fmt] + 2 * TILE * SUPER_SCALES.get(fmt, 0) / SUPER) * 8 / (TILE * QK)


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


def pack(fmt: str, q: torch.Tensor, scales: list[torch.Tensor],
         sb: Sequence[torch.Tensor] | None = None) -> PackedWeight:
    """q [N, KB, 32] integers (q4, k4: 0..15; q8, k8: -128..127; q5: -16..15; k6: -32..31) and the
    format's scales, each [N, KB] (cast to the format's dtype: pass values it holds exactly); k4 also
    takes `sb`, its d and dmin [N, KB / 8] (fp16 values), q6k its d → a PackedWeight."""
    n, kb, _ = q.shape
    dtypes = SCALES[fmt]
    if fmt == "i8":
        raise ValueError("i8 weights come from quantize_i8 (one scale per row, not per block)")
    if len(scales) != len(dtypes):
        raise ValueError(f"{fmt} takes {len(dtypes)} scales per block, got {len(scales)}")
    if fmt == "k6" and not all(_integers(s, -K6_SC, K6_SC) for s in scales[1:3]):
        raise ValueError(f"k6's sub-block scales are integers of at most {K6_SC} in magnitude")
    if fmt == "k4" and (sb is None or kb % SUPER or not all(_integers(s, 0, 63) for s in scales)):
        raise ValueError("k4 takes sub-block scales of 0..63, super-block d and dmin, and a multiple of "
                         f"{SUPER} blocks")
    if fmt == "q6k" and (sb is None or kb % SUPER or not all(_integers(s, -128, 127) for s in scales)):
        raise ValueError("q6k takes int8 sub-block scales, a super-block d, and a multiple of "
                         f"{SUPER} blocks")
    np_ = -(-n // TILE) * TILE
    q = _pad_rows(q.to(torch.int16), np_)
    if fmt in NIBBLES:   # byte i of a row's block: k = i low nibble, k = i + 16 high; byte 4j + p → chunk j
        b = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        quants = b.reshape(np_ // TILE, TILE, kb, 4, 4).permute(0, 2, 3, 1, 4).reshape(np_ // TILE, kb, 256)
    else:
        lo, hi = (-16, 15) if fmt == "q5" else (-32, 31) if fmt in ("k6", "q6k") else (-128, 127)
        if q.numel() and (q.min() < lo or q.max() > hi):
            raise ValueError(f"{fmt} holds values in {lo}..{hi}, got {q.min().item()}..{q.max().item()}")
        quants = _tile_bytes((q + OFFSET[fmt]).to(torch.uint8))
        if fmt == "q5":     # [NT, KB, 8 chunks of 64] bytes → the low nibbles as q4's, then the fifth bits
            u = quants.reshape(np_ // TILE, kb, 8, 64)
            nib = (u[:, :, :4] & 0x0F) | ((u[:, :, 4:] & 0x0F) << 4)
            bits = (u >> 4) << torch.arange(8, dtype=torch.uint8, device=u.device).reshape(1, 1, 8, 1)
            plane = bits.sum(dim=2, dtype=torch.uint8)                   # distinct bits: the sum is the or
            quants = torch.cat([nib.reshape(np_ // TILE, kb, 256), plane], dim=-1)
        if fmt == "q6k":    # the low nibbles as q4's, then pair planes: plane P, bits 2j: chunk 4P + j's
                            # high pair
            u = quants.reshape(np_ // TILE, kb, 8, 64)
            nib = (u[:, :, :4] & 0x0F) | ((u[:, :, 4:] & 0x0F) << 4)
            shift = (2 * torch.arange(4, dtype=torch.uint8, device=u.device)).reshape(1, 1, 1, 4, 1)
            pairs = ((u >> 4).reshape(np_ // TILE, kb, 2, 4, 64) << shift).sum(dim=3, dtype=torch.uint8)
            nt = np_ // TILE
            quants = torch.cat([nib.reshape(nt, kb, 256), pairs.reshape(nt, kb, 128)], dim=-1)
    tiles = [_tile_scales(_pad_rows(s.to(dtype), np_)) for s, dtype in zip(scales, dtypes)]
    side = None
    # [NT, KB / 8, 16 or 32]: each (tile, super-block)'s 16 d (and 16 dmin)
    if fmt in SUPER_SCALES and sb is not None:
        side = torch.cat([_tile_scales(_pad_rows(s.to(_F16), np_)).view(_F16) for s in sb], dim=-1)
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
    u = (_pad_rows(q, np_) + 128).to(torch.uint8).reshape(np_, k // QK, QK)
    return PackedWeight(fmt="i8", n=n, k=k, blocks=_tile_bytes(u), scale=_pad_rows(scale, np_).contiguous())


def concat(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights along N (a fused projection); every part but the last fills whole tiles.
    Consecutive parts of one format become one; parts of different formats stay each in its own
    (`rest`: a Q4_K_M file's Q4_K q and k and Q6_K v, each at the file's width), but for q5 parts
    before q8 ones: those become q8 tiles of U5 bytes (u5_tiles: the same bytes per block as q8's,
    with q5's cheaper products where the ISA has no unsigned-by-signed int8 product)."""
    fmts = {p.fmt for p in parts}
    if any(p.k != parts[0].k for p in parts) or any(p.n % TILE for p in parts[:-1]) or \
            (len(fmts) > 1 and "i8" in fmts) or any(p.u5_tiles or p.rest for p in parts):
        raise ValueError("cannot fuse these weights")
    order = [p.fmt for p in parts]
    if fmts == {"q5", "q8"} and order == sorted(order, key=lambda f: f == "q8"):
        cut = order.index("q8")
        u5, wide = concat(parts[:cut]), concat(parts[cut:])
        u = _tile_bytes((u5.values() + OFFSET["q5"]).to(torch.uint8))      # q8's layout, u = q + 16
        blocks = torch.cat([torch.cat([u, _tile_scales(u5.scales(0))], dim=-1), wide.blocks])
        return PackedWeight(fmt="q8", n=u5.n + wide.n, k=u5.k, u5_tiles=u5.blocks.shape[0], blocks=blocks)
    if len(fmts) > 1:                                # runs of one format, chained
        runs = [[parts[0]]]
        for p in parts[1:]:
            (runs[-1].append(p) if p.fmt == runs[-1][0].fmt else runs.append([p]))
        first, *rest = [concat(r) for r in runs]
        return replace(first, rest=tuple(rest))
    scales = [p.scale for p in parts if p.scale is not None]     # one format: every part has one, or none
    return PackedWeight(fmt=parts[0].fmt, n=sum(p.n for p in parts), k=parts[0].k,
                        blocks=torch.cat([p.blocks for p in parts]),
                        scale=torch.cat(scales) if scales else None)


def dequantize(w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as [N, K] in dtype, exactly the stored values (the reference path)."""
    if w.rest:
        return torch.cat([dequantize(p, dtype) for p in w.parts])
    q = w.values().float()                                                      # [Np, KB, 32]
    if w.fmt == "i8":
        assert w.scale is not None                                              # i8's row scales
        out = q * w.scale.reshape(-1, 1, 1)
    else:
        s = [t[..., None] for t in w.block_scales()]                            # each [Np, KB, 1]
        if w.fmt in ("q8", "q5"):
            out = q * s[0]
        elif w.fmt in NIBBLES:
            out = q * s[0] + s[1]
        else:                                                   # k8: a d per half, then m; k6: d sc per half
            halves = [s[0] * s[1], s[0] * s[2]] if w.fmt in ("k6", "q6k") else s[:2]
            out = q * torch.cat([halves[0].expand(-1, -1, 16), halves[1].expand(-1, -1, 16)], dim=-1) + s[-1]
    return out.reshape(w.n_padded, w.k)[: w.n].to(dtype)


def dequantize_rows(w: PackedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` [T] of the weight as [T, K] (the reference of the kernels' dequantize_rows): only
    the tiles holding them are dequantized."""
    if w.u5_tiles or w.rest:
        raise ValueError("dequantize_rows takes a table, not a fused projection")
    flat = ids.reshape(-1)
    tiles, lanes = torch.unique(flat // TILE, return_inverse=True)
    scale = None if w.scale is None else w.scale[tiles] if w.fmt in SUPER_SCALES else \
        w.scale.reshape(-1, TILE)[tiles].reshape(-1)
    part = PackedWeight(fmt=w.fmt, n=tiles.numel() * TILE, k=w.k, blocks=w.blocks[tiles], scale=scale)
    rows = dequantize(part, dtype)[lanes * TILE + flat % TILE]
    return rows.reshape(*ids.shape, w.k)


# formats whose activations share one scale per super-block of 256 (llama.cpp's Q8_K): their integer
# sub-block scales then sum in integers across the super-block (csrc/quant_tile.h)
SUPER_ACTIVATIONS = ("k4", "q6k")


def quantize_activations(x: torch.Tensor, group: int = QK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 → xq [M, K] int8, dx, sx [M, K/32]: symmetric int8 with one scale dx = max|x| / 127
    per group of `group` values (32, or 256 for SUPER_ACTIVATIONS), repeated for each block of 32 of
    the group, and sx = dx Σ xq over the block."""
    m, k = x.shape
    xg = x.float().reshape(m, k // group, group)
    amax = xg.abs().amax(dim=-1)
    # 127 / t, not 1/t * 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv[..., None]).clamp(-127, 127).reshape(m, k // QK, QK)
    dx = (amax / 127).repeat_interleave(group // QK, dim=1)
    return xq.to(torch.int8).reshape(m, k), dx, dx * xq.sum(-1)


def emulate(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in PyTorch: x quantized per block of 32 (per 256 for SUPER_ACTIVATIONS
    formats), times the exact weights; each part of a fused weight with its own activations."""
    outs = []
    for part in w.parts:
        xq, dx, _ = quantize_activations(x, 256 if part.fmt in SUPER_ACTIVATIONS else QK)
        xd = (xq.float().reshape(x.shape[0], -1, QK) * dx[..., None]).reshape(x.shape)
        outs.append(torch.nn.functional.linear(xd, dequantize(part)))
    y = torch.cat(outs, dim=-1)
    return y if bias is None else y + bias
