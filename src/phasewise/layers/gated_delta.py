"""The Gated DeltaNet token mixer's recurrent parts, one sequence at a time, in PyTorch: the causal
depthwise convolution over q, k and v, and the gated delta rule (Yang et al., 2024).

Both run token by token from the sequence's state and leave the state after its last token in
place. The delta rule's recurrent form is the only form used, for prompt chunks as for decode
steps: a token's output then depends on nothing but the state before it and its own inputs, so a
row's bits are the same whatever chunk it is computed in (the chunked WY form regroups its sums
by chunk), and its 4·dk·dv multiply-adds a head and token are few beside the layer's weights'
(by arithmetic: ~1% of a Qwen3.5-9B DeltaNet layer with its MLP, ~5% of a 0.8B one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Conv1d(nn.Module):
    """A depthwise causal convolution's taps, [C, 1, K] as the checkpoint stores them."""

    def __init__(self, channels: int, taps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps), requires_grad=False)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """x [n, C] new inputs, state [K - 1, C] the inputs before them (updated in place), weight [C, K]
    → silu(depthwise causal convolution) [n, C] in fp32 (without the silu: LFM2's short conv)."""
    n, taps = x.shape[0], weight.shape[1]
    window = torch.cat([state, x.float()])                      # [K - 1 + n, C]
    out = window[0:n] * weight[:, 0]
    for j in range(1, taps):
        out = out + window[j:j + n] * weight[:, j]
    state.copy_(window[n:])
    return F.silu(out) if silu else out


def sequence_parts(row: int, n: int, snapshots: list[int]) -> list[tuple[int, int, int | None]]:
    """A sequence's n rows from `row` as a recurrent layer computes them: (start, rows, snapshot slot).
    All at once, or, when its states are snapshotted (a verify step's draft rows), one row at a time,
    the state after each row but the last copied into that row's snapshot slot. The recurrent forms
    give a row the same bits however its sequence's rows are grouped."""
    if not snapshots:
        return [(row, n, None)]
    return [(row + i, 1, snapshots[i] if i < len(snapshots) else None) for i in range(n)]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dimension (as the FLA kernels and transformers)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """One sequence's n tokens: q, k [n, Hk, dk] (already L2-normed, q scaled), v [n, Hv, dv], the log
    decay g and the write strength beta [n, Hv], state [Hv, dk, dv] (updated in place) → [n, Hv, dv].

    Per token and v head: S = S * exp(g); S += k ⊗ beta (v - Sᵀk); out = Sᵀq. Each q/k head serves
    Hv / Hk consecutive v heads, or (`tiled`) every Hk-th one."""
    rep = v.shape[1] // k.shape[1]
    if rep > 1 and tiled:
        q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)
    elif rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    out = torch.empty_like(v)
    decay = g.exp()
    for t in range(v.shape[0]):
        state.mul_(decay[t][:, None, None])
        kv_mem = (state * k[t][:, :, None]).sum(1)                  # [Hv, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = (state * q[t][:, :, None]).sum(1)
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output x [..., dv] (weight [dv]), times silu(gate [..., dv])."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)) * F.silu(gate.float())
