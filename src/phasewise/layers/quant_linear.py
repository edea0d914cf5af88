"""QuantLinear: a linear layer whose weight stays quantized (int8 per channel, GGUF Q4/Q8 blocks).

`forward` runs the compiled kernel (kernels/csrc/quant_linear.cpp, on every ISA level) when
kernels are set and the input is fp32 on the CPU; it quantizes activations per block of 32
values. Otherwise the reference path runs anywhere: dequantize the exact stored weight, then
`F.linear` on the unquantized activations.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from phasewise.kernels import quant
from phasewise.kernels.quant import PackedWeight
from phasewise.kernels.kernel_api import Kernels, WeightPart


class QuantLinear(nn.Module):
    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = weight.fmt, weight.k, weight.rows
        self.fmt_id, self.u5_tiles, self.part_rows = quant.FORMAT_IDS[weight.fmt], weight.u5_tiles, weight.n
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("scale", weight.scale)
        self.rest = [(p.fmt, p.n) for p in weight.rest]       # a fused weight's further parts: blocks1, scale1, ...
        for i, p in enumerate(weight.rest, 1):
            self.register_buffer(f"blocks{i}", p.blocks)
            self.register_buffer(f"scale{i}", p.scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.kernels: Kernels | None = None  # the compiled kernels (bind_kernels)
        self._args: tuple | None = None      # the kernel's arguments, gathered once (attribute lookups cost µs)

    def bind_kernels(self, kernels: Kernels | None) -> None:
        """Use the compiled kernels (None: the reference path); they run only on CPU buffers."""
        self.kernels = kernels
        on_cpu = self.blocks.device.type == "cpu"
        self._args = None if kernels is None or not on_cpu else \
            (self.fmt_id, self.out_features, self.blocks, self.scale, self.bias, self.u5_tiles, self.rest_args())

    def rest_args(self) -> list[WeightPart]:
        """The kernels' (format id, rows, blocks, scale) of each further part."""
        return [(quant.FORMAT_IDS[fmt], n, getattr(self, f"blocks{i}"), getattr(self, f"scale{i}"))
                for i, (fmt, n) in enumerate(self.rest, 1)]

    def _apply(self, fn, recurse=True):
        self._args = None                     # buffers may move: gather the arguments again
        out = super()._apply(fn, recurse)
        self.bind_kernels(self.kernels)
        return out

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight: PackedWeight | None = None) -> QuantLinear:
        """Quantize an nn.Linear to int8 per channel, or wrap a given packed weight (its bias kept)."""
        return cls(weight or quant.quantize_i8(linear.weight.detach()), linear.bias)

    @property
    def packed(self) -> PackedWeight:
        rest = tuple(PackedWeight(fmt=fmt, n=n, k=self.in_features, blocks=getattr(self, f"blocks{i}"),
                                  scale=getattr(self, f"scale{i}")) for i, (fmt, n) in enumerate(self.rest, 1))
        return PackedWeight(fmt=self.fmt, n=self.part_rows, k=self.in_features, blocks=self.blocks,
                            scale=self.scale, u5_tiles=self.u5_tiles, rest=rest)

    def extra_repr(self) -> str:
        u5 = f" ({self.u5_tiles} tiles of q5 values)" if self.u5_tiles else ""
        fmt = "+".join([self.fmt, *(f for f, _ in self.rest)])
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={fmt}{u5}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] → [..., out]."""
        args = self._args
        if args is None or x.dtype is not torch.float32 or x.device.type != "cpu":
            return self.reference(x)
        if x.dim() == 2:
            return self.kernels.quant_linear(x, *args)
        return self.kernels.quant_linear(x.reshape(-1, self.in_features), *args).reshape(*x.shape[:-1], -1)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """A plain linear layer holding the exact stored weight in dtype (for devices without kernels)."""
        w = quant.dequantize(self.packed, dtype)
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=w.device,
                          dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
            if self.bias is not None:
                layer.bias.copy_(self.bias.to(dtype))
        return layer

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize the stored weight (exact) and multiply in x's dtype."""
        w = quant.dequantize(self.packed, x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
