"""phasewise's own C++ CPU kernels, each beside a pure-PyTorch reference.

`build.load()` gives the `KernelSet` of the ISA level chosen for this CPU (isa.py), or None.
The engine builder loads it once; the loader hands it to the model with one call,
`bind_kernels(model, kernels)`: every `UsesKernels` module in it gets them as `self.kernels`
(None: the PyTorch reference paths). The runner takes them in its constructor (sampler,
verification); the C++ decoder stack is built from a bound model by the builder, explicitly.
"""

from __future__ import annotations

from typing import TypeGuard

import torch

from phasewise.kernels.kernel_api import Kernels


def applies(kernels: Kernels | None, x: torch.Tensor) -> TypeGuard[Kernels]:
    """Whether the compiled ops can take x: loaded, on the CPU, fp32."""
    return kernels is not None and x.device.type == "cpu" and x.dtype == torch.float32


class UsesKernels:
    """A module whose forward calls the compiled ops in `self.kernels` where they apply. `bind_kernels`
    gives them; a module that prepares something from its weights for the ops extends it."""

    kernels: Kernels | None = None

    def bind_kernels(self, kernels: Kernels | None) -> None:
        self.kernels = kernels


def bind_kernels(model: torch.nn.Module, kernels: Kernels | None) -> None:
    """Every UsesKernels module of `model` (itself included) takes `kernels`, children before their
    parents (a parent may read what its children prepared)."""
    for module in reversed(list(model.modules())):
        if isinstance(module, UsesKernels):
            module.bind_kernels(kernels)
