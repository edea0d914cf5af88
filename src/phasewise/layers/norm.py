"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from phasewise.kernels import UsesKernels, applies


class RMSNorm(UsesKernels, nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D]. With a residual, adds it first and returns (normed, new residual)."""
        if applies(self.kernels, x) and x.dim() == 2:
            out = self.kernels.rms_norm(x.contiguous(), self.weight, self.eps, residual)
            return out[0] if residual is None else (out[0], out[1])
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
