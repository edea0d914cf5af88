"""ModelConfig: one normalised description of a model, from GGUF metadata or an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF model_type / GGUF general.architecture → our architecture family name.
_HF_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "phi3": "phi3"}
_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "phi3": "phi3"}
SUPPORTED = sorted(set(_HF_TYPES.values()))


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature we do not implement."""


# What a config may say, as (low, high) per field: beyond these a file is corrupt (or a model no
# CPU here runs), and building it would try to allocate terabytes. The context bounds RoPE's
# precomputed table: 2^20 positions x head size 128 is 512 MB.
LIMITS = {"vocab_size": (1, 1 << 22), "hidden_size": (1, 1 << 16), "intermediate_size": (1, 1 << 18),
          "num_layers": (1, 1024), "num_heads": (1, 1024), "num_kv_heads": (1, 1024), "head_dim": (2, 1024),
          "max_position_embeddings": (1, 1 << 20)}


def checked(name: str, value: Any, source: str) -> int:
    """`value` as the integer field `name` of ModelConfig, within LIMITS; UnsupportedModelError
    naming `source` (the file's key) otherwise."""
    lo, hi = LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedModelError(f"{source} must be an integer, got {str(value)[:40]!r}")
    if not lo <= value <= hi:
        raise UnsupportedModelError(f"{source} = {value} is out of range [{lo}, {hi}]")
    return value


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    architecture: str              # "llama" | "mistral" | "qwen2" | "phi3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # Qwen2: bias on q, k and v
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} kv heads")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ("default", "linear", "llama3", "freq_factors"):
            raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r} (supported: linear, llama3)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * element_size

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | Path) -> ModelConfig:
        """From an HF config dict, a config.json path, or a model folder."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            config = json.loads(path.read_text())
        model_type = config.get("model_type", "")
        arch = _HF_TYPES.get(model_type)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED)})")
        heads = config["num_attention_heads"]
        rope = dict(config.get("rope_parameters") or {})  # transformers >= 5 keeps theta here
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise UnsupportedModelError(f"partial rotary embeddings are not supported (partial_rotary_factor={partial})")
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", arch == "qwen2")),
            rope_scaling=scaling,
            name=config.get("_name_or_path", ""),
        )

    @classmethod
    def from_gguf(cls, fields: dict[str, Any], tensor_names: set[str],
                  rope_freqs: list[float] | None = None) -> ModelConfig:
        """From GGUF metadata (key → python value) and the names of the file's tensors.

        rope_freqs: the file's `rope_freqs.weight` (per-dimension divisors of the
        RoPE frequencies, how llama.cpp stores Llama 3.1-style scaling), if any.
        """
        gguf_arch = fields.get("general.architecture", "")
        arch = _GGUF_ARCHS.get(gguf_arch) if isinstance(gguf_arch, str) else None
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {str(gguf_arch)[:40]!r} (supported: {', '.join(SUPPORTED)})")

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"{gguf_arch}.{key}", default)

        def count(name: str, key: str, default: Any = None) -> int:
            value = get(key, default)
            if value is None:
                raise UnsupportedModelError(f"GGUF metadata lacks {gguf_arch}.{key}")
            return checked(name, value, f"GGUF metadata {gguf_arch}.{key}")

        heads = count("num_heads", "attention.head_count")
        hidden = count("hidden_size", "embedding_length")
        head_dim = count("head_dim", "attention.key_length", hidden // heads)
        vocab = count("vocab_size", "vocab_size")
        def real(key: str, default: float, below: float = float("inf")) -> float:
            value = get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < below:
                raise UnsupportedModelError(f"GGUF metadata {gguf_arch}.{key} must be a number in (0, {below}), "
                                            f"got {str(value)[:40]!r}")
            return float(value)

        scaling = None
        kind = get("rope.scaling.type")
        if kind and kind != "none":
            if kind != "linear":
                raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r} in GGUF (supported: linear)")
            scaling = {"rope_type": "linear", "factor": real("rope.scaling.factor", 1.0)}
        if rope_freqs is not None:
            scaling = {"rope_type": "freq_factors", "factors": tuple(float(f) for f in rope_freqs)}
        if get("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError("partial rotary embeddings are not supported")

        kv_heads = count("num_kv_heads", "attention.head_count_kv", heads)
        if heads % kv_heads:
            raise UnsupportedModelError(f"{heads} attention heads do not divide into {kv_heads} KV heads")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=count("intermediate_size", "feed_forward_length"),
            num_layers=count("num_layers", "block_count"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=real("attention.layer_norm_rms_epsilon", 1e-6, 1.0),
            rope_theta=real("rope.freq_base", 10000.0),
            max_position_embeddings=count("max_position_embeddings", "context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
            rope_scaling=scaling,
            name=str(fields.get("general.name", "")),
        )
