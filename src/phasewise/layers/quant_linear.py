"""QuantLinear: a linear layer whose weight stays quantized (int8 per channel, GGUF Q4/Q8 blocks).

`forward` runs the C++ AVX-512 VNNI kernel (kernels/csrc/quant_linear.cpp) when `ext` is set
and the input is fp32 on the CPU; it quantizes activations per block of 32 values. Otherwise
the reference path runs anywhere: dequantize the exact stored weight, then `F.linear` on the
unquantized activations.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.kernels import quant
from phasewise.kernels.quant import PackedWeight


class QuantLinear(nn.Module):
    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = weight.fmt, weight.k, weight.n
        self.fmt_id = quant.FORMAT_IDS[weight.fmt]
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.ext: ModuleType | None = None   # the compiled kernels (set_kernels)
        self._args: tuple | None = None      # the kernel's arguments, gathered once (attribute lookups cost µs)

    def set_kernels(self, ext: ModuleType | None) -> QuantLinear:
        """Use the compiled kernels (None: the reference path). Set on the CPU, after any device move."""
        self.ext = ext
        self._args = None if ext is None else (self.fmt_id, self.out_features, self.blocks, self.scale, self.bias)
        return self

    def _apply(self, fn, recurse=True):
        self._args = None                     # buffers may move: gather the arguments again
        out = super()._apply(fn, recurse)
        if self.ext is not None and self.blocks.device.type == "cpu":
            self.set_kernels(self.ext)
        return out

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight: PackedWeight | None = None) -> QuantLinear:
        """Quantize an nn.Linear to int8 per channel, or wrap a given packed weight (its bias kept)."""
        return cls(weight or quant.quantize_i8(linear.weight.detach()), linear.bias)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.fmt, self.out_features, self.in_features, self.blocks, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] → [..., out]."""
        args = self._args
        if args is None or x.dtype is not torch.float32 or x.device.type != "cpu":
            return self.reference(x)
        if x.dim() == 2:
            return self.ext.quant_linear(x, *args)
        return self.ext.quant_linear(x.reshape(-1, self.in_features), *args).reshape(*x.shape[:-1], -1)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize the stored weight (exact) and multiply in x's dtype."""
        w = quant.dequantize(self.packed, x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
