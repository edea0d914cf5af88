"""Kernels: the typed surface of the compiled `KernelSet` (csrc/bindings.cpp), as the Python side uses it.

Every place that takes the engine's kernels takes `Kernels | None` (None: the PyTorch reference
path). Shapes and formats are documented where each op is declared (csrc/kernels.h).
"""

from __future__ import annotations

from typing import Protocol, Sequence, Union

from torch import Tensor

# A packed weight as the ops take it: (format id, rows, blocks, scale); a fused projection's further parts
WeightPart = tuple[int, int, Tensor, Tensor]
# one linear layer's blocks as quant_linear and the decoder stack take them:
# (format id, rows, blocks, scale, bias, u5 tiles, further parts)
PackedLinearArgs = tuple[int, int, Tensor, Tensor, Union[Tensor, None], int, Sequence[WeightPart]]
# one decoder layer: its two norm weights, then qkv, o, gate_up, down (a sparse layer's shared expert, or None)
StackLayer = tuple[Tensor, Tensor, PackedLinearArgs, PackedLinearArgs, Union[PackedLinearArgs, None],
                   Union[PackedLinearArgs, None]]
# a layer's extras: q/k norm weights, the feed-forward sandwich norms (None where the model has none),
# RoPE cos and sin, its KV group and window
StackExtras = tuple[Union[Tensor, None], Union[Tensor, None], Union[Tensor, None], Union[Tensor, None], Tensor,
                    Tensor, int, int]
# a sparse layer: router [E, H] fp32, the stacked gate, up and down, k, renormalised, top-k before the
# softmax, the shared expert's gate [1, H] (or None)
StackSparse = tuple[Tensor, WeightPart, WeightPart, WeightPart, int, bool, bool, Union[Tensor, None]]


class DecoderStack(Protocol):
    """A Llama-family model's decoder layers on the kernels (csrc/decoder_stack.cpp)."""

    def forward(self, x: Tensor, positions: Tensor, slots: Sequence[Tensor], kv: Sequence[Sequence[Tensor]],
                tables: Sequence[Tensor], row_seq: Sequence[Tensor], row_len: Sequence[Tensor], block_size: int,
                keep: Tensor | None = None, expert_counts: Tensor | None = None) -> Tensor: ...


class Kernels(Protocol):
    """The compiled CPU ops of one ISA level (`build.load()`)."""

    @property
    def isa(self) -> str: ...

    def paged_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, row_seq: Tensor,
                        row_len: Tensor, block_size: int, scale: float, k_scale: Tensor | None = None,
                        v_scale: Tensor | None = None, window: int = 0) -> Tensor: ...

    def rope_and_cache(self, qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                       v_cache: Tensor, slots: Tensor, Hq: int, Hkv: int, k_scale: Tensor | None = None,
                       v_scale: Tensor | None = None) -> list[Tensor]: ...

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> list[Tensor]: ...

    def silu_and_mul(self, x: Tensor, gelu: bool = False) -> Tensor: ...

    def argmax_rows(self, x: Tensor) -> Tensor: ...

    def mask_rows(self, x: Tensor, words: Tensor) -> Tensor: ...

    def quantize_activations(self, x: Tensor) -> list[Tensor]: ...

    def int8_peak_gops(self, iters: int = 20_000_000) -> float: ...

    def quant_linear(self, x: Tensor, fmt: int, N: int, blocks: Tensor, scale: Tensor | None = None,
                     bias: Tensor | None = None, u5_tiles: int = 0, rest: Sequence[WeightPart] = ()) -> Tensor: ...

    def repack_gguf(self, type: int, raw: Tensor, N: int, K: int) -> list[Tensor]: ...

    def expert_mlp(self, x: Tensor, ids: Tensor, weights: Tensor, gate: WeightPart, up: WeightPart, down: WeightPart,
                   experts: int, gelu: bool = False) -> Tensor: ...

    def float_linear(self, x: Tensor, weight: Tensor) -> Tensor: ...

    def moe_route(self, logits: Tensor, k: int, renorm: bool, topk_softmax: bool = False) -> list[Tensor]: ...

    def dequantize_rows(self, ids: Tensor, fmt: int, N: int, blocks: Tensor, scale: Tensor | None = None) -> Tensor: ...

    def decoder_stack(self, layers: Sequence[StackLayer], final_norm: Tensor, cos: Tensor, sin: Tensor, Hq: int,
                      Hkv: int, D: int, eps: float, extras: Sequence[StackExtras] = (), scale: float = 0.0,
                      gelu: bool = False, sparse: Sequence[StackSparse | None] = ()) -> DecoderStack: ...
