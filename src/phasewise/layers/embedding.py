"""Embedding: the token table, dense or kept in its packed blocks (a lookup dequantizes only its rows).

A vocabulary of 150k rows is 0.9 GB in fp32 at hidden 1536 and a fifth of that in the file's
blocks. In the "blocks" form the table is a `PackedWeight` (kernels/quant.py), the same tensors
as the output head's when the two are tied, and a lookup returns exactly the rows
`quant.dequantize` would. Like `Linear`, the layer is filled in place (`fill_blocks`), never replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.kernels import UsesKernels, quant
from phasewise.kernels.quant import PackedWeight
from phasewise.layers.linear import frozen


class Embedding(UsesKernels, nn.Module):
    blocks: torch.Tensor                  # "blocks": buffers (quant.PackedWeight's)
    scale: torch.Tensor | None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # the checkpoint fills it: no random init (nn.Embedding's normal_ is slow, even on meta)
        self.weight: nn.Parameter | None = frozen(torch.empty(num_embeddings, embedding_dim))
        self.form, self.fmt_id = "dense", 0
        self.fmt: str | None = None

    def fill_blocks(self, weight: PackedWeight) -> None:
        """Hold the table in `weight`'s blocks (one part, this table's shape); the float table goes."""
        if weight.rest or weight.u5_tiles:
            raise ValueError("an embedding table is one weight, not a fused projection")
        if (weight.n, weight.k) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"a [{weight.n}, {weight.k}] table for a [{self.num_embeddings}, "
                             f"{self.embedding_dim}] embedding")
        self.weight = None
        self.form, self.fmt, self.fmt_id = "blocks", weight.fmt, weight.format.id
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("scale", weight.scale)

    @property
    def packed(self) -> PackedWeight | None:
        """The blocks as a PackedWeight (None when dense)."""
        if self.form != "blocks" or self.fmt is None:
            return None
        return PackedWeight(fmt=self.fmt, n=self.num_embeddings, k=self.embedding_dim, blocks=self.blocks,
                            scale=self.scale)

    def extra_repr(self) -> str:
        form = f"fmt={self.fmt}" if self.fmt else "form=dense"
        return f"{self.num_embeddings}, {self.embedding_dim}, {form}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] → [..., dim] (fp32 from blocks)."""
        if self.form == "dense":
            weight = self.weight
            assert weight is not None                          # "dense" holds it
            return F.embedding(ids, weight)
        if self.kernels is not None and self.blocks.device.type == "cpu":
            return self.kernels.dequantize_rows(ids, self.fmt_id, self.num_embeddings,
                                                self.blocks, self.scale)
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id outside 0..{self.num_embeddings - 1}")
        packed = self.packed
        assert packed is not None                              # "blocks"
        return quant.dequantize_rows(packed, ids)
