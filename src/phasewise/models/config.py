"""ModelConfig: one normalised description of a model, from GGUF metadata or an HF config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from phasewise.models.hf_config import HFConfig
from phasewise.models.recurrent import RecurrentShape

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject

# HF model_type → our architecture family name (models/gguf_config.py maps GGUF's).
HF_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
            "gemma3": "gemma3", "gemma3_text": "gemma3",
            "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "olmoe": "olmoe",
            "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
            "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next", "lfm2": "lfm2"}
# Gated DeltaNet layers beside gated attention (models/hybrid.py)
HYBRID = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}
QK_NORM = {"qwen3", "gemma3", "qwen3_moe", "lfm2"} | HYBRID   # RMSNorm over each head of q and k, before RoPE
ROUTERS = ("softmax_topk", "topk_softmax")
GEMMA3_GLOBAL_EVERY = 6               # Gemma 3: five local (sliding-window) layers, then one global
# Gemma 3's RoPE base on local layers (llama.cpp's and transformers' default)
GEMMA3_LOCAL_THETA = 10000.0
SUPPORTED = sorted(set(HF_TYPES.values()))


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature we do not implement."""


# What a config may say, as (low, high) per field: beyond these a file is corrupt (or a model no
# CPU here runs), and building it would try to allocate terabytes. The context bounds RoPE's
# precomputed table: 2^20 positions x head size 128 is 512 MB.
LIMITS = {"vocab_size": (1, 1 << 22), "hidden_size": (1, 1 << 16), "intermediate_size": (1, 1 << 18),
          "num_layers": (1, 1024), "num_heads": (1, 1024), "num_kv_heads": (1, 1024), "head_dim": (2, 1024),
          "max_position_embeddings": (1, 1 << 20), "num_experts": (1, 4096), "num_experts_per_tok": (1, 4096),
          "moe_intermediate_size": (1, 1 << 18), "shared_expert_intermediate_size": (0, 1 << 18)}


def checked(name: str, value: object, source: str) -> int:
    """`value` as the integer field `name` of ModelConfig, within LIMITS; UnsupportedModelError
    naming `source` (the file's key) otherwise."""
    lo, hi = LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedModelError(f"{source} must be an integer, got {str(value)[:40]!r}")
    if not lo <= value <= hi:
        raise UnsupportedModelError(f"{source} = {value} is out of range [{lo}, {hi}]")
    return value


