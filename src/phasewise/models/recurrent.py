"""The recurrent layers of hybrid models: their shape, the fixed state each sequence keeps in them,
and how an HF config describes them.

Qwen3.5 and Qwen3-Next interleave Gated DeltaNet layers (a linear attention whose memory is a
[Hv, dk, dv] matrix per sequence, after a short causal convolution whose memory is its last
kernel - 1 inputs) with gated full attention, three to one. LFM2 interleaves short gated
convolutions (whose memory is their last L_cache - 1 inputs) with attention. Their state does not
grow with the context: a sequence holds the same bytes in them at 10 tokens and at 100,000.

A recurrent layer kind (`RecurrentShape`) declares its per-sequence state tensors (`state_shapes`,
fp32); the runner's cache (runner/kv_cache.py), state checkpoints, the engine's memory budget and
the lab's arithmetic know nothing more of it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject
    from phasewise.models.hf_config import HFConfig

STATE_BYTES = 4                    # recurrent state is kept in fp32 whatever the weights


class RecurrentShape(ABC):
    """One kind of recurrent layer: the state tensors a sequence keeps in each such layer."""

    @property
    @abstractmethod
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A sequence's state tensors in one layer (fp32), in the order the layer takes them."""

    @abstractmethod
    def mixer_params(self, hidden: int) -> int:
        """Parameters of one such layer's token mixer (its norms aside) in a model of this width."""

    @property
    def state_bytes(self) -> int:
        """Bytes one sequence's state takes in one layer."""
        return sum(math.prod(shape) for shape in self.state_shapes) * STATE_BYTES


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetShape(RecurrentShape):
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
        if min(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim) < 1 or \
                self.conv_kernel < 2:
            raise ValueError(f"a Gated DeltaNet shape of {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{self.num_v_heads} value heads are not a multiple of "
                             f"{self.num_k_heads} key heads")

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
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The convolution's state, then the delta rule's (as `GatedDeltaNet.forward` takes them)."""
        return self.conv_state_shape, self.recurrent_state_shape

    def mixer_params(self, hidden: int) -> int:
        """in_proj (q, k, v, z, b, a), conv taps, dt_bias, A_log, the gated norm and out_proj."""
        return hidden * (self.conv_dim + self.value_dim + 2 * self.num_v_heads) + \
            self.conv_dim * self.conv_kernel + 2 * self.num_v_heads + self.head_v_dim + \
            self.value_dim * hidden


@dataclass(frozen=True, kw_only=True)
class ShortConvShape(RecurrentShape):
    """One LFM2 short-convolution layer over `channels` (the model's width): in_proj gives B, C and x,
    a depthwise causal conv of `taps` (L_cache) taps runs over B * x, out_proj maps C * conv back."""
    channels: int
    taps: int

    def __post_init__(self) -> None:
        if self.channels < 1 or self.taps < 2:
            raise ValueError(f"a short convolution of {self.taps} taps over {self.channels} channels")

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The convolution's last taps - 1 inputs [L - 1, H]."""
        return ((self.taps - 1, self.channels),)

    def mixer_params(self, hidden: int) -> int:
        """in_proj [3 H, H], the conv taps [H, L] and out_proj [H, H] (no biases)."""
        return 4 * hidden * self.channels + self.channels * self.taps


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
    recurrent: RecurrentShape
    recurrent_layers: tuple[int, ...]
    attn_output_gate: bool
    rotary_dim: int
    mtp_layers: int


def hf_hybrid(config: HFConfig, rope: JsonObject) -> HybridFields:
    """A Qwen3.5/Qwen3-Next config's linear layers, attention's output gate and partial rotary
    dimension (a quarter of the head unless `partial_rotary_factor` says otherwise)."""
    shape, linear = hf_linear_layers(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.25
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ValueError(f"config.json partial_rotary_factor must be in (0, 1], got {str(partial)[:40]!r}")
    mtp = config.get("mtp_num_hidden_layers") or config.get("num_nextn_predict_layers") or 0
    if not isinstance(mtp, int) or mtp < 0:
        raise ValueError(f"config.json mtp_num_hidden_layers must be a count, got {str(mtp)[:40]!r}")
    return HybridFields(recurrent=shape, recurrent_layers=linear, attn_output_gate=True,
                        rotary_dim=int(head_dim * partial), mtp_layers=mtp)


def hf_lfm2(config: HFConfig) -> HybridFields:
    """An LFM2 config's short-conv layers: those `layer_types` calls "conv" (else those not in
    `full_attn_idxs`; transformers' default is every layer attention)."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if not types:
        full = config.get("full_attn_idxs")
        types = ["full_attention" if full is None or i in full else "conv" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"config.json layer_types lists {len(types)} layers, not {layers}")
    if config.get("conv_bias"):
        raise ValueError("LFM2 with conv_bias (biases on the short convolutions) is not supported")
    conv = tuple(i for i, kind in enumerate(types) if kind == "conv")
    return HybridFields(recurrent=ShortConvShape(channels=config["hidden_size"],
                                                 taps=config.get("conv_L_cache", 3)),
                        recurrent_layers=conv) if conv else HybridFields()


LFM2_THETA = 1000000.0             # LFM2's RoPE base when its config gives none (transformers' default)


def hf_lfm2_config(config: HFConfig) -> HFConfig:
    """An LFM2 config in the keys the other families use: its MLP width by transformers' rule (2/3 of
    `intermediate_size` (alias `block_ff_dim`) when `block_auto_adjust_ff_dim`, then times
    `block_ffn_dim_multiplier` rounded up to `block_multiple_of`), `norm_eps` as rms_norm_eps,
    tied embeddings unless it says otherwise, its RoPE base."""
    width = config.get("block_ff_dim") or config.get("intermediate_size") or 12288
    if config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            every = config.get("block_multiple_of", 256)
            width = -(-int(multiplier * width) // every) * every
    out = config.copy()
    out["intermediate_size"], out["rms_norm_eps"] = width, config.get("norm_eps", 1e-5)
    out["tie_word_embeddings"] = bool(config.get("tie_embedding", config.get("tie_word_embeddings", True)))
    rope = config.get("rope_parameters") or {}
    if not config.get("rope_theta") and not rope.get("rope_theta"):
        out["rope_theta"] = LFM2_THETA
    return out
