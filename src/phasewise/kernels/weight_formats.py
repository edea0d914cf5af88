"""One record per packed weight format: what packing, the reference, the kernel API, the loader, the
packed-weight cache and the precision choice know of it. No code outside this file compares format
names; it reads a record (`FORMATS[name]`, `PackedWeight.format`).

Every format is blocks of 32 values along K in tiles of 16 rows; a (tile, block) is one run of bytes,
its quants then its per-block scales (kernels/quant.py, the C++ kernel's layout). The quants are a byte
per value (u = q + offset, in 64-byte chunks of 16 rows x 4 k), or, for `nibbles` formats, u's low 4
bits (chunk j < 4's byte holds its value low, chunk j + 4's high), then `bits - 4` planes of 64 bytes
of its higher bits (h bits each: plane P, bits h j..: chunk (8 / h) P + j's). Scales after the quants are
one 16-row vector each, of the record's dtypes; a super-block format also keeps fp16 vectors per
(tile, super-block of 8 blocks) in `PackedWeight.scale`, resolved with the block's own (`resolve`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

QK = 32                                   # values per block
TILE = 16                                 # output rows per tile (one vector lane each)
SUPER = 8                                 # blocks per super-block (GGUF's K-quants: 256 values)
K6_SC = 128                               # k6's largest |sc|: AVX2's int16 pair sums times sc stay in int32

# What a block's integers q and its resolved scales make (`quant.dequantize`): d, m per block;
# d_h per 16-wide half; sc_h an integer per half; s_n one scale per row (`PackedWeight.scale`)
Unpack = Literal["d q", "d q + m", "d_h q + m", "d sc_h q + m", "s_n q"]
Scales = list[torch.Tensor]
_F16, _F32, _I16, _U8, _I8 = torch.float16, torch.float32, torch.int16, torch.uint8, torch.int8


def _d_sc_dmin_m(sub: Scales, sup: Scales) -> Scales:
    """k4: sub-block sc, m and super-block d, dmin → d sc, -dmin m (exact in fp32)."""
    d, dmin = sup
    return [d * sub[0], -(dmin * sub[1])]


def _d_sc_halves(sub: Scales, sup: Scales) -> Scales:
    """q6k: each half's sc and the super-block's d → k6's d, sc of each half, m = 0."""
    d, = sup
    return [d, sub[0], sub[1], torch.zeros_like(d)]


@dataclass(frozen=True)
class WeightFormat:
    """One format's layout and arithmetic (the C++ side's `U5`, q5 values in q8 tiles, has no record:
    `widens_into` and PackedWeight.u5_tiles stand for it)."""
    name: str                             # PackedWeight.fmt, the packed-weight cache's header
    id: int                               # the kernels' format id (csrc/kernels.h QuantFormat)
    unpacks_to: Unpack                    # what its values and resolved scales make
    scales: tuple[torch.dtype, ...]       # per-block scales after the quants, in pack's order
    bits: int                             # q in -offset..2^bits - 1 - offset
    offset: int                           # stored as u = q + offset
    nibbles: bool = False                 # u as low nibbles and planes of higher bits (else a byte each)
    super_scales: int = 0                 # fp16 vectors per (tile, super-block) in PackedWeight.scale
    resolve: Callable[[Scales, Scales], Scales] | None = None   # block and super-block scales → per block
    sc_range: tuple[int, int] | None = None   # what its integer-typed scales may hold (pack checks)
    activation_group: int = QK            # activations share one int8 scale per this many values
    row_scale: bool = False               # one fp32 scale per row in PackedWeight.scale (quantize_i8)
    widens_into: str | None = None        # fused before parts of that format: its tiles of u bytes
    gguf_types: tuple[str, ...] = ()      # GGUF block types packed into it as they are (gguf_blocks.py)

    @property
    def quant_bytes(self) -> int:
        """Bytes of quants per (tile, block)."""
        return 256 + 64 * (self.bits - 4) if self.nibbles else 512

    @property
    def block_bytes(self) -> int:
        """Bytes per (tile, block): the quants, then the scales."""
        return self.quant_bytes + TILE * sum(dt.itemsize for dt in self.scales)

    @property
    def q_range(self) -> tuple[int, int]:
        """The integers q a block holds, lowest and highest."""
        return -self.offset, (1 << self.bits) - 1 - self.offset

    def bits_per_weight(self) -> float:
        """What a packed weight streams per weight: its blocks and per-block scales (super-block
        scales spread over their blocks; a row scale left out)."""
        return (self.block_bytes + 2 * TILE * self.super_scales / SUPER) * 8 / (TILE * QK)


