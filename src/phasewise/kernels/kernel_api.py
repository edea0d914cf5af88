"""Kernels: the typed surface of the compiled `KernelSet` (csrc/bindings.cpp), as the Python side
uses it.

Every place that takes the engine's kernels takes `Kernels | None` (None: the PyTorch reference
path). Shapes and formats are documented where each op is declared (csrc/kernels.h).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence, Union

from torch import Tensor

# A packed weight as the ops take it: (format id, rows, blocks, scale or None); a fused projection's
# further parts (csrc/kernel_set.h PartArgs)
WeightPart = tuple[int, int, Tensor, Union[Tensor, None]]
# one linear layer's blocks as quant_linear and the decoder stack take them
# (decoder_stack.h QuantLinearArgs): (format id, rows, blocks, scale, bias, u5 tiles, further parts)
PackedLinearArgs = tuple[int, int, Tensor, Union[Tensor, None], Union[Tensor, None], int,
                         Sequence[WeightPart]]


class StackSparse(NamedTuple):
    """A sparse layer's experts as the decoder stack takes them (csrc/decoder_stack.h SPARSE_FIELDS)."""
    router: Tensor                         # [E, H] fp32
    gate: WeightPart                       # the stacked experts' gate, up and down
    up: WeightPart
    down: WeightPart
    k: int
    renorm: bool                           # the chosen weights renormalised
    topk_softmax: bool                     # top-k before the softmax
    shared_gate: Tensor | None             # [1, H]: Qwen2-MoE's shared expert's gate


class StackMixer(NamedTuple):
    """A recurrent layer's token mixer as the decoder stack takes it (csrc/decoder_stack.h MIXER_FIELDS):
    a Gated DeltaNet's (the layer's qkv its in_proj_qkv, o its out_proj), or LFM2's short conv (qkv its
    in_proj, o its out_proj; z, b, a, neg_A, dt_bias, norm None)."""
    z: PackedLinearArgs | None             # [Hv dv] the output gate's projection
    b: PackedLinearArgs | None             # [Hv] the write strength's
    a: PackedLinearArgs | None             # [Hv] the decay's
    conv: Tensor                           # [C, K] the causal conv's taps (a short conv's [H, K])
    neg_A: Tensor | None                   # [Hv] -exp(A_log)
    dt_bias: Tensor | None                 # [Hv]
    norm: Tensor | None                    # [dv] the gated RMSNorm's weight
    Hk: int
    Hv: int
    dk: int
    dv: int
    tiled: bool                            # v head h reads q/k head h % Hk
    eps: float


class StackLayer(NamedTuple):
    """One decoder layer as the C++ stack takes it (csrc/decoder_stack.h LAYER_SPEC_FIELDS: the same
    fields in the same order, tests/test_decoder_stack.py checks them)."""
    input_norm: Tensor
    post_attention_norm: Tensor
    qkv: PackedLinearArgs
    o: PackedLinearArgs
    gate_up: PackedLinearArgs | None       # the dense MLP (a sparse layer's shared expert, or None)
    down: PackedLinearArgs | None
    q_norm: Tensor | None                  # [D] per head, or [Hq D] over all of q (OLMoE)
    k_norm: Tensor | None
    pre_ffn_norm: Tensor | None            # Gemma 3's norms around the MLP
    post_ffn_norm: Tensor | None
    cos: Tensor | None                     # this layer's RoPE tables [P, D / 2] (None: the stack's)
    sin: Tensor | None
    kv_group: int
    window: int                            # 0: none
    sparse: StackSparse | None             # the layer's experts (None: a dense layer)
    mixer: StackMixer | None = None        # a recurrent layer's mixer in place of attention
    attn_gate: bool = False                # Qwen3.5's gated attention: qkv gives [q head, its gate]..., k, v


class DecoderStack(Protocol):
    """A Llama-family model's decoder layers on the kernels (csrc/decoder_stack.cpp)."""

    def forward(self, x: Tensor, positions: Tensor, slots: Sequence[Tensor], kv: Sequence[Sequence[Tensor]],
                tables: Sequence[Tensor], row_seq: Sequence[Tensor], row_len: Sequence[Tensor],
                block_size: int, keep: Tensor | None = None, expert_counts: Tensor | None = None,
                sequences: Tensor | None = None, snapshots: Tensor | None = None,
                kv_seqs: Tensor | None = None) -> Tensor: ...


class Kernels(Protocol):
    """The compiled CPU ops of one ISA level (`build.load()`); those bindings.cpp declares without
    argument names take theirs by position only."""

    @property
    def isa(self) -> str: ...

    def paged_attention(self, q: Tensor, kv: Sequence[Tensor], block_tables: Tensor, row_seq: Tensor,
                        row_len: Tensor, seqs: Tensor, block_size: int, scale: float,
                        fresh: Tensor | None = None, window: int = 0,
                        fresh_v: Tensor | None = None) -> Tensor: ...

    def rope_and_cache(self, qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, kv: Sequence[Tensor],
                       slots: Tensor, Hq: int, Hkv: int, block_tables: Tensor, seqs: Tensor,
                       block_size: int) -> list[Tensor]: ...

    def write_kv(self, k: Tensor, v: Tensor, kv: Sequence[Tensor], slots: Tensor, block_tables: Tensor,
                 seqs: Tensor, block_size: int) -> None: ...

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float,
                 residual: Tensor | None = None) -> list[Tensor]: ...

    def silu_and_mul(self, x: Tensor, gelu: bool = False) -> Tensor: ...

    def argmax_rows(self, x: Tensor, /) -> Tensor: ...

    def mask_rows(self, x: Tensor, words: Tensor, /) -> Tensor: ...

    def quantize_activations(self, x: Tensor, /) -> list[Tensor]: ...

    def int8_peak_gops(self, iters: int = 20_000_000) -> float: ...

    def quant_linear(self, x: Tensor, fmt: int, N: int, blocks: Tensor, scale: Tensor | None = None,
                     bias: Tensor | None = None, u5_tiles: int = 0,
                     rest: Sequence[WeightPart] = ()) -> Tensor: ...

    def repack_gguf(self, type: int, raw: Tensor, N: int, K: int) -> list[Tensor]: ...

    def expert_mlp(self, x: Tensor, ids: Tensor, weights: Tensor, gate: WeightPart, up: WeightPart,
                   down: WeightPart, experts: int, gelu: bool = False) -> Tensor: ...

    def float_linear(self, x: Tensor, weight: Tensor) -> Tensor: ...

    def moe_route(self, logits: Tensor, k: int, renorm: bool, topk_softmax: bool = False) -> list[Tensor]: ...

    def delta_net_mix(self, qkv: Tensor, a: Tensor, b: Tensor, conv_w: Tensor, neg_A: Tensor, dt_bias: Tensor,
                      conv_states: Tensor, states: Tensor, query_lens: Sequence[int],
                      context_lens: Sequence[int], slots: Sequence[int], z: Tensor | None = None,
                      norm_w: Tensor | None = None, eps: float = 1e-6, tiled: bool = False) -> Tensor: ...

    def dequantize_rows(self, ids: Tensor, fmt: int, N: int, blocks: Tensor,
                        scale: Tensor | None = None) -> Tensor: ...

    def decoder_stack(self, layers: Sequence[StackLayer], final_norm: Tensor, cos: Tensor, sin: Tensor,
                      Hq: int, Hkv: int, D: int, eps: float, scale: float = 0.0,
                      gelu: bool = False) -> DecoderStack: ...

    def stack_fields(self) -> tuple[list[str], list[str], list[str]]: ...
