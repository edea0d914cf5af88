"""ExpertLinear: E linear maps of [rows, in] stacked along the output, expert e's rows e rows .. (e + 1) rows.

One weight holds every expert's, in any form a `Linear` takes but oneDNN's (an expert's rows are cut
from it): float ("dense"), or blocks (a GGUF's 3-D expert tensor packed as one [E rows, in] weight,
or int8 per channel). In blocks, with `rows` a multiple of 16, each expert is its own run of whole
tiles, which is how the expert kernel (kernels/csrc/expert_mlp.cpp) reads one expert and not the rest.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from phasewise.kernels import quant
from phasewise.kernels.kernel_api import WeightPart
from phasewise.layers.linear import Linear


class ExpertLinear(Linear):
    def __init__(self, experts: int, in_features: int, rows: int) -> None:
        super().__init__(in_features, experts * rows, bias=False)
        self.rows = rows                                  # each expert's

    def expert_weight(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [rows, in] in `dtype` (blocks: the exact stored values)."""
        if self.form == "dense":
            return self.dense_weight()[e * self.rows:(e + 1) * self.rows].to(dtype)
        if self.form != "blocks":
            raise RuntimeError(f"an expert weight in form {self.form!r}")
        packed = self.packed_weight()
        if self.rest or self.rows % quant.TILE:                 # tiles shared between experts: all, then cut
            return quant.dequantize(packed, dtype)[e * self.rows:(e + 1) * self.rows]
        nt = self.rows // quant.TILE
        tiles = slice(e * nt, (e + 1) * nt)
        scale = packed.scale
        if scale is not None:
            scale = scale[tiles] if scale.dim() == 3 else scale[e * self.rows:(e + 1) * self.rows]
        return quant.dequantize(replace(packed, n=self.rows, blocks=packed.blocks[tiles], scale=scale), dtype)

    def kernel_part(self) -> WeightPart | None:
        """(format id, rows of all experts, blocks, scale) for the expert kernel, or None when it cannot
        read this weight: not blocks on the CPU with kernels bound, a fused mix of formats, or experts
        that do not each fill whole tiles."""
        if self._args is None or self.rest or self.u5_tiles or self.rows % quant.TILE:
            return None
        return self.fmt_id, self.out_features, self.blocks, self.scale

    def pack_for_onednn(self) -> None:
        raise RuntimeError("expert weights stay in their own form: an expert's rows are cut from them")
