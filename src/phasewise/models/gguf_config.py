"""ModelConfig from a GGUF file's metadata (key → python value) and the names of its tensors, the
keys read under the file's architecture prefix as llama.cpp writes them.

The metadata is what loading/gguf_header.py read (its GGUFValue: numbers, strings, arrays); this module
sits below loading, so it takes the values as `object` and checks the type of each one it reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from phasewise.models.config import (GEMMA3_GLOBAL_EVERY, GEMMA3_LOCAL_THETA, HYBRID, QK_NORM, SUPPORTED,
                                     ExpertFields, ModelConfig, UnsupportedModelError, checked, clip_qkv)
from phasewise.models.recurrent import LFM2_THETA, GatedDeltaNetShape, HybridFields, ShortConvShape

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject

# GGUF general.architecture → our architecture family name
GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
              "gemma3": "gemma3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
              "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next", "lfm2": "lfm2"}
# Gated DeltaNet hybrids whose v heads llama.cpp's converter stores tiled (models/recurrent.py)
GGUF_TILED_V_HEADS = {"qwen35", "qwen35moe"}
# llama.cpp renormalises the chosen experts' weights by architecture, not by the HF config (unless the
# file says `expert_weights_norm`); a "llama" file with experts is Mixtral.
GGUF_EXPERTS_NORM = {"qwen3moe": True, "llama": True, "qwen2moe": False, "olmoe": False, "qwen35moe": True,
                     "qwen3next": True}


class GGUFKeys:
    """One file's metadata under its architecture's prefix (`{arch}.{key}`), read as checked values."""

    def __init__(self, fields: Mapping[str, object], arch: str) -> None:
        self.fields, self.arch = fields, arch

    def get(self, key: str, default: object = None) -> object:
        return self.fields.get(f"{self.arch}.{key}", default)

    def count(self, name: str, key: str, default: int | None = None) -> int:
        """An integer ModelConfig field `name` (within config.LIMITS); refused when missing."""
        value = self.get(key, default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {self.arch}.{key}")
        return checked(name, value, f"GGUF metadata {self.arch}.{key}")

    def real(self, key: str, default: float, below: float = float("inf")) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < below:
            raise UnsupportedModelError(f"GGUF metadata {self.arch}.{key} must be a number in (0, {below}), "
                                        f"got {str(value)[:40]!r}")
        return float(value)

    def size(self, key: str, default: int | None = None) -> int:
        """A positive size of a layer's part (a head count or dimension), within ModelConfig's head limits."""
        value = self.get(key, default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {self.arch}.{key}")
        return checked("num_heads", value, f"GGUF metadata {self.arch}.{key}")

    def hybrid(self, layers: int, head_dim: int) -> HybridFields:
        """A Gated DeltaNet hybrid's fields (Qwen3.5): the `ssm.*` shape, every `full_attention_interval`-th
        layer full attention (4 by default), the rest linear; RoPE on `rope.dimension_count` of each head."""
        v_heads = self.size("ssm.time_step_rank")
        inner = self.count("intermediate_size", "ssm.inner_size")         # all v heads' width
        if inner % v_heads:
            raise UnsupportedModelError(f"GGUF metadata {self.arch}.ssm.inner_size = {inner} is not a "
                                        f"multiple of {v_heads} value heads")
        try:
            shape = GatedDeltaNetShape(num_k_heads=self.size("ssm.group_count"), num_v_heads=v_heads,
                                       head_k_dim=self.size("ssm.state_size"), head_v_dim=inner // v_heads,
                                       conv_kernel=self.size("ssm.conv_kernel"),
                                       tiled_v_heads=self.arch in GGUF_TILED_V_HEADS)
        except ValueError as e:
            raise UnsupportedModelError(f"GGUF metadata {self.arch}.ssm.*: {e}") from None
        every = self.size("full_attention_interval", 4)
        rotary = self.size("rope.dimension_count", head_dim)
        if rotary > head_dim or rotary % 2:
            raise UnsupportedModelError(f"GGUF metadata {self.arch}.rope.dimension_count = {rotary} does not "
                                        f"fit heads of {head_dim}")
        return HybridFields(recurrent=shape,
                            recurrent_layers=tuple(i for i in range(layers) if (i + 1) % every),
                            attn_output_gate=True, rotary_dim=rotary)

    def kv_heads(self, heads: int) -> tuple[int, tuple[int, ...]]:
        """(KV heads, the layers without any): LFM2 writes `attention.head_count_kv` per layer, 0 for its
        short-conv layers; the others one number for every layer."""
        value = self.get("attention.head_count_kv", heads)
        if not isinstance(value, list):
            return checked("num_kv_heads", value, f"GGUF metadata {self.arch}.attention.head_count_kv"), ()
        counts = [n if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 1024
                  else -1 for n in value]
        if min(counts, default=-1) < 0 or not any(counts) or len({n for n in counts if n}) > 1:
            raise UnsupportedModelError(f"GGUF metadata {self.arch}.attention.head_count_kv = "
                                        f"{str(value)[:60]}: one KV head count for the "
                                        "attention layers is supported")
        return max(counts), tuple(i for i, n in enumerate(counts) if not n)

    def short_conv(self, hidden: int, conv_layers: tuple[int, ...]) -> HybridFields:
        """LFM2's short-conv layers (those without KV heads) of `shortconv.l_cache` taps."""
        return HybridFields(recurrent=ShortConvShape(channels=hidden, taps=self.size("shortconv.l_cache")),
                            recurrent_layers=conv_layers) if conv_layers else HybridFields()

    def rope_scaling(self, head_dim: int, rope_freqs: list[float] | None,
                     partial: bool = False) -> JsonObject | None:
        """Linear scaling, or the file's `rope_freqs.weight` divisors (Llama 3.1's, as llama.cpp stores
        them)."""
        scaling: JsonObject | None = None
        kind = self.get("rope.scaling.type")
        if kind and kind != "none":
            if kind != "linear":
                raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r} in GGUF (supported: linear)")
            scaling = {"rope_type": "linear", "factor": self.real("rope.scaling.factor", 1.0)}
        if rope_freqs is not None:
            scaling = {"rope_type": "freq_factors", "factors": [float(f) for f in rope_freqs]}
        if not partial and self.get("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        return scaling

    def sliding(self, gemma: bool, layers: int, context: int) -> tuple[int | None, tuple[int, ...]]:
        """(window, its layers): Gemma 3's fixed pattern (every sixth layer global, as llama.cpp),
        every layer otherwise; none when the window spans the context."""
        window = self.get("attention.sliding_window")
        if window is None:
            return None, ()
        window = checked("max_position_embeddings", window,
                         f"GGUF metadata {self.arch}.attention.sliding_window")
        if window >= context:
            return None, ()
        if gemma:
            return window, tuple(i for i in range(layers) if (i + 1) % GEMMA3_GLOBAL_EVERY)
        return window, tuple(range(layers))

    def experts(self, tensor_names: set[str], layers: int) -> ExpertFields:
        """The mixture-of-experts fields: `expert_count`, `expert_used_count`,
        `expert_feed_forward_length` (else `feed_forward_length`, as Mixtral's and OLMoE's files),
        `expert_shared_feed_forward_length` (Qwen2-MoE); a layer is sparse when the file holds its
        router (`blk.N.ffn_gate_inp`). Renormalising follows `expert_weights_norm`, else llama.cpp's
        fixed choice per architecture; a sigmoid gate or a weight scale is refused."""
        if not self.get("expert_count"):
            return {}
        if self.arch not in GGUF_EXPERTS_NORM:
            raise UnsupportedModelError(f"{self.arch} with experts is not supported")
        if self.get("expert_gating_func", 1) != 1:
            raise UnsupportedModelError(f"GGUF metadata {self.arch}.expert_gating_func = "
                                        f"{self.get('expert_gating_func')} (only softmax "
                                        "routing is supported)")
        if self.get("expert_weights_scale", 1.0) != 1.0:
            raise UnsupportedModelError(f"GGUF metadata {self.arch}.expert_weights_scale is not supported")
        width = "expert_feed_forward_length" if self.get("expert_feed_forward_length") is not None \
            else "feed_forward_length"
        shared = any(".ffn_up_shexp." in n for n in tensor_names)
        return ExpertFields(
            num_experts=self.count("num_experts", "expert_count"),
            num_experts_per_tok=self.count("num_experts_per_tok", "expert_used_count"),
            moe_intermediate_size=self.count("moe_intermediate_size", width),
            moe_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names),
            norm_topk_prob=bool(self.get("expert_weights_norm", GGUF_EXPERTS_NORM[self.arch])),
            shared_expert_intermediate_size=self.count("shared_expert_intermediate_size",
                                                       "expert_shared_feed_forward_length") if shared else 0,
        )


