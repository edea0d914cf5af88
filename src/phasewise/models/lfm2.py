"""LFM2: gated short convolutions beside grouped-query attention.

Most layers mix tokens with a short convolution (layers/short_conv.py) whose memory is the
sequence's state slot; the others (`layer_types` "full_attention") attend over the paged KV cache
as Llama's do, with per-head q and k RMSNorms before full RoPE. Norms are plain w (no offset): the
mixer's (`operator_norm`) and the MLP's (`ffn_norm`) in each layer, and `embedding_norm`, which,
whatever its name, is applied after the last layer. The MLP is SwiGLU (w1 gate, w3 up, w2 down)
of the width ModelConfig.from_hf computes by transformers' rule; the embeddings are tied.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from phasewise.layers.attention import AttentionMetadata, LayerKV
from phasewise.layers.rotary import RotaryEmbedding
from phasewise.layers.short_conv import ShortConv
from phasewise.models.config import ModelConfig
from phasewise.models.hybrid import HybridLayer, HybridModel
from phasewise.models.llama import LlamaAttention, LlamaForCausalLM
from phasewise.models.recurrent import ShortConvShape

# an HF checkpoint's name parts → ours (the short conv's `conv.in_proj`, `conv.conv`, `conv.out_proj`
# as they are)
HF_NAMES = ((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
            (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
            (".feed_forward.w2.", ".mlp.down_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".self_attn.out_proj.", ".self_attn.o_proj."),
            ("model.embedding_norm.", "model.norm."))


def hf_name(name: str) -> str:
    """An LFM2 checkpoint tensor's name as our modules call it (Llama's names where they share one)."""
    for theirs, ours in HF_NAMES:
        name = name.replace(theirs, ours)
    return name


class Lfm2DecoderLayer(HybridLayer):
    """A short convolution (`conv`) or attention (`self_attn`), then the MLP."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__(cfg, layer)
        self.conv: ShortConv | None = None
        self.self_attn: LlamaAttention | None = None
        if layer in cfg.recurrent_layers:
            assert isinstance(cfg.recurrent, ShortConvShape)           # an LFM2 config's
            self.conv = ShortConv(cfg.hidden_size, cfg.recurrent.taps)
        else:
            self.self_attn = LlamaAttention(cfg, rotary, layer)

    @property
    def recurrent(self) -> ShortConv | None:
        return self.conv

    def mix(self, positions: torch.Tensor, x: torch.Tensor, memory: LayerKV,
            meta: AttentionMetadata) -> torch.Tensor:
        if self.conv is not None:
            return self.conv(x, memory, meta)
        assert self.self_attn is not None
        return self.self_attn(positions, x, memory, meta)


class Lfm2Model(HybridModel):
    layer_class = Lfm2DecoderLayer


class Lfm2ForCausalLM(LlamaForCausalLM):
    model_class = Lfm2Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named LFM2 tensors (hf_name: ours), the plain norms as they are; a GGUF's conv taps [H, L]
        as the checkpoint's [H, 1, L]."""
        return super().load_weights((hf_name(name), tensor[:, None] if name.endswith(".conv.conv.weight") and
                                     tensor.dim() == 2 else tensor) for name, tensor in weights)
