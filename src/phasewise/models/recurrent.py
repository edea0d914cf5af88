"""The recurrent layers of hybrid models: their shape, the fixed state each sequence keeps in them,
and how an HF config describes them.

Qwen3.5 and Qwen3-Next interleave Gated DeltaNet layers (a linear attention whose memory is a
[Hv, dk, dv] matrix per sequence, after a short causal convolution whose memory is its last
kernel - 1 inputs) with gated full attention, three to one. Their state does not grow with the
context: a sequence holds the same bytes in them at 10 tokens and at 100,000.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject
    from phasewise.models.config import HFConfig

STATE_BYTES = 4                    # recurrent state is kept in fp32 whatever the weights


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetShape:
    """One Gated DeltaNet layer: q and k heads of head_k_dim, v heads of head_v_dim (each q/k head
    serves num_v_heads / num_k_heads v heads), a depthwise causal conv of conv_kernel taps over q, k, v.

    V head h reads q/k head h // (Hv / Hk) as Hugging Face orders them, or h % Hk when `tiled_v_heads`:
    llama.cpp's converter reorders Qwen3.5's v heads (their rows, gates, decays, conv channels and
    out_proj's columns) that way, and the file is used in its own order."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    tiled_v_heads: bool = False

    def __post_init__(self) -> None:
        if min(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim) < 1 or self.conv_kernel < 2:
            raise ValueError(f"a Gated DeltaNet shape of {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{self.num_v_heads} value heads are not a multiple of {self.num_k_heads} key heads")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """A sequence's convolution state: its last kernel - 1 inputs [K - 1, C]."""
        return self.conv_kernel - 1, self.conv_dim

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """A sequence's delta-rule state [Hv, dk, dv]."""
        return self.num_v_heads, self.head_k_dim, self.head_v_dim

    @property
    def state_bytes(self) -> int:
        """Bytes one sequence's state takes in one layer."""
        (k, c), (h, dk, dv) = self.conv_state_shape, self.recurrent_state_shape
        return (k * c + h * dk * dv) * STATE_BYTES


def hf_linear_layers(config: HFConfig) -> tuple[GatedDeltaNetShape, tuple[int, ...]]:
    """The Gated DeltaNet shape and which layers are linear, from a Qwen3.5/Qwen3-Next text config
    (`layer_types`, else every `full_attention_interval`-th layer is full attention, 4 by default)."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"config.json layer_types lists {len(types)} layers, not {layers}")
        linear = tuple(i for i, kind in enumerate(types) if kind == "linear_attention")
    else:
        every = config.get("full_attention_interval", 4)
        linear = tuple(i for i in range(layers) if (i + 1) % every)
    shape = GatedDeltaNetShape(num_k_heads=config.get("linear_num_key_heads", 16),
                               num_v_heads=config.get("linear_num_value_heads", 32),
                               head_k_dim=config.get("linear_key_head_dim", 128),
                               head_v_dim=config.get("linear_value_head_dim", 128),
                               conv_kernel=config.get("linear_conv_kernel_dim", 4))
    return shape, linear


class HybridFields(TypedDict, total=False):
    """ModelConfig's hybrid fields, as a config gives them (none for an attention-only model)."""
    linear_attention: GatedDeltaNetShape
    linear_layers: tuple[int, ...]
    attn_output_gate: bool
    rotary_dim: int


def hf_hybrid(config: HFConfig, rope: JsonObject) -> HybridFields:
    """A Qwen3.5 config's linear layers, attention's output gate and partial rotary dimension (a
    quarter of the head unless `partial_rotary_factor` says otherwise)."""
    shape, linear = hf_linear_layers(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.25
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ValueError(f"config.json partial_rotary_factor must be in (0, 1], got {str(partial)[:40]!r}")
    return HybridFields(linear_attention=shape, linear_layers=linear, attn_output_gate=True,
                        rotary_dim=int(head_dim * partial))