class ExpertFields(TypedDict, total=False):
    """ModelConfig's mixture-of-experts fields, as a config gives them (none for a dense model)."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_layers: tuple[int, ...]
    norm_topk_prob: bool
    shared_expert_intermediate_size: int


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    architecture: str              # "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" | "gemma3"; with
                                   # experts: "qwen2_moe" | "qwen3_moe" | "mixtral" | "olmoe"; hybrids:
                                   # "qwen3_5" | "qwen3_5_moe" | "qwen3_next" | "lfm2"
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
    rope_scaling: JsonObject | None = field(default=None, hash=False, compare=False)  # global layers'
    qk_norm: bool = False          # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    hidden_act: str = "silu"       # the MLP's gate: "silu" | "gelu_tanh" (Gemma)
    # local layers attend to the latest this many tokens (themselves included)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # which layers are local (windowed); the rest attend to everything
    rope_local_theta: float | None = None  # RoPE base of the local layers (Gemma 3); None: rope_theta
    query_scale: float | None = None    # attention's score scale; None: head_dim ** -0.5
    embedding_scale: float = 1.0   # Gemma: embeddings are multiplied by sqrt(hidden_size)
    qk_norm_whole: bool = False    # OLMoE: RMSNorm over all of q and all of k (not per head), before RoPE
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip] after those norms
    # Mixture of experts (models/moe.py); num_experts 0: a dense model.
    num_experts: int = 0           # experts of each MoE layer
    num_experts_per_tok: int = 0   # top-k: experts each row takes
    moe_intermediate_size: int = 0  # one expert's width (the dense layers' is intermediate_size)
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the sparse block; the others are dense
    norm_topk_prob: bool = False   # the chosen experts' weights renormalised to sum to 1
    router: str = "softmax_topk"   # "softmax_topk": softmax over all experts, then top-k (the four here);
                                   # "topk_softmax": top-k of the logits, softmax over those
    # Qwen2-MoE: a dense expert every row takes, behind a sigmoid gate
    shared_expert_intermediate_size: int = 0
    # Hybrids (models/hybrid.py, models/lfm2.py): layers whose memory is a fixed recurrent state, not KV
    recurrent: RecurrentShape | None = None   # the shape of those layers (Gated DeltaNet, LFM2's short conv)
    recurrent_layers: tuple[int, ...] = ()  # which layers they are; the others attend over the KV cache
    attn_output_gate: bool = False # Qwen3.5: attention's output times sigmoid(a gate q_proj also gives)
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of each head (Qwen3.5: a quarter); None: all
    # Qwen3.5/Qwen3-Next: multi-token-prediction layers in the checkpoint (mtp.*)
    mtp_layers: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} kv heads")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ("default", "linear", "llama3", "freq_factors"):
            raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r} (supported: linear, llama3)")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"unsupported MLP activation {self.hidden_act!r} "
                                        "(supported: silu, gelu_tanh)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding window must be at least 1 token, got {self.sliding_window}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise UnsupportedModelError("a sliding-window layer index is out of range")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise UnsupportedModelError(f"{self.num_experts_per_tok} experts a token out "
                                            f"of {self.num_experts}")
            if self.moe_intermediate_size < 1 or self.router not in ROUTERS:
                raise UnsupportedModelError(f"an expert width of {self.moe_intermediate_size}, "
                                            f"router {self.router!r}")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers) or \
                (self.moe_layers and not self.num_experts):
            raise UnsupportedModelError("a mixture-of-experts layer index is out of range, or no experts")
        if any(not 0 <= i < self.num_layers for i in self.recurrent_layers) or \
                bool(self.recurrent_layers) != (self.recurrent is not None):
            raise UnsupportedModelError("a recurrent layer index is out of range, or no shape for them")
        if len(self.recurrent_layers) == self.num_layers:
            raise UnsupportedModelError("a hybrid model without attention layers is not supported")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise UnsupportedModelError(f"a rotary dimension of {self.rotary_dim} in heads of "
                                        f"{self.head_dim}")

    def mtp_config(self) -> ModelConfig:
        """The config of the model's MTP layer (models/mtp.py): one attention layer with the model's
        MLP kind (experts and shared expert in a mixture of experts)."""
        return replace(self, num_layers=1, recurrent=None, recurrent_layers=(), sliding_layers=(),
                       moe_layers=(0,) if self.num_experts else (), mtp_layers=0)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to its whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep K and V (all but a hybrid's recurrent layers)."""
        return tuple(i for i in range(self.num_layers) if i not in self.recurrent_layers)

    @property
    def state_bytes_per_seq(self) -> int:
        """The fixed recurrent state one sequence holds across a hybrid's recurrent layers (0 otherwise)."""
        return 0 if self.recurrent is None else len(self.recurrent_layers) * self.recurrent.state_bytes

    @cached_property
    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        """The layers of each KV group: the full-attention layers, then the windowed ones, in groups
        of one size (the gcd of their counts), so that one block of the pool can hold any group.
        A hybrid's recurrent layers are in none."""
        local = set(self.sliding_layers)
        full = [i for i in self.attention_layers if i not in local]
        windowed = [i for i in self.attention_layers if i in local]
        size = math.gcd(len(full), len(windowed))
        return tuple(tuple(layers[i:i + size]) for layers in (full, windowed)
                     for i in range(0, len(layers), size))

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        return tuple(self.window(group[0]) for group in self.kv_groups)

    def kv_place(self, layer: int) -> tuple[int, int]:
        """(group, index within the group) of a layer: its KV lives in the group's blocks, in the
        pool's tensor of that index."""
        for g, group in enumerate(self.kv_groups):
            if layer in group:
                return g, group.index(layer)
        raise IndexError(layer)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies across all (attention) layers."""
        return 2 * len(self.attention_layers) * self.kv_size * element_size

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: HFConfig | str | Path) -> ModelConfig:
        """From an HF config dict, a config.json path, or a model folder (models/hf_model_config.py)."""
        from phasewise.models.hf_model_config import config_from_hf     # it builds on this module

        return config_from_hf(config)


def clip_qkv(value: object, source: str) -> float | None:
    """OLMoE's clip_qkv: None, or a positive number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UnsupportedModelError(f"{source} must be a positive number, got {str(value)[:40]!r}")
    return float(value)
