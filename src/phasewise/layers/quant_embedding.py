"""QuantEmbedding: a token table kept in its packed blocks; a lookup dequantizes only its rows.

A vocabulary of 150k rows is 0.9 GB in fp32 at hidden 1536 and a fifth of that in the file's
blocks. The table is a `PackedWeight` (kernels/quant.py), the same tensor as the output head's
when the two are tied, and a lookup returns exactly the rows `quant.dequantize` would.
"""

from __future__ import annotations


import torch
from torch import nn

from phasewise.kernels import quant
from phasewise.kernels.quant import PackedWeight
from phasewise.kernels.kernel_api import Kernels


class QuantEmbedding(nn.Module):
    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        if weight.u5_tiles:
            raise ValueError("an embedding table is one weight, not a fused projection")
        self.fmt, self.num_embeddings, self.embedding_dim = weight.fmt, weight.n, weight.k
        self.fmt_id = quant.FORMAT_IDS[weight.fmt]
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("scale", weight.scale)
        self.kernels: Kernels | None = None

    def bind_kernels(self, kernels: Kernels | None) -> None:
        """Use the compiled kernels (None: the reference path); they run only on CPU buffers."""
        self.kernels = kernels

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(fmt=self.fmt, n=self.num_embeddings, k=self.embedding_dim, blocks=self.blocks,
                            scale=self.scale)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → [..., dim] fp32."""
        if self.kernels is not None and self.blocks.device.type == "cpu":
            return self.kernels.dequantize_rows(ids, self.fmt_id, self.num_embeddings, self.blocks, self.scale)
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id outside 0..{self.num_embeddings - 1}")
        return quant.dequantize_rows(self.packed, ids)
