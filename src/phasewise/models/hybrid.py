"""Qwen3.5 (dense and mixture of experts; Qwen3-Next loads into it, models/qwen3_next.py): Gated
DeltaNet layers beside gated full attention; `HybridLayer` and `HybridModel` serve LFM2 too.

Three of every four layers mix tokens with a Gated DeltaNet (`GatedDeltaNet`): q, k and v through a
short causal convolution, then the gated delta rule over a [Hv, dk, dv] state per sequence, a
gated RMSNorm and out_proj. Their memory is the sequence's state slot in the runner's cache
(`runner/kv_cache.py`), not KV blocks. The fourth is full attention over the paged KV cache with
an output gate (q_proj gives q and a sigmoid gate per head), RoPE on a quarter of each head, and
per-head q/k norms. Every norm but the DeltaNet's is (1 + w) in the checkpoint: we keep 1 + w.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.kernels import UsesKernels, applies
from phasewise.kernels.kernel_api import DecoderStack, Kernels, StackMixer
from phasewise.layers.attention import AttentionMetadata, LayerKV, paged_attention
from phasewise.layers.gated_delta import Conv1d, delta_net_mix, each_sequence
from phasewise.layers.linear import Linear
from phasewise.layers.norm import RMSNorm
from phasewise.layers.rotary import RotaryEmbedding
from phasewise.models.config import ModelConfig
from phasewise.models.layer_list import LayerList
from phasewise.models.llama import (KVCaches, LlamaForCausalLM, Shard, count_experts, embed, mlp,
                                   vocab_embedding)
from phasewise.models.recurrent import GatedDeltaNetShape
from phasewise.models.stack import StackAttention, StackRecurrent, build_stack, run_stack

class GatedAttention(UsesKernels, nn.Module):
    """Full attention whose output is gated per head by sigmoid(gate), q_proj giving [q | gate] for
    each head; RoPE on the first rotary_dim of each head, after per-head RMSNorms of q and k."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.cfg, self.rotary = cfg, rotary
        self.qkv_proj = Linear(cfg.hidden_size, 2 * cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.kv_group = cfg.kv_place(layer)[0]
        self.window: int | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv: LayerKV,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] → [T, hidden]."""
        cfg, meta = self.cfg, meta.for_group(self.kv_group)
        T, D, qs, kvs = x.shape[0], cfg.head_dim, cfg.q_size, cfg.kv_size
        qkv = self.qkv_proj(x)                                        # [T, 2 q_size + 2 kv_size]
        q_gate = qkv[:, :2 * qs].view(T, cfg.num_heads, 2 * D)        # per head: q, then its gate
        gate = q_gate[..., D:].reshape(T, qs)
        q = self.q_norm(q_gate[..., :D].reshape(-1, D)).view(T, cfg.num_heads, D)
        k = self.k_norm(qkv[:, 2 * qs:2 * qs + kvs].reshape(-1, D)).view(T, cfg.num_kv_heads, D)
        v = qkv[:, 2 * qs + kvs:].reshape(T, cfg.num_kv_heads, D)
        r = self.rotary.head_dim
        q_rot, k_rot = self.rotary(positions, q[..., :r], k[..., :r])
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)
        attn = paged_attention(q, k, v, kv, meta, self.kernels if applies(self.kernels, q) else None,
                               scale=D ** -0.5)                        # [T, q_size]
        return self.o_proj(attn * torch.sigmoid(gate))


class GatedNorm(nn.Module):
    """The DeltaNet output's per-head RMSNorm weight [dv] (times silu of the z gate: gated_rms_norm)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)


