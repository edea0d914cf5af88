"""HFConfig: the keys of an HF config.json that models/config.py reads, typed as transformers writes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject


class HFConfig(TypedDict, total=False):
    """An HF config.json: the keys read here, typed as transformers writes them. The file is not checked
    against these types (a value of another type fails where it is used)."""
    model_type: str
    _name_or_path: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None
    head_dim: int | None
    hidden_act: str | None
    hidden_activation: str | None
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qkv_bias: bool
    rope_theta: float | None
    rope_parameters: JsonObject | None     # transformers >= 5 (Gemma 3: an object per layer type)
    rope_scaling: JsonObject | None
    rope_local_base_freq: float | None
    partial_rotary_factor: float | None
    sliding_window: int | None
    use_sliding_window: bool
    max_window_layers: int
    layer_types: list[str] | None
    sliding_window_pattern: int
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    use_bidirectional_attention: bool | None
    clip_qkv: float | None
    num_experts: int | None
    num_local_experts: int | None
    num_experts_per_tok: int
    moe_intermediate_size: int | None
    decoder_sparse_step: int
    mlp_only_layers: list[int] | None
    norm_topk_prob: bool
    shared_expert_intermediate_size: int | None
    text_config: HFConfig                  # Qwen3.5's multimodal folders: the language model's config
    full_attention_interval: int           # hybrids: every n-th layer is full attention
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    norm_eps: float                        # LFM2's names (models/recurrent.py hf_lfm2_config reads them)
    conv_L_cache: int
    conv_bias: bool
    full_attn_idxs: list[int] | None
    block_ff_dim: int
    block_auto_adjust_ff_dim: bool
    block_ffn_dim_multiplier: float | None
    block_multiple_of: int
    tie_embedding: bool
