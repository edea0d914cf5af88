"""Rotary position embeddings (NeoX / HF layout: the head's two halves rotate together)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject


def inv_frequencies(head_dim: int, theta: float, scaling: JsonObject | None) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, with the model's RoPE scaling applied."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / _number(scaling, "factor")
    elif kind == "freq_factors":  # GGUF rope_freqs tensor
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind == "llama3":
        factor = _number(scaling, "factor")
        low, high = _number(scaling, "low_freq_factor", 1.0), _number(scaling, "high_freq_factor", 4.0)
        old_len = _number(scaling, "original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def _number(scaling: JsonObject, key: str, default: float | None = None) -> float:
    """rope_scaling[key] (or `default` where it has none), a number."""
    value = scaling[key] if default is None else scaling.get(key, default)
    if not isinstance(value, (int, float)):
        raise TypeError(f"rope_scaling's {key} is {value!r}, not a number")
    return value


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position up to max_positions."""

    cos: torch.Tensor                     # buffers [P, D/2] fp32
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: JsonObject | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)  # [P, D/2]
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)  # [P, D/2]
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute cos/sin in fp32 on the buffers' device (also after `to_empty`)."""
        if self.cos.is_meta:
            return
        inv_freq = inv_frequencies(self.head_dim, self.theta, self.scaling)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        self.cos = angles.cos().to(self.cos.device)
        self.sin = angles.sin().to(self.sin.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D] → rotated q, k."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
