"""LFM2's gated short convolution, over each sequence's state slot.

in_proj gives three gates per channel, B, C and x; y = C * conv(B * x), where conv is a depthwise
causal convolution of L (`conv_L_cache`) taps with no activation; out_proj maps y back. A
sequence's memory is the last L - 1 inputs of the convolution (B * x) [L - 1, H], in fp32 in its
state slot (runner/kv_cache.py). Each token's output depends only on its own inputs and the L - 1
before it, computed elementwise: a row's bits are the same alone, batched or in any chunk.
"""

from __future__ import annotations

import torch
from torch import nn

from phasewise.kernels.kernel_api import StackMixer
from phasewise.layers.attention import AttentionMetadata, LayerKV
from phasewise.layers.gated_delta import Conv1d, causal_conv, each_sequence
from phasewise.layers.linear import Linear


class ShortConv(nn.Module):
    def __init__(self, hidden: int, taps: int) -> None:
        super().__init__()
        self.in_proj = Linear(hidden, 3 * hidden)
        self.conv = Conv1d(hidden, taps)
        self.out_proj = Linear(hidden, hidden)

    def stack_projections(self) -> tuple[Linear, Linear, list[Linear]]:
        """The decoder stack's qkv and o of this layer (in_proj, out_proj); no other linears."""
        return self.in_proj, self.out_proj, []

    def stack_mixer(self) -> StackMixer:
        """This mixer as the decoder stack takes it: its taps [H, L] alone."""
        return StackMixer(None, None, None, self.conv.weight[:, 0].float().contiguous().detach(), None, None,
                          None, 0, 0, 0, 0, False, 0.0)

    def forward(self, x: torch.Tensor, state: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] → [T, hidden]; state: (conv [S, L - 1, H],), each sequence's slot
        (`meta.state_slots`) advanced past its tokens."""
        b, c, v = self.in_proj(x).float().chunk(3, dim=-1)          # [T, H] each
        bx = b * v
        weight = self.conv.weight[:, 0].float()                     # [H, L]
        conv_states, out = state[0], torch.empty_like(bx)

        def step(start: int, m: int, context: int, slot: int) -> None:
            if context == m:                               # the sequence starts here: no inputs before it
                conv_states[slot].zero_()
            out[start:start + m] = causal_conv(bx[start:start + m], conv_states[slot], weight, silu=False)
        each_sequence(meta, state, step)
        return self.out_proj((c * out).to(x.dtype))
