"""ModelConfig from an HF config.json (transformers' names and defaults, per architecture), as
models/gguf_config.py makes it from a GGUF's metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from phasewise.models.config import (GEMMA3_GLOBAL_EVERY, GEMMA3_LOCAL_THETA, HF_TYPES, HYBRID, QK_NORM,
                                     SUPPORTED, ExpertFields, ModelConfig, UnsupportedModelError, checked,
                                     clip_qkv)
from phasewise.models.hf_config import HFConfig
from phasewise.models.recurrent import hf_hybrid, hf_lfm2, hf_lfm2_config

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject, JsonValue


def config_from_hf(config: HFConfig | str | Path) -> ModelConfig:
    """From an HF config dict, a config.json path, or a model folder."""
    if not isinstance(config, dict):
        path = Path(config)
        config = _read_json(path / "config.json" if path.is_dir() else path)
    model_type = config.get("model_type", "")
    arch = HF_TYPES.get(model_type)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED)})")
    if "text_config" in config and arch in HYBRID:   # a multimodal folder: its language model, text only
        config = config["text_config"]
    if arch == "lfm2":                               # its own names for the common keys
        config = hf_lfm2_config(config)
    heads, gemma = config["num_attention_heads"], arch == "gemma3"
    rope, scaling, local_theta = _hf_rope(config, arch)
    window, sliding = _hf_sliding_window(config, arch)
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if gemma and config.get(key):
            raise UnsupportedModelError(f"Gemma 3 with {key} = {config[key]} is not supported")
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if arch == "olmoe" and config.get("attention_bias"):
        raise UnsupportedModelError("OLMoE with attention_bias (a bias on o_proj too) is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config.get("intermediate_size") or config.get("moe_intermediate_size") or 0,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=_number(config.get("rope_theta") or rope.get("rope_theta") or 10000.0, "rope_theta"),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
        attention_bias=bool(config.get("qkv_bias", True) if arch == "qwen2_moe"    # transformers 5's name
                            else config.get("attention_bias", arch == "qwen2")),
        rope_scaling=scaling,
        qk_norm=arch in QK_NORM,
        hidden_act={"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act),
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=local_theta,
        query_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        embedding_scale=float(config["hidden_size"]) ** 0.5 if gemma else 1.0,
        qk_norm_whole=arch == "olmoe",
        clip_qkv=clip_qkv(config.get("clip_qkv"), "config.json clip_qkv") if arch == "olmoe" else None,
        **_hf_experts(config, arch),
        **(hf_hybrid(config, rope) if arch in HYBRID else hf_lfm2(config) if arch == "lfm2" else {}),
        name=config.get("_name_or_path", ""),
    )


def _read_json(path: Path) -> HFConfig:
    return json.loads(path.read_text())      # as HF writes it (HFConfig: not checked here)


def _hf_rope(config: HFConfig, arch: str) -> tuple[JsonObject, JsonObject | None, float | None]:
    """(the global layers' RoPE parameters, their scaling or None, Gemma 3's local base or None) of an
    HF config: transformers >= 5 keeps theta in rope_parameters, per layer type for Gemma 3."""
    rope = dict(config.get("rope_parameters") or {})
    local_theta = None
    if arch == "gemma3":                              # per layer type: {"full_attention": {...}, ...}
        local = _object(rope, "sliding_attention")
        rope = dict(_object(rope, "full_attention"))
        theta = local.get("rope_theta") or config.get("rope_local_base_freq") or GEMMA3_LOCAL_THETA
        local_theta = _number(theta, "rope_local_base_freq")
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial is not None and _number(partial, "partial_rotary_factor") != 1.0 and arch not in HYBRID:
        raise UnsupportedModelError("partial rotary embeddings are not supported "
                                    f"(partial_rotary_factor={partial})")
    return rope, scaling, local_theta


def _object(parent: JsonObject, key: str) -> JsonObject:
    """parent[key], an object of config.json's rope_parameters ({} when absent or empty)."""
    value = parent.get(key) or {}
    if not isinstance(value, dict):
        raise TypeError(f"config.json rope_parameters.{key} must be an object, got {str(value)[:40]!r}")
    return value


def _number(value: JsonValue, key: str) -> float:
    """float(value) of a config.json value (a number, or a string float() reads, as before)."""
    if value is None or isinstance(value, (list, dict)):
        raise TypeError(f"config.json {key} must be a number, got {str(value)[:40]!r}")
    return float(value)


def _hf_sliding_window(config: HFConfig, arch: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, the local layers) of an HF config: `layer_types` where the config lists them (Gemma 3,
    Qwen2/3 in transformers 5), else Qwen2/3's `max_window_layers`, else (Mistral) every layer. A
    window no shorter than the context changes nothing and is dropped."""
    window, layers = config.get("sliding_window"), config["num_hidden_layers"]
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not config.get("use_sliding_window", False):
        window = None
    if arch in ("qwen2_moe", "qwen3_moe", "olmoe") and window:
        raise UnsupportedModelError(f"{arch} with a sliding window is not supported")
    if not window or window >= config.get("max_position_embeddings", 2048):
        return None, ()
    types = config.get("layer_types")
    if types:
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    elif arch == "gemma3":
        every = config.get("sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
        sliding = tuple(i for i in range(layers) if (i + 1) % every)
    elif arch in ("qwen2", "qwen3"):
        sliding = tuple(range(config.get("max_window_layers", layers), layers))
    else:
        sliding = tuple(range(layers))
    return (int(window), sliding) if sliding else (None, ())


def _hf_experts(config: HFConfig, arch: str) -> ExpertFields:
    """The mixture-of-experts fields of an HF config (none for a dense architecture). Qwen2/3-MoE
    and Qwen3-Next make layer i sparse unless it is in mlp_only_layers or (i + 1) is not a multiple of
    decoder_sparse_step (transformers' rule); Mixtral and OLMoE every layer. Mixtral always
    renormalises the top-k weights."""
    if arch not in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe", "qwen3_next"):
        return {}
    experts = config.get("num_experts", config.get("num_local_experts")) or 0
    if not experts:
        return {}
    experts = checked("num_experts", experts, "config.json num_experts")
    layers = config["num_hidden_layers"]
    moe = tuple(range(layers))
    if arch in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        step = checked("num_layers", config.get("decoder_sparse_step", 1), "config.json decoder_sparse_step")
        only = set(config.get("mlp_only_layers") or ())
        moe = tuple(i for i in moe if i not in only and (i + 1) % step == 0)
    shared = config.get("shared_expert_intermediate_size", 0) \
        if arch in ("qwen2_moe", "qwen3_5_moe", "qwen3_next") else 0
    norm_topk = arch in ("mixtral", "qwen3_5_moe") or bool(config.get("norm_topk_prob", arch == "qwen3_next"))
    return ExpertFields(
        num_experts=experts,
        num_experts_per_tok=checked("num_experts_per_tok", config.get("num_experts_per_tok"),
                                    "config.json num_experts_per_tok"),
        moe_intermediate_size=checked("moe_intermediate_size",
                                      config.get("moe_intermediate_size") or config.get("intermediate_size"),
                                      "config.json moe_intermediate_size"),
        moe_layers=moe,
        norm_topk_prob=norm_topk,
        shared_expert_intermediate_size=checked("shared_expert_intermediate_size", shared or 0,
                                                "config.json shared_expert_intermediate_size"),
    )
