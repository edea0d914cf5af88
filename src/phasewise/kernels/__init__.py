"""phasewise's own C++ CPU kernels, each beside a pure-PyTorch reference.

`build.load()` gives the `KernelSet` of the ISA level chosen for this CPU (isa.py), or None.
The engine builder loads it once; the loader hands it to the model with one call,
`model.bind_kernels(kernels)`, which each module passes on to the children it knows by name
(None: the PyTorch reference paths). The runner takes it in its constructor (sampler, verification).
"""

from __future__ import annotations

import torch

from phasewise.kernels.kernel_api import Kernels


def applies(kernels: Kernels | None, x: torch.Tensor) -> bool:
    """Whether the compiled ops can take x: loaded, on the CPU, fp32."""
    return kernels is not None and x.device.type == "cpu" and x.dtype == torch.float32


class UsesKernels:
    """A module whose forward calls the compiled ops in `self.ops` where they apply; the module that
    holds it binds them (a subclass with children of its own binds those too)."""

    ops: Kernels | None = None

    def bind_kernels(self, kernels: Kernels | None) -> None:
        self.ops = kernels