def config_from_gguf(fields: Mapping[str, object], tensor_names: set[str],
                     rope_freqs: list[float] | None = None) -> ModelConfig:
    """From GGUF metadata and the names of the file's tensors; rope_freqs: the file's
    `rope_freqs.weight` (per-dimension divisors of the RoPE frequencies), if any."""
    gguf_arch = fields.get("general.architecture", "")
    if not isinstance(gguf_arch, str) or (arch := GGUF_ARCHS.get(gguf_arch)) is None:
        raise UnsupportedModelError(
            f"unsupported architecture {str(gguf_arch)[:40]!r} (supported: {', '.join(SUPPORTED)})")
    if arch == "llama" and fields.get("llama.expert_count"):
        arch = "mixtral"
    keys, gemma, hybrid, lfm2 = GGUFKeys(fields, gguf_arch), arch == "gemma3", arch in HYBRID, arch == "lfm2"
    heads = keys.count("num_heads", "attention.head_count")
    hidden = keys.count("hidden_size", "embedding_length")
    head_dim = keys.count("head_dim", "attention.key_length", hidden // heads)
    vocab = keys.count("vocab_size", "vocab_size")
    scaling = keys.rope_scaling(head_dim, rope_freqs, partial=hybrid)
    kv_heads, conv_layers = keys.kv_heads(heads)
    if heads % kv_heads:
        raise UnsupportedModelError(f"{heads} attention heads do not divide into {kv_heads} KV heads")
    layers = keys.count("num_layers", "block_count") - mtp_layers(keys)
    context = keys.count("max_position_embeddings", "context_length", 2048)
    window, sliding = keys.sliding(gemma, layers, context)
    experts = keys.experts(tensor_names, layers)
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=keys.count("intermediate_size", "feed_forward_length",
                                     experts.get("moe_intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=keys.real("attention.layer_norm_rms_epsilon", 1e-6, 1.0),
        rope_theta=keys.real("rope.freq_base", LFM2_THETA if lfm2 else 10000.0),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
        rope_scaling=scaling,
        qk_norm=arch in QK_NORM,
        hidden_act="gelu_tanh" if gemma else "silu",
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=GEMMA3_LOCAL_THETA if gemma else None,
        # llama.cpp's Gemma 3 query scale: 1/sqrt(hidden / heads) for the 27B shape, else 1/sqrt(head size)
        query_scale=(hidden // heads if hidden == 5376 else head_dim) ** -0.5 if gemma else None,
        embedding_scale=float(hidden) ** 0.5 if gemma else 1.0,
        qk_norm_whole=arch == "olmoe",
        clip_qkv=clip_qkv(keys.get("attention.clamp_kqv"), f"GGUF metadata {gguf_arch}.attention.clamp_kqv")
        if arch == "olmoe" else None,
        **experts,
        **(keys.hybrid(layers, head_dim) if hybrid else keys.short_conv(hidden, conv_layers) if lfm2 else {}),
        name=str(fields.get("general.name", "")),
    )


def mtp_layers(keys: GGUFKeys) -> int:
    """Qwen3.5's multi-token-prediction layers, counted in `block_count` after the model's own (not
    loaded)."""
    value = keys.get("nextn_predict_layers", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 16:
        raise UnsupportedModelError(f"GGUF metadata {keys.arch}.nextn_predict_layers must be a small count, "
                                    f"got {str(value)[:40]!r}")
    return value
