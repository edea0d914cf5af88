"""Gemma 3 (text) in plain PyTorch, on the Llama family's attention and MLP.

What differs from Llama: embeddings scaled by sqrt(hidden); RMSNorm weights stored as an
offset from 1 (HF's convention; we keep 1 + w, so the norm is the plain one); a norm after
attention and after the MLP as well as before each; QK-norm; a GELU-tanh gate; the query
scale the config gives; five local layers (a sliding window, their own RoPE base) to each
global one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.layers.attention import AttentionMetadata, LayerKV
from phasewise.layers.norm import RMSNorm
from phasewise.kernels.kernel_api import DecoderStack, Kernels
from phasewise.layers.rotary import RotaryEmbedding
from phasewise.models.config import ModelConfig
from phasewise.models.layer_list import LayerList
from phasewise.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, embed, vocab_embedding
from phasewise.models.stack import build_stack, run_stack


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = LlamaAttention(cfg, rotary, layer, tp)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = LlamaMLP(cfg, tp)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv: LayerKV, meta: AttentionMetadata
                ) -> torch.Tensor:
        """x: [T, hidden] (the residual stream) → the same after this layer."""
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg, tp)
        P = cfg.max_position_embeddings
        glob = RotaryEmbedding(cfg.head_dim, P, cfg.rope_theta, cfg.rope_scaling)
        local = RotaryEmbedding(cfg.head_dim, P, cfg.rope_local_theta or cfg.rope_theta)
        self.layers: LayerList[Gemma3DecoderLayer] = LayerList(
            Gemma3DecoderLayer(cfg, local if i in cfg.sliding_layers else glob, i, tp)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embedding_scale = cfg.embedding_scale
        self.cfg, self.tp = cfg, tp
        self.stack: DecoderStack | None = None   # the C++ decoder stack (bind_kernels), if it can run
        self.expert_counts: torch.Tensor | None = None   # no experts

    def build_stack(self, kernels: Kernels | None) -> None:
        """The C++ decoder stack of these (bound) layers, with Gemma's sandwich norms; not with tp."""
        sandwich = [(layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight)
                    for layer in self.layers]
        self.stack = build_stack(kernels, self.cfg, list(self.layers), self.norm.weight, sandwich) \
            if self.tp is None else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[LayerKV], keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] → hidden states [T, hidden], or of the rows `keep` [R] (ascending)."""
        x = embed(self.embed_tokens, input_ids, self.cfg, self.tp) * self.embedding_scale
        if self.stack is not None:                              # the whole step in one C++ call
            return run_stack(self.stack, self.cfg, x, positions, meta, kv_caches, keep)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(positions, x, kv, meta)
        return self.norm(x if keep is None else x[keep])


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors, norms as HF stores them (w, applied as 1 + w): we keep 1 + w."""
        return super().load_weights((name, tensor + 1 if name.endswith("norm.weight") else tensor)
                                    for name, tensor in weights)
