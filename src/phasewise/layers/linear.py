"""Linear: the model code's one linear layer, y = x Wᵀ + b, whose weight takes one form, set when it is
filled.

- "dense": `weight` [out, in] in a float dtype, run by `F.linear`: as built, and as a float
  checkpoint loads it.
- "onednn": W packed once into oneDNN's blocked layout (`pack_for_onednn`). On x86 CPUs torch's
  default fp32 GEMM (MKL) is slow for the few-row products of decode (about 10 GB/s of weights at
  one row on this project's machine); oneDNN's own kernels read them about 1.4x faster and are no
  slower for prefill (bf16 only where oneDNN has bf16 kernels for the CPU).
- "blocks": a `PackedWeight` (kernels/quant.py: int8 per channel, or the GGUF file's own blocks,
  a fused projection's parts each in its format), run by the compiled kernel
  (kernels/csrc/quant_linear.cpp, activations quantized per block of 32) on fp32 CPU inputs once
  kernels are bound; elsewhere the reference path: dequantize the exact stored weight, `F.linear`.

The layer is the same object from construction on: the loader fills it (`fill_blocks`, `quantize`,
`dequantize`, `pack_for_onednn`) and binds the kernels (`bind_kernels`); nothing replaces it in
its parent. Weights and bias never take gradients (an inference engine).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.kernels import UsesKernels, quant
from phasewise.kernels.kernel_api import Kernels, PackedLinearArgs, WeightPart
from phasewise.kernels.quant import PackedWeight


def frozen(t: torch.Tensor) -> nn.Parameter:
    """A weight that takes no gradients."""
    return nn.Parameter(t, requires_grad=False)


class Linear(UsesKernels, nn.Module):
    blocks: torch.Tensor                  # "blocks": buffers [NT, KB, block bytes] uint8 and its scales,
    scale: torch.Tensor | None            # then a fused weight's further parts' (blocks1, scale1, ...)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # the loader fills it
        self.weight: nn.Parameter | None = frozen(torch.empty(out_features, in_features))
        self.bias: nn.Parameter | None = frozen(torch.empty(out_features)) if bias else None
        self.form = "dense"
        self.onednn_weight: torch.Tensor | None = None    # "onednn": an opaque oneDNN tensor (not a buffer)
        self.fmt: str | None = None                       # "blocks": the (first part's) block format
        self.fmt_id = self.part_rows = self.u5_tiles = 0
        # a fused weight's further parts: blocks1, scale1, ...
        self.rest: list[tuple[str, int]] = []
        # the kernel's arguments, gathered once (lookups cost µs)
        self._args: PackedLinearArgs | None = None

    @classmethod
    def from_blocks(cls, weight: PackedWeight, bias: torch.Tensor | None = None) -> Linear:
        """A layer holding `weight` in its blocks (benchmarks and tests build them so)."""
        layer = cls(weight.k, weight.rows, bias=bias is not None)
        if bias is not None:
            layer.bias = frozen(bias.detach().clone())
        layer.fill_blocks(weight)
        return layer

    # ---- filling: the weight's form ----------------------------------------------------------------

    def fill_blocks(self, weight: PackedWeight) -> None:
        """Hold `weight` (this layer's rows x k) in its blocks; the float weight goes, the bias stays
        (fp32)."""
        if (weight.rows, weight.k) != (self.out_features, self.in_features):
            raise ValueError(f"a [{weight.rows}, {weight.k}] weight for a [{self.out_features}, "
                             f"{self.in_features}] layer")
        self._drop_weight()
        self.form, self.fmt, self.fmt_id = "blocks", weight.fmt, weight.format.id
        self.part_rows, self.u5_tiles = weight.n, weight.u5_tiles
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("scale", weight.scale)
        self.rest = [(p.fmt, p.n) for p in weight.rest]
        for i, p in enumerate(weight.rest, 1):
            self.register_buffer(f"blocks{i}", p.blocks)
            self.register_buffer(f"scale{i}", p.scale)
        if self.bias is not None:
            self.bias = frozen(self.bias.detach().float())
        self.bind_kernels(self.kernels)

    def quantize(self) -> None:
        """The dense weight to int8 per output channel (its width a multiple of 32)."""
        self.fill_blocks(quant.quantize_i8(self.dense_weight().detach()))

    def dequantize(self, dtype: torch.dtype) -> None:
        """Blocks to a dense weight in `dtype` holding the exact stored values (where no kernels run them)."""
        w = quant.dequantize(self.packed_weight(), dtype)
        self._drop_weight()
        self.form, self.fmt, self.rest = "dense", None, []
        self.weight = frozen(w)
        if self.bias is not None:
            self.bias = frozen(self.bias.detach().to(dtype))

    def pack_for_onednn(self) -> None:
        """The dense weight packed once for oneDNN's kernels (check `onednn_available` first)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(self.dense_weight().detach(), 1)
        self._drop_weight()
        self.form, self.onednn_weight = "onednn", packed

    def _wrong_form(self, form: str) -> RuntimeError:
        return RuntimeError(f"a linear layer in form {self.form!r}, not {form!r}")

    def dense_weight(self) -> nn.Parameter:
        """The float weight [out, in] (form "dense")."""
        if self.form != "dense" or self.weight is None:
            raise self._wrong_form("dense")
        return self.weight

    def _drop_weight(self) -> None:
        """Let go of the weight in its present form."""
        self.weight, self.onednn_weight, self._args = None, None, None
        for i in range(len(self.rest) + 1):
            for name in ("blocks", "scale"):
                self._buffers.pop(f"{name}{i or ''}", None)

    # ---- kernels -----------------------------------------------------------------------------------

    def bind_kernels(self, kernels: Kernels | None) -> None:
        """Use the compiled kernels for blocks (None: the reference path); they run only on CPU buffers."""
        self.kernels = kernels
        runs = kernels is not None and self.form == "blocks" and self.blocks.device.type == "cpu"
        self._args = self.packed_args() if runs else None

    def packed_args(self) -> PackedLinearArgs:
        """The kernels' description of the blocks: (format id, rows, blocks, scale, bias, u5 tiles, further
        parts)."""
        rest: list[WeightPart] = [(quant.FORMATS[fmt].id, n, getattr(self, f"blocks{i}"),
                                   getattr(self, f"scale{i}"))
                                  for i, (fmt, n) in enumerate(self.rest, 1)]
        bias = None if self.bias is None else self.bias.detach()
        return self.fmt_id, self.out_features, self.blocks, self.scale, bias, self.u5_tiles, rest

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        self._args = None                     # buffers may move: gather the arguments again
        out = super()._apply(fn, recurse)
        self.bind_kernels(self.kernels)
        return out

    @property
    def packed(self) -> PackedWeight | None:
        """The blocks as a PackedWeight (None in the float forms)."""
        return self.packed_weight() if self.form == "blocks" else None

    def packed_weight(self) -> PackedWeight:
        """The blocks as a PackedWeight (form "blocks")."""
        if self.form != "blocks" or self.fmt is None:
            raise self._wrong_form("blocks")
        rest = tuple(PackedWeight(fmt=fmt, n=n, k=self.in_features, blocks=getattr(self, f"blocks{i}"),
                                  scale=getattr(self, f"scale{i}"))
                     for i, (fmt, n) in enumerate(self.rest, 1))
        return PackedWeight(fmt=self.fmt, n=self.part_rows, k=self.in_features, blocks=self.blocks,
                            scale=self.scale, u5_tiles=self.u5_tiles, rest=rest)

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}, " \
            f"bias={self.bias is not None}"
        if self.form != "blocks" or self.fmt is None:
            return f"{text}, form={self.form}"
        u5 = f" ({self.u5_tiles} tiles of q5 values)" if self.u5_tiles else ""
        return f"{text}, fmt={'+'.join([self.fmt, *(f for f, _ in self.rest)])}{u5}"

    # ---- running -----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] → [..., out]."""
        if self.form == "dense":
            weight = self.weight
            assert weight is not None                              # "dense" holds it
            return F.linear(x, weight, self.bias)
        if self.form == "onednn":                                  # x: [T, in]
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
        args, kernels = self._args, self.kernels               # args: kernels bound (bind_kernels)
        if args is None or kernels is None or x.dtype is not torch.float32 or x.device.type != "cpu":
            return self.reference(x)
        if x.dim() == 2:
            return kernels.quant_linear(x, *args)
        return kernels.quant_linear(x.reshape(-1, self.in_features), *args).reshape(*x.shape[:-1], -1)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Blocks: dequantize the stored weight (exact) and multiply in x's dtype."""
        w = quant.dequantize(self.packed_weight(), x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can run `dtype` linears on `device` (the CPU)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False          # oneDNN's bf16 weight reorder needs AVX-512 (or AMX, or ARM's bf16)
    ops = torch.ops.mkldnn
    return hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")
