"""phasewise's own C++ CPU kernels, each beside a pure-PyTorch reference.

`build.load()` gives the `KernelSet` of the ISA level chosen for this CPU (isa.py), or None.
The engine loads it once and hands it to the model with `use_kernels`: every module that can
use kernels has a `set_kernels(kernels)` method (None: its PyTorch reference path), and this is
the only way kernels reach layers, the sampler included (through the runner).
"""

from __future__ import annotations


import torch

from phasewise.kernels.kernel_api import Kernels


def applies(kernels: Kernels | None, x: torch.Tensor) -> bool:
    """Whether the compiled ops can take x: loaded, on the CPU, fp32."""
    return kernels is not None and x.device.type == "cpu" and x.dtype == torch.float32


def use_kernels(model: torch.nn.Module, kernels: Kernels | None) -> int:
    """Give every module of `model` with a `set_kernels` method the kernels (None: the reference
    path); how many modules took them."""
    n = 0
    for module in model.modules():
        set_kernels = getattr(module, "set_kernels", None)
        if callable(set_kernels):
            set_kernels(kernels)
            n += 1
    return n


class UsesKernels:
    """A module whose forward calls the compiled ops in `self.ops` where they apply."""

    ops: Kernels | None = None

    def set_kernels(self, kernels: Kernels | None) -> None:
        self.ops = kernels