class GatedDeltaNet(UsesKernels, nn.Module):
    """Linear attention with the gated delta rule, over each sequence's state slot: the kernels'
    `delta_net_mix` where they are bound (once, at build time), else its PyTorch reference."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        shape = cfg.recurrent
        assert isinstance(shape, GatedDeltaNetShape)   # a Qwen3.5/Qwen3-Next config's
        self.shape, self.eps, h = shape, cfg.rms_norm_eps, cfg.hidden_size
        self.in_proj_qkv = Linear(h, shape.conv_dim)
        self.in_proj_z = Linear(h, shape.value_dim)
        self.in_proj_b = Linear(h, shape.num_v_heads)
        self.in_proj_a = Linear(h, shape.num_v_heads)
        self.conv1d = Conv1d(shape.conv_dim, shape.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(shape.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(shape.num_v_heads), requires_grad=False)
        self.norm = GatedNorm(shape.head_v_dim)
        self.out_proj = Linear(shape.value_dim, h)
        self._mix_weights: tuple[torch.Tensor, ...] | None = None   # the kernel's (bind_kernels)

    def mix_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv [C, K], -exp(A_log), dt_bias [Hv] and the gated norm's weight [dv], in fp32."""
        return (self.conv1d.weight[:, 0].float().contiguous(), -self.A_log.float().exp(),
                self.dt_bias.float(), self.norm.weight.float())

    def stack_projections(self) -> tuple[Linear, Linear, list[Linear]]:
        """The decoder stack's qkv and o of this layer, and its other linears."""
        return self.in_proj_qkv, self.out_proj, [self.in_proj_z, self.in_proj_b, self.in_proj_a]

    def stack_mixer(self) -> StackMixer:
        """This mixer as the decoder stack takes it (its projections in blocks)."""
        s = self.shape
        conv_w, neg_A, dt_bias, norm_w = (w.detach().contiguous() for w in self.mix_weights())
        return StackMixer(self.in_proj_z.packed_args(), self.in_proj_b.packed_args(),
                          self.in_proj_a.packed_args(), conv_w, neg_A, dt_bias, norm_w, s.num_k_heads,
                          s.num_v_heads, s.head_k_dim, s.head_v_dim,
                          s.tiled_v_heads, self.eps)

    def bind_kernels(self, kernels: Kernels | None) -> None:
        """Kernels, and the weights their mix takes, made once (none without kernels: the reference runs)."""
        self.kernels = kernels
        self._mix_weights = None if kernels is None else tuple(w.detach() for w in self.mix_weights())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> GatedDeltaNet:
        out = super()._apply(fn, recurse)
        self.bind_kernels(self.kernels)                # the weights may have moved: make them again
        return out

    def forward(self, x: torch.Tensor, state: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] → [T, hidden]; state: (conv [S, K-1, C], delta rule [S, Hv, dk, dv]), each
        sequence's slot (`meta.state_slots`) advanced past its tokens."""
        s, T = self.shape, x.shape[0]
        assert meta.state_slots is not None
        qkv, a, b, z = self.in_proj_qkv(x), self.in_proj_a(x), self.in_proj_b(x), self.in_proj_z(x)
        fast = self._mix_weights is not None and applies(self.kernels, qkv)
        mix = self.kernels.delta_net_mix if fast and self.kernels is not None else delta_net_mix
        weights = self._mix_weights if fast and self._mix_weights else self.mix_weights()
        conv_w, neg_A, dt_bias, norm_w = weights

        def run(rows: slice, lens: list[int], contexts: list[int], slots: list[int]) -> torch.Tensor:
            return mix(qkv[rows], a[rows], b[rows], conv_w, neg_A, dt_bias, state[0], state[1], lens,
                       contexts, slots, z=z[rows], norm_w=norm_w, eps=self.eps,
                       tiled=s.tiled_v_heads)   # [rows, Hv, dv]

        if not any(meta.state_snapshots or ()):                             # one call for the whole step
            y = run(slice(None), meta.query_lens, meta.context_lens, meta.state_slots)
        else:                                   # a verify step: each sequence apart, draft rows one at a time
            y = torch.empty(T, s.num_v_heads, s.head_v_dim, device=x.device)

            def step(start: int, m: int, context: int, slot: int) -> None:
                y[start:start + m] = run(slice(start, start + m), [m], [context], [slot])
            each_sequence(meta, state, step)
        return self.out_proj(y.reshape(T, s.value_dim).to(x.dtype))


class HybridLayer(nn.Module):
    """A hybrid's decoder layer: norm, token mixer (`mix`: a recurrent layer over its state slots, or
    attention over its KV), norm, MLP, the residual stream fused into the norms."""
    self_attn: StackAttention | None          # its attention (None in a recurrent layer)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp(cfg, layer, None)

    def mix(self, positions: torch.Tensor, x: torch.Tensor, memory: LayerKV,
            meta: AttentionMetadata) -> torch.Tensor:
        """The token mixer: x [T, hidden] → [T, hidden]."""
        raise NotImplementedError

    @property
    def recurrent(self) -> StackRecurrent | None:
        """Its recurrent mixer (None in an attention layer)."""
        raise NotImplementedError

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                memory: LayerKV, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mix(positions, x, memory, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class HybridDecoderLayer(HybridLayer):
    """Qwen3.5's and Qwen3-Next's: a Gated DeltaNet or gated attention."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__(cfg, layer)
        linear = layer in cfg.recurrent_layers
        self.linear_attn = GatedDeltaNet(cfg) if linear else None
        self.self_attn: GatedAttention | None = None if linear else GatedAttention(cfg, rotary, layer)

    @property
    def recurrent(self) -> GatedDeltaNet | None:
        return self.linear_attn

    def mix(self, positions: torch.Tensor, x: torch.Tensor, memory: LayerKV,
            meta: AttentionMetadata) -> torch.Tensor:
        if self.linear_attn is not None:
            return self.linear_attn(x, memory, meta)
        assert self.self_attn is not None
        return self.self_attn(positions, x, memory, meta)


class HybridModel(nn.Module):
    layer_class: Callable[[ModelConfig, RotaryEmbedding, int], HybridLayer] = HybridDecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if tp is not None:
            raise ValueError("hybrid models do not run with tensor parallelism yet")
        self.cfg = cfg
        self.embed_tokens = vocab_embedding(cfg, None)
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        self.layers: LayerList[HybridLayer] = LayerList(self.layer_class(cfg, self.rotary, i)
                                                        for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.expert_counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64, device="cpu") \
            if cfg.num_experts else None
        self.stack: DecoderStack | None = None   # the C++ decoder stack (build_stack), if it can run

    def build_stack(self, kernels: Kernels | None) -> None:
        """The C++ decoder stack of these (bound) layers where it can run them (models/stack.py), recurrent
        layers among them; the forward path is chosen here, once."""
        layers = list(self.layers)
        self.stack = build_stack(kernels, self.cfg, layers, self.norm.weight,
                                 mixers=[layer.recurrent for layer in layers], rotary=self.rotary)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches, keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] → hidden states [T, hidden], or of the rows `keep` [R] (ascending).
        kv_caches: per layer, its KV (attention) or its state (recurrent)."""
        x, residual = embed(self.embed_tokens, input_ids, self.cfg, None), None
        if self.stack is not None:                              # the whole step in one C++ call
            return run_stack(self.stack, self.cfg, x, positions, meta, kv_caches, keep, self.expert_counts)
        for layer, memory in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, memory, meta)
        if self.expert_counts is not None:
            count_experts(self.cfg, [layer.mlp for layer in self.layers], self.expert_counts)
        assert residual is not None
        if keep is not None:
            x, residual = x[keep], residual[keep]
        x, _ = self.norm(x, residual)
        return x
