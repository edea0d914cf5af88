"""Kernel choice for the linear layers, made once after loading; the model code keeps plain nn.Linear.

On x86 CPUs, torch's default fp32 GEMM (MKL) is slow for the few-row products
of decode (about 10 GB/s of weights at one row on this project's machine);
oneDNN with weights packed ahead of time for its own kernels reads them about
1.4x faster and is no slower for prefill. `F.linear` stays the reference path,
used on other devices and wherever the oneDNN ops are missing (bf16 only where
oneDNN has bf16 kernels for the CPU). Quantized layers (`QuantLinear`, --dtype
int8 / q4) run the engine's compiled kernels; without them (another device,
kernels off) their weights are dequantized once here, not on every call.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from phasewise.kernels.kernel_api import Kernels
from phasewise.layers.quant_embedding import QuantEmbedding
from phasewise.layers.quant_linear import QuantLinear


def bind_weights(layer: nn.Module, kernels: Kernels | None) -> None:
    """A linear layer or token table takes the kernels in its packed form (QuantLinear,
    QuantEmbedding); as nn.Linear, OneDNNLinear or nn.Embedding it runs torch's own."""
    if isinstance(layer, (QuantLinear, QuantEmbedding)):
        layer.bind_kernels(kernels)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False          # oneDNN's bf16 weight reorder needs AVX-512 (or AMX, or ARM's bf16)
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class OneDNNLinear(nn.Module):
    """y = x W^T + b with W packed once into oneDNN's blocked layout (an opaque tensor)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] → [T, out]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def use_fast_linears(model: nn.Module, device: torch.device | str, dtype: torch.dtype, kernels: Kernels | None = None,
                     onednn: bool = True) -> int:
    """Choose every linear layer's kernel: quantized layers keep their blocks where `kernels` can
    run them (the CPU) and are dequantized once into `dtype` otherwise; plain layers go to oneDNN
    where it is available (and `onednn`). Returns how many layers were given a fast kernel."""
    device = torch.device(device)
    parents = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    quantized = [(p, n, c) for p, n, c in parents if isinstance(c, QuantLinear)]
    if quantized and (kernels is None or device.type != "cpu"):
        warnings.warn(f"phasewise: no compiled kernels for the {quantized[0][2].fmt} weights here; they are "
                      f"dequantized to {str(dtype).removeprefix('torch.')} once at load (float speed and memory)",
                      stacklevel=2)
        for parent, name, layer in quantized:
            setattr(parent, name, layer.dequantized(dtype))
        quantized = []
    if not onednn or not onednn_available(device, dtype):
        if onednn and device.type == "cpu" and dtype == torch.bfloat16:
            warnings.warn("phasewise: this CPU has no bf16 kernels in oneDNN; bf16 runs PyTorch's generic "
                          "linears (slow): --dtype fp32 or the default is faster here", stacklevel=2)
        return len(quantized)
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, OneDNNLinear(child))
    return len(targets) + len(quantized)
