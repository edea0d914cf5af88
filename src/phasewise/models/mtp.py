"""Qwen3.5's and Qwen3-Next's multi-token-prediction layer (`mtp.*` in their checkpoints).

It predicts the token after next from what the model computed for this one: at position t it takes
the model's final-normed hidden state h[t] and the embedding of token t + 1, each RMS-normed, joins
them through `fc` [H, 2H] into one row, runs it through one decoder layer of the attention kind (gated
attention over its own KV cache, the model's MLP kind) and a final norm; the model's output head turns
the result into logits for position t + 2. Fed its own output and its draft, it goes on (drafts 2..k).
It shares the model's token embedding and output head.
"""

from __future__ import annotations

import torch
from torch import nn

from phasewise.layers.attention import AttentionMetadata, LayerKV
from phasewise.layers.linear import Linear
from phasewise.layers.norm import RMSNorm
from phasewise.layers.rotary import RotaryEmbedding
from phasewise.models.config import ModelConfig
from phasewise.models.hybrid import HybridDecoderLayer
from phasewise.models.layer_list import LayerList


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        """cfg: the model's config (its `mtp_config()` shapes the layer)."""
        super().__init__()
        layer_cfg = cfg.mtp_config()
        self.config = layer_cfg
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        self.layers: LayerList[HybridDecoderLayer] = \
            LayerList([HybridDecoderLayer(layer_cfg, self.rotary, 0)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv: LayerKV) -> torch.Tensor:
        """embeds: the next tokens' embeddings [T, H]; hidden: the hidden states before them [T, H];
        positions [T] (those of `hidden`) → the layer's final-normed output [T, H] (logits through the
        model's head; the hidden state of the next MTP step)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](positions, x, None, kv, meta)
        x, _ = self.norm(x, residual)
        return x
