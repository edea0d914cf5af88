"""Memory arithmetic: KV-cache bytes per token and per sequence, sequences that fit, weight sizes.

A hybrid (Qwen3.5, Qwen3-Next, LFM2) keeps K and V only in its attention layers; its recurrent
layers hold a fixed state per sequence (`state_bytes`), the same at any context length: a sequence's
memory is KV per token x context + state."""

from __future__ import annotations

from dataclasses import dataclass

from phasewise.models.config import ModelConfig

BYTES_PER_ELEMENT = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
# `memory --kv-dtype`: the engine's names (auto: int8 where its kernels run; model: the float cache of
# fp32 weights) and float widths other engines keep, for comparison
KV_DTYPES = {"auto": "int8", "model": "fp32", "int8": "int8", "int4": "int4", "fp32": "fp32", "bf16": "bf16",
             "fp16": "fp16"}
MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: layer count, KV heads, head size, and the parameter count."""
    layers: int
    kv_heads: int
    head_dim: int
    params: int | None = None
    window: int | None = None       # sliding window of the local layers (Gemma 3, Mistral)
    window_layers: int = 0          # how many layers have it
    state_bytes: int = 0            # a hybrid's recurrent state per sequence (fp32, constant in context)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        """layers: those with K and V (a hybrid's attention layers)."""
        return cls(len(cfg.attention_layers), cfg.num_kv_heads, cfg.head_dim, parameter_count(cfg),
                   cfg.sliding_window, len(cfg.sliding_layers), cfg.state_bytes_per_seq)

    def windowed_kv_bytes_per_sequence(self, context_len: int, dtype: str = "fp16",
                                       block_size: int = 16) -> float:
        """KV one sequence holds in phasewise's pool once it has computed context_len tokens: whole
        blocks, the full layers all of them, the windowed layers from the block of the oldest key
        the next token sees (core/kv_cache_manager.py frees the rest)."""
        per_layer_block = self.kv_bytes_per_token(dtype) / self.layers * block_size
        blocks = -(-context_len // block_size)
        local = blocks - max(0, context_len - (self.window or context_len) + 1) // block_size
        full = self.layers - self.window_layers
        return per_layer_block * (full * blocks + self.window_layers * local) + self.state_bytes

    def kv_bytes_per_token(self, dtype: str = "fp16") -> float:
        """2 (K and V) × layers × kv_heads × head_dim × bytes per element; int8 adds what phasewise's int8
        cache holds beside (runner/kv_cache.py): V's 4-byte scale per KV head, K's midpoint and step per
        channel for every 16 tokens (head_dim / 2 bytes a token); int4 V's fp16 scale per 32 values and K's
        fp16 minimum and step per channel for every 64 tokens (head_dim / 8 bytes a token)."""
        scales = {"int8": 4 + self.head_dim / 2, "int4": self.head_dim / 8}.get(dtype, 0)
        return self.layers * self.kv_heads * (2 * self.head_dim * BYTES_PER_ELEMENT[dtype] + scales)

    def kv_bytes_per_sequence(self, context_len: int, dtype: str = "fp16") -> float:
        """K and V of context_len tokens, plus a hybrid's recurrent state."""
        return self.kv_bytes_per_token(dtype) * context_len + self.state_bytes

    def sequences_that_fit(self, memory_bytes: float, context_len: int, dtype: str = "fp16",
                           weights_dtype: str | None = None) -> int:
        """Full-length sequences whose KV fits in memory_bytes (after the weights, if weights_dtype is
        given)."""
        free = memory_bytes - (self.weight_bytes(weights_dtype) if weights_dtype else 0)
        return max(0, int(free // self.kv_bytes_per_sequence(context_len, dtype)))

    def weight_bytes(self, dtype: str) -> float:
        if self.params is None:
            raise ValueError("the parameter count is unknown (give --params or a model)")
        return self.params * BYTES_PER_ELEMENT[dtype]


def mlp_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Layer `layer`'s MLP parameters: dense, or a mixture of experts' router, experts and shared
    expert (`active`: only the experts one token uses)."""
    h = cfg.hidden_size
    if layer not in cfg.moe_layers:
        return 3 * h * cfg.intermediate_size
    experts = cfg.num_experts_per_tok if active else cfg.num_experts
    shared = cfg.shared_expert_intermediate_size
    router = cfg.num_experts * h
    return router + experts * 3 * h * cfg.moe_intermediate_size + (3 * h * shared + h if shared else 0)


def recurrent_params(cfg: ModelConfig) -> int:
    """One recurrent layer's token mixer's parameters (a Gated DeltaNet's, LFM2's short conv's), 0
    without them."""
    return 0 if cfg.recurrent is None else cfg.recurrent.mixer_params(cfg.hidden_size)


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of a Llama-family model (the output head counted once when tied), every expert's;
    a hybrid's recurrent layers in place of attention."""
    h, v = cfg.hidden_size, cfg.vocab_size
    q_out = cfg.q_size * (2 if cfg.attn_output_gate else 1)     # Qwen3.5's q_proj gives its gate too
    attn = h * (q_out + 2 * cfg.kv_size) + cfg.q_size * h
    if cfg.attention_bias:
        attn += cfg.q_size + 2 * cfg.kv_size
    per_layer = attn + 2 * h
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    if cfg.qk_norm_whole:
        per_layer += cfg.q_size + cfg.kv_size
    if cfg.architecture == "gemma3":       # norms after attention and after the MLP too
        per_layer += 2 * h
    mlps = sum(mlp_params(cfg, layer) for layer in range(cfg.num_layers))
    mixers = len(cfg.attention_layers) * per_layer + \
        len(cfg.recurrent_layers) * (recurrent_params(cfg) + 2 * h)
    return v * h + mixers + mlps + h + (0 if cfg.tie_word_embeddings else v * h)


def report(shape: ModelShape, context_len: int, memory_gib: float, kv_dtype: str = "fp16") -> list[str]:
    """The lines `phasewise memory` prints."""
    per_token = shape.kv_bytes_per_token(kv_dtype)
    scales = " + scales" if kv_dtype in ("int8", "int4") else ""
    lines = [
        f"KV cache ({kv_dtype}): {per_token / MIB:.4g} MiB per token "
        f"(2 x {shape.layers} layers x {shape.kv_heads} kv heads x {shape.head_dim} head dim x "
        f"{BYTES_PER_ELEMENT[kv_dtype]:g} bytes{scales})",
        f"one sequence of {context_len} tokens: "
        f"{shape.kv_bytes_per_sequence(context_len, kv_dtype) / MIB:,.1f} MiB"
        + (f" (with {shape.state_bytes / MIB:,.1f} MiB of recurrent state, the same at any length)"
           if shape.state_bytes else ""),
        f"sequences of {context_len} tokens in {memory_gib:g} GiB: "
        f"{shape.sequences_that_fit(memory_gib * GIB, context_len, kv_dtype)} (KV only)",
    ]
    if shape.window and shape.window_layers:
        full = shape.kv_bytes_per_sequence(context_len, kv_dtype)
        bounded = shape.windowed_kv_bytes_per_sequence(context_len, kv_dtype)
        lines.append(f"sliding window: {shape.window_layers} of {shape.layers} layers see the last "
                     f"{shape.window} tokens; the pool frees the blocks behind the window, so one sequence "
                     f"holds {bounded / MIB:,.1f} MiB ({bounded / full:.0%}, blocks of 16 tokens) and "
                     f"{int(memory_gib * GIB // bounded)} fit in {memory_gib:g} GiB")
    if shape.params is not None:
        lines.append(f"weights ({shape.params / 1e6:,.1f} M parameters): " + ", ".join(
            f"{d} {shape.weight_bytes(d) / MIB:,.0f} MiB" for d in ("fp32", "bf16", "int8", "int4")))
    return lines


HYBRID_CONTEXTS = (4096, 32768, 131072)


def hybrid_comparison(shape: ModelShape, all_layers: int, kv_dtype: str = "fp16") -> list[str]:
    """A hybrid's memory per sequence at 4k, 32k and 128k tokens against an attention-only model of the
    same size (K and V in all `all_layers` layers, no recurrent state)."""
    dense = ModelShape(all_layers, shape.kv_heads, shape.head_dim)
    lines = [f"a hybrid: K and V in {shape.layers} of {all_layers} layers, {shape.state_bytes / MIB:,.1f} "
             "MiB of recurrent state in the rest; one sequence against an attention-only "
             "model of the same size:"]
    for n in HYBRID_CONTEXTS:
        ours, theirs = shape.kv_bytes_per_sequence(n, kv_dtype), dense.kv_bytes_per_sequence(n, kv_dtype)
        lines.append(f"  {n // 1024:>4}k tokens: {ours / MIB:>10,.1f} MiB against {theirs / MIB:>10,.1f} MiB "
                     f"({ours / theirs:.0%})")
    return lines
