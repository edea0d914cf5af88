"""The Gated DeltaNet token mixer's recurrent parts in PyTorch, the reference of the kernels' `delta_net_mix`
(csrc/gated_delta.cpp): the causal depthwise convolution over q, k and v, and the gated delta rule (Yang
et al., 2024), one sequence at a time, and `delta_net_mix`, a whole step's sequences through both.

Both run token by token from the sequence's state and leave the state after its last token in
place. The delta rule's recurrent form is the only form used, for prompt chunks as for decode
steps: a token's output then depends on nothing but the state before it and its own inputs, so a
row's bits are the same whatever chunk it is computed in (the chunked WY form regroups its sums
by chunk), and its 4·dk·dv multiply-adds a head and token are few beside the layer's weights'
(by arithmetic: ~1% of a Qwen3.5-9B DeltaNet layer with its MLP, ~5% of a 0.8B one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.layers.attention import AttentionMetadata


class Conv1d(nn.Module):
    """A depthwise causal convolution's taps, [C, 1, K] as the checkpoint stores them."""

    def __init__(self, channels: int, taps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps), requires_grad=False)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                silu: bool = True) -> torch.Tensor:
    """x [n, C] new inputs, state [K - 1, C] the inputs before them (updated in place), weight [C, K]
    → silu(depthwise causal convolution) [n, C] in fp32 (without the silu: LFM2's short conv)."""
    n, taps = x.shape[0], weight.shape[1]
    window = torch.cat([state, x.float()])                      # [K - 1 + n, C]
    out = window[0:n] * weight[:, 0]
    for j in range(1, taps):
        out = out + window[j:j + n] * weight[:, j]
    state.copy_(window[n:])
    return F.silu(out) if silu else out


def each_sequence(meta: AttentionMetadata, states: Sequence[torch.Tensor],
                  step: Callable[[int, int, int, int], None]) -> None:
    """A recurrent layer over a step's sequences: `step(start, rows, context after them, slot)` for each
    sequence's rows at once or, where its states are snapshotted (a verify step's draft rows), one row at
    a time, every state tensor's slot copied after each row but the last into that row's snapshot slot.
    The recurrent forms give a row the same bits however its sequence's rows are grouped; a call whose
    context equals its rows starts its sequence (no state before it)."""
    assert meta.state_slots is not None and len(meta.state_slots) == len(meta.query_lens)
    row = 0
    for i, (n, ctx, slot) in enumerate(zip(meta.query_lens, meta.context_lens, meta.state_slots)):
        snapshots = meta.state_snapshots[i] if meta.state_snapshots else []
        parts = [(row + j, 1, snapshots[j] if j < len(snapshots) else None) for j in range(n)] if snapshots \
            else [(row, n, None)]
        for start, m, snapshot in parts:
            step(start, m, ctx - n + start - row + m, slot)
            for t in states if snapshot is not None else ():
                t[snapshot] = t[slot]
        row += n


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


def delta_net_mix(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_w: torch.Tensor,
                  neg_A: torch.Tensor, dt_bias: torch.Tensor, conv_states: torch.Tensor, states: torch.Tensor,
                  query_lens: Sequence[int], context_lens: Sequence[int], slots: Sequence[int],
                  z: torch.Tensor | None = None, norm_w: torch.Tensor | None = None, eps: float = 1e-6,
                  tiled: bool = False) -> torch.Tensor:
    """A step's sequences (query_lens[i] rows each, in order; context_lens[i] == query_lens[i]: it starts
    here, its slot zeroed first) through the conv and the delta rule from their state slots (conv_states
    [S, K - 1, C], states [S, Hv, dk, dv], advanced in place): qkv [T, C], a, b [T, Hv], conv_w [C, K],
    neg_A = -exp(A_log) and dt_bias [Hv] → [T, Hv, dv] fp32, with norm_w [dv] the gated RMSNorm times
    silu(z [T, Hv dv]); `tiled`: v head h reads q/k head h mod Hk (GatedDeltaNetShape.tiled_v_heads). As the
    kernel of that name takes them."""
    T, (Hv, dk, dv) = qkv.shape[0], states.shape[1:]
    Hk = (conv_states.shape[2] - Hv * dv) // (2 * dk)
    g = neg_A * F.softplus(a.float() + dt_bias)                        # [T, Hv] log decay
    beta = b.float().sigmoid()
    out = torch.empty(T, Hv, dv, device=qkv.device)
    row = 0
    for n, ctx, slot in zip(query_lens, context_lens, slots):
        if ctx == n:                                   # the sequence starts here: no state before it
            conv_states[slot].zero_()
            states[slot].zero_()
        mixed = causal_conv(qkv[row:row + n], conv_states[slot], conv_w)            # [n, C]
        q, k, v = mixed.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q = l2norm(q.reshape(n, Hk, dk)) / dk ** 0.5
        k = l2norm(k.reshape(n, Hk, dk))
        out[row:row + n] = gated_delta_rule(q, k, v.reshape(n, Hv, dv), g[row:row + n], beta[row:row + n],
                                            states[slot], tiled)
        row += n
    if norm_w is None or z is None:
        return out
    return gated_rms_norm(out, z.reshape(T, Hv, dv), norm_w, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output x [..., dv] (weight [dv]), times silu(gate [..., dv])."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)) * F.silu(gate.float())
