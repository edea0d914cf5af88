"""The C++ decoder stack (kernels/csrc/decoder.cpp) built from a model's layers and run for a step.

With compiled kernels, one DecoderStack call runs every decoder layer of a step (prefill chunks
and decodes alike) where it can: every linear layer quantized (a sparse layer's experts in their
blocks, its routers fp32), norms and RoPE tables fp32 on the CPU. A decode step of a 30-layer model
makes about 300 op calls, each costing microseconds from Python (a third of the step at batch 1). The Python layers stay the path for everything else and
the reference the tests compare against.
"""

from __future__ import annotations

import torch
from torch import nn

from phasewise.layers.attention import AttentionMetadata, LayerKV
from phasewise.layers.linear import Linear
from phasewise.models.config import ModelConfig
from phasewise.kernels.kernel_api import DecoderStack, Kernels, StackLayer
from phasewise.models.moe import SparseMoeBlock


def build_stack(kernels: Kernels | None, cfg: ModelConfig, layers: nn.ModuleList, final_norm: torch.Tensor,
                sandwich: bool = False) -> DecoderStack | None:
    """The DecoderStack of `layers` (Llama-family layers, dense or sparse; `sandwich`: Gemma 3's, with
    norms after attention and after the MLP too), or None where the stack cannot run them."""
    if kernels is None or cfg.clip_qkv is not None:
        return None        # the stack does not clamp qkv: the Python layers run those models
    specs: list[StackLayer] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        moe = mlp.stack_args() if isinstance(mlp, SparseMoeBlock) else None
        dense = mlp.shared_expert if isinstance(mlp, SparseMoeBlock) else mlp
        if isinstance(mlp, SparseMoeBlock) and moe is None:
            return None
        linears: list[Linear] = [attn.qkv_proj, attn.o_proj]
        linears += [dense.gate_up_proj, dense.down_proj] if dense is not None else []
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        ffn = [layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight] if sandwich else []
        qk = [attn.q_norm.weight, attn.k_norm.weight] if cfg.qk_norm or cfg.qk_norm_whole else []
        rope = [attn.rotary.cos, attn.rotary.sin]
        if not all(m.form == "blocks" and _on_cpu(m.blocks) for m in linears) \
                or not all(map(_fp32_cpu, norms + ffn + qk + rope)):
            return None
        packed = [m.packed_args() for m in linears] + [None, None]
        q_norm, k_norm = [w.detach() for w in qk] or [None, None]
        pre_ffn, post_ffn = [w.detach() for w in ffn] or [None, None]
        specs.append(StackLayer(*(w.detach() for w in norms), *packed[:4], q_norm=q_norm, k_norm=k_norm,
                                pre_ffn_norm=pre_ffn, post_ffn_norm=post_ffn, cos=rope[0], sin=rope[1],
                                kv_group=attn.kv_group, window=attn.window or 0, sparse=moe))
    if not _fp32_cpu(final_norm):
        return None
    rotary = layers[0].self_attn.rotary
    return kernels.decoder_stack(specs, final_norm.detach(), rotary.cos, rotary.sin, cfg.num_heads, cfg.num_kv_heads,
                                 cfg.head_dim, cfg.rms_norm_eps, cfg.query_scale or 0.0, cfg.hidden_act == "gelu_tanh")


def run_stack(stack: DecoderStack, cfg: ModelConfig, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              kv_caches: list[LayerKV], keep: torch.Tensor | None = None,
              expert_counts: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, hidden] embedded tokens → the final-normed hidden states [T, hidden] (or of the rows
    `keep` [R], ascending: the last layer computes only those past its keys and values), every layer
    in one call; `expert_counts` [L, E] int64 (a model with experts): each layer's choices per expert."""
    metas = [meta.for_group(g) for g in range(len(cfg.kv_groups))]
    rows = [m.kernel_rows for m in metas]
    return stack.forward(x, positions, [m.slot_mapping for m in metas], kv_caches, [r.tables for r in rows],
                         [r.seq for r in rows], [r.length for r in rows], meta.block_size, keep, expert_counts)


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def _fp32_cpu(t: torch.Tensor) -> bool:
    return _on_cpu(t) and t.dtype == torch.float32
