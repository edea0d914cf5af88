"""The C++ decoder stack (kernels/csrc/decoder.cpp) built from a model's layers and run for a step.

With compiled kernels, one DecoderStack call runs every decoder layer of a step (prefill chunks
and decodes alike) where it can: every linear layer quantized (a sparse layer's experts in their
blocks, its routers fp32), norms and RoPE tables fp32 on the CPU. A decode step of a 30-layer model
makes about 300 op calls, each costing microseconds from Python (a third of the step at batch 1).
Hybrids run there too: a recurrent layer (a Gated DeltaNet, LFM2's short conv) in place of attention
over its sequences' state slots, and Qwen3.5's gated attention with partial RoPE. The Python layers
stay the path for everything else and the reference the tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch

from phasewise.layers.attention import AttentionMetadata, LayerKV
from phasewise.layers.linear import Linear
from phasewise.layers.norm import RMSNorm
from phasewise.layers.rotary import RotaryEmbedding
from phasewise.models.config import ModelConfig
from phasewise.kernels.kernel_api import DecoderStack, Kernels, StackLayer, StackMixer
from phasewise.models.moe import DenseMLP, SparseMoeBlock

T = TypeVar("T")


class StackAttention(Protocol):
    """What the stack reads of a layer's attention (llama.py's LlamaAttention; the norms with QK-norm)."""
    qkv_proj: Linear
    o_proj: Linear
    q_norm: RMSNorm
    k_norm: RMSNorm
    rotary: RotaryEmbedding
    kv_group: int
    window: int | None


class StackRecurrent(Protocol):
    """What the stack reads of a recurrent token mixer (hybrid.py's GatedDeltaNet, short_conv.py's
    ShortConv)."""

    def stack_projections(self) -> tuple[Linear, Linear, list[Linear]]:
        """Its input and output projections (the stack's qkv and o), and its other linears."""
        ...

    def stack_mixer(self) -> StackMixer:
        """Its description for the stack (every projection in blocks)."""
        ...


class StackDecoderLayer(Protocol):
    """What the stack reads of a decoder layer (llama.py's, gemma3.py's, hybrid.py's: no attention
    where the model hands the layer's recurrent mixer instead)."""
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    @property
    def self_attn(self) -> StackAttention | None: ...

    @property
    def mlp(self) -> DenseMLP | SparseMoeBlock: ...


def build_stack(kernels: Kernels | None, cfg: ModelConfig, layers: Sequence[StackDecoderLayer],
                final_norm: torch.Tensor, ffn_norms: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                mixers: Sequence[StackRecurrent | None] = (), rotary: RotaryEmbedding | None = None
                ) -> DecoderStack | None:
    """The DecoderStack of `layers` (Llama-family layers, dense or sparse; `ffn_norms`: Gemma 3's
    sandwich, each layer's norms before and after the MLP too; `mixers`: a hybrid's recurrent mixer per
    layer, None where it attends, and its `rotary`), or None where the stack cannot run them."""
    if kernels is None or cfg.clip_qkv is not None:
        return None        # the stack does not clamp qkv: the Python layers run those models
    specs: list[StackLayer] = []
    for i, layer in enumerate(layers):
        spec = _layer_spec(cfg, layer, ffn_norms[i] if ffn_norms else (), mixers[i] if mixers else None)
        if spec is None:
            return None
        specs.append(spec)
    if rotary is None:
        attn = layers[0].self_attn
        assert attn is not None
        rotary = attn.rotary
    if not _fp32_cpu(final_norm) or not _fp32_cpu(rotary.cos):
        return None
    return kernels.decoder_stack(specs, final_norm.detach(), rotary.cos, rotary.sin, cfg.num_heads,
                                 cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.query_scale or 0.0,
                                 cfg.hidden_act == "gelu_tanh")


def _layer_spec(cfg: ModelConfig, layer: StackDecoderLayer, ffn: Sequence[torch.Tensor],
                recurrent: StackRecurrent | None) -> StackLayer | None:
    """A layer as the stack takes it, or None where it cannot run it (a weight not in its kernels' form)."""
    attn, mlp = layer.self_attn, layer.mlp
    moe = mlp.stack_args() if isinstance(mlp, SparseMoeBlock) else None
    dense = mlp.shared_expert if isinstance(mlp, SparseMoeBlock) else mlp
    if isinstance(mlp, SparseMoeBlock) and moe is None:
        return None
    others: list[Linear] = []
    qk: list[torch.Tensor] = []
    rope: list[torch.Tensor] = []
    if recurrent is not None:
        qkv_proj, o_proj, others = recurrent.stack_projections()
    else:
        assert attn is not None
        qkv_proj, o_proj, rope = attn.qkv_proj, attn.o_proj, [attn.rotary.cos, attn.rotary.sin]
        qk = [attn.q_norm.weight, attn.k_norm.weight] if cfg.qk_norm or cfg.qk_norm_whole else []
    linears: list[Linear] = [qkv_proj, o_proj] + ([dense.gate_up_proj, dense.down_proj]
                                                  if dense is not None else [])
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if not all(m.form == "blocks" and _on_cpu(m.blocks) for m in linears + others) \
            or not all(map(_fp32_cpu, norms + list(ffn) + qk + rope)):
        return None
    mixer = recurrent.stack_mixer() if recurrent is not None else None
    qkv, o, *dense_args = [m.packed_args() for m in linears]
    gate_up, down = _pair(dense_args)
    q_norm, k_norm = _pair([w.detach() for w in qk])
    pre_ffn, post_ffn = _pair([w.detach() for w in ffn])
    cos, sin = _pair(rope)
    return StackLayer(norms[0].detach(), norms[1].detach(), qkv, o, gate_up, down, q_norm=q_norm,
                      k_norm=k_norm, pre_ffn_norm=pre_ffn, post_ffn_norm=post_ffn, cos=cos, sin=sin,
                      kv_group=attn.kv_group if attn is not None else 0,
                      window=(attn.window or 0) if attn is not None else 0, sparse=moe, mixer=mixer,
                      attn_gate=attn is not None and cfg.attn_output_gate)


def run_stack(stack: DecoderStack, cfg: ModelConfig, x: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata, kv_caches: Sequence[LayerKV], keep: torch.Tensor | None = None,
              expert_counts: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, hidden] embedded tokens → the final-normed hidden states [T, hidden] (or of the rows
    `keep` [R], ascending: the last layer computes only those past its keys and values), every layer
    in one call; `expert_counts` [L, E] int64 (a model with experts): each layer's choices per expert.
    A hybrid's recurrent layers take their states from kv_caches and the sequences' slots from meta."""
    metas = [meta.for_group(g) for g in range(len(cfg.kv_groups))]
    rows = [m.kernel_rows for m in metas]
    sequences = snapshots = None
    if meta.state_slots:                                  # a hybrid's step (attention-only: [] or None)
        sequences = torch.tensor([meta.query_lens, meta.context_lens, meta.state_slots], dtype=torch.int64)
        if any(meta.state_snapshots or ()):
            taken = snapshot_rows(meta.query_lens, meta.state_snapshots or [])
            snapshots = torch.tensor(taken, dtype=torch.int64)
    return stack.forward(x, positions, [m.slot_mapping for m in metas], kv_caches, [r.tables for r in rows],
                         [r.seq for r in rows], [r.length for r in rows], meta.block_size, keep,
                         expert_counts, sequences, snapshots, rows[0].seqs)


def snapshot_rows(query_lens: Sequence[int], snapshots: Sequence[Sequence[int]]) -> list[int]:
    """Per row of the step, the slot its sequence's states are copied to after it (-1: none): sequence
    i's j-th row's is snapshots[i][j] where given (AttentionMetadata.state_snapshots)."""
    out: list[int] = []
    for n, snaps in zip(query_lens, snapshots):
        out += [snaps[j] if j < len(snaps) else -1 for j in range(n)]
    return out


def _pair(items: Sequence[T]) -> tuple[T, T] | tuple[None, None]:
    """The two items of a list of two; (None, None) for an empty one."""
    return (items[0], items[1]) if items else (None, None)


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def _fp32_cpu(t: torch.Tensor) -> bool:
    return _on_cpu(t) and t.dtype == torch.float32
