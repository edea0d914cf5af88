"""Kernel choice for the linear layers, made once after loading; the model code keeps plain nn.Linear.

On x86 CPUs, torch's default fp32 GEMM (MKL) is slow for the few-row products
of decode (about 10 GB/s of weights at one row on this project's machine);
oneDNN with weights packed ahead of time for its own kernels reads them about
1.4x faster and is no slower for prefill. `F.linear` stays the reference path,
used on other devices and wherever the oneDNN ops are missing. Quantized layers
(`QuantLinear`, --dtype int8 / q4) get the C++ VNNI kernels here, on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from phasewise.kernels import quant
from phasewise.layers.quant_linear import QuantLinear


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
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


def use_fast_linears(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> int:
    """Swap every nn.Linear for the best kernel on this device, and give quantized layers the compiled
    kernels (CPU); returns how many layers were given a kernel."""
    device = torch.device(device)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    ext = quant.load() if quantized and device.type == "cpu" else None
    for m in quantized:
        m.set_kernels(ext)
    if not onednn_available(device, dtype):
        return len(quantized) if ext else 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, OneDNNLinear(child))
    return len(targets) + (len(quantized) if ext else 0)