FORMATS = {f.name: f for f in (
    # GGUF Q4_1 (w = d q + m) and Q4_0 (m = -8 d): the file's bytes and fp16 scales as they are
    WeightFormat(name="q4", id=0, unpacks_to="d q + m", scales=(_F16, _F16), bits=4, offset=0,
                 nibbles=True, gguf_types=("Q4_0", "Q4_1")),
    # GGUF Q8_0 (w = d q)
    WeightFormat(name="q8", id=1, unpacks_to="d q", scales=(_F16,), bits=8, offset=128,
                 gguf_types=("Q8_0",)),
    # our own int8 per output channel (w = s_n q, q in -127..127), from float weights
    WeightFormat(name="i8", id=2, unpacks_to="s_n q", scales=(), bits=8, offset=128, row_scale=True),
    # GGUF Q4_K at the file's width (4.625 bits a weight against its 4.5): 6-bit sc and m as bytes,
    # the super-block's d, then dmin (w = d sc q - dmin m)
    WeightFormat(name="k4", id=3, unpacks_to="d q + m", scales=(_U8, _U8), bits=4, offset=0,
                 nibbles=True, super_scales=2, resolve=_d_sc_dmin_m, sc_range=(0, 63),
                 activation_group=SUPER * QK, gguf_types=("Q4_K",)),
    # any mix of bytes: an fp32 d per half and m (no load path makes it; the tests pack it)
    WeightFormat(name="k8", id=4, unpacks_to="d_h q + m", scales=(_F32, _F32, _F32), bits=8,
                 offset=128),
    # GGUF Q5_0 (w = d q) in 5.5 bits a weight; before q8 parts, q8 tiles of U5 bytes (u5_tiles)
    WeightFormat(name="q5", id=5, unpacks_to="d q", scales=(_F16,), bits=5, offset=16, nibbles=True,
                 widens_into="q8", gguf_types=("Q5_0",)),
    # w = d sc_h q + m: fp32 d and m, an integer sc per half; GGUF Q5_K (sc = 1, d = d_K sc_K)
    WeightFormat(name="k6", id=6, unpacks_to="d sc_h q + m", scales=(_F32, _I16, _I16, _F32), bits=6,
                 offset=32, sc_range=(-K6_SC, K6_SC), gguf_types=("Q5_K",)),
    # GGUF Q6_K at the file's width (6.5625 bits): int8 sc per half, the super-block's d; the
    # kernels unpack it to k6 tiles in L1/L2
    WeightFormat(name="q6k", id=8, unpacks_to="d sc_h q + m", scales=(_I8, _I8), bits=6, offset=32,
                 nibbles=True, super_scales=1, resolve=_d_sc_halves, sc_range=(-128, 127),
                 activation_group=SUPER * QK, gguf_types=("Q6_K",)),
)}
INT8 = FORMATS["i8"]                      # what a float weight is quantized to (quant.quantize_i8)
# GGUF block type → the format its blocks run in
BY_GGUF_TYPE = {t: f for f in FORMATS.values() for t in f.gguf_types}


def fused_formats(formats: list[WeightFormat]) -> list[WeightFormat]:
    """The format each part of a fused projection runs in (`quant.concat`): a row-scale format's
    throughout when any part has it (the layer is quantized whole), a widening format's run before
    its target's as that target, each its own otherwise."""
    rows = next((f for f in formats if f.row_scale), None)
    if rows is not None:
        return [rows] * len(formats)
    into = widened(formats)
    return [into] * len(formats) if into is not None else formats


def widened(formats: list[WeightFormat]) -> WeightFormat | None:
    """The format a fused run of one widening format, then its `widens_into` format, becomes."""
    first = formats[0]
    if first.widens_into is None or {f.name for f in formats} != {first.name, first.widens_into}:
        return None
    cut = next(i for i, f in enumerate(formats) if f.name != first.name)
    return FORMATS[first.widens_into] if all(f.name != first.name for f in formats[cut:]) else None
