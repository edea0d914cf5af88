"""The fused CPU ops (csrc/cpu_ops.cpp): paged attention, RoPE + KV write, RMSNorm, SiLU·mul.

`load()` gives the compiled module or None. Model layers hold it as `ops` (set by
`use_cpu_ops`) and call it only for fp32 CPU tensors; otherwise, and when ops is
None, they run their PyTorch reference code.
"""

from __future__ import annotations

from types import ModuleType

import torch

from phasewise.kernels.build import CPU_SOURCES
from phasewise.kernels.build import load as _load


def load() -> ModuleType | None:
    return _load("cpu", CPU_SOURCES)


def applies(ops: ModuleType | None, x: torch.Tensor) -> bool:
    """Whether the compiled op can take x: built, on the CPU, fp32."""
    return ops is not None and x.device.type == "cpu" and x.dtype == torch.float32


def use_cpu_ops(model: torch.nn.Module, ops: ModuleType | None) -> int:
    """Give every module with an `ops` slot the compiled ops (None: the reference path), and every
    module with a `stack` slot its C++ decoder stack where one can run; how many got ops."""
    from phasewise.kernels import decoder_stack

    n = 0
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
            n += 1
    for module in model.modules():
        if hasattr(module, "stack"):
            module.stack = decoder_stack.build(module, ops)
    return n
