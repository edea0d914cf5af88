"""Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3; with experts: Qwen2-MoE, Qwen3-MoE,
Mixtral, OLMoE, whose sparse MLP is models/moe.py's) in plain PyTorch.

Tokens of all sequences in a step are flattened into one batch [T]; attention
reads the paged KV cache through `AttentionMetadata`. The KV tensors are passed
to `forward` explicitly, one (k, v) pair per layer. With tensor parallelism (`tp`) the
config gives one rank's heads and MLP width (loading/sharding.py): o_proj and down_proj
end in an all-reduce, the embedding and output head hold a part of the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.kernels import UsesKernels, applies
from phasewise.kernels.kernel_api import DecoderStack, Kernels
from phasewise.layers.attention import AttentionMetadata, LayerKV, paged_attention
from phasewise.layers.embedding import Embedding
from phasewise.layers.linear import Linear
from phasewise.layers.norm import RMSNorm
from phasewise.layers.rotary import RotaryEmbedding
from phasewise.models.config import ModelConfig
from phasewise.models.layer_list import LayerList
from phasewise.models.moe import SparseMoeBlock, expert_shard_names, load_moe_weight
from phasewise.models.stack import build_stack, run_stack

KVCaches = list[LayerKV]  # per layer: k, v as [num_slots, Hkv, D] (int8: and the rest, LayerKV)


class LlamaAttention(UsesKernels, nn.Module):
    """Grouped-query attention over the paged cache; with `cfg.qk_norm` (Qwen3, Gemma 3) each q and k
    head is RMS-normed before RoPE, with `cfg.qk_norm_whole` (OLMoE) all of q and all of k, then
    clamped to `cfg.clip_qkv` with v; a layer in `cfg.sliding_layers` sees only its window."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int = 0,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.window = cfg.window(layer)
        self.kv_group = cfg.kv_place(layer)[0]
        self.scale = cfg.query_scale or cfg.head_dim ** -0.5
        if cfg.qk_norm or cfg.qk_norm_whole:
            self.q_norm = RMSNorm(cfg.q_size if cfg.qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.kv_size if cfg.qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] → [T, hidden]."""
        cfg, meta = self.cfg, meta.for_group(self.kv_group)
        qkv = self.qkv_proj(x)                            # [T, q_size + 2 kv_size]
        if cfg.qk_norm:                                   # each q and k head normed in place, before RoPE
            T, q_size, kv_size, D = qkv.shape[0], cfg.q_size, cfg.kv_size, cfg.head_dim
            qkv[:, :q_size] = self.q_norm(qkv[:, :q_size].reshape(-1, D)).view(T, q_size)
            keys = qkv[:, q_size:q_size + kv_size]
            qkv[:, q_size:q_size + kv_size] = self.k_norm(keys.reshape(-1, D)).view(T, kv_size)
        if cfg.qk_norm_whole:                             # OLMoE: all of q, all of k
            qkv[:, :cfg.q_size] = self.q_norm(qkv[:, :cfg.q_size].contiguous())
            keys = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size]
            qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size] = self.k_norm(keys.contiguous())
        if cfg.clip_qkv is not None:
            qkv.clamp_(-cfg.clip_qkv, cfg.clip_qkv)
        if applies(self.kernels, qkv):                        # split, rotate, write k and v: one op
            rows = meta.kernel_rows
            q, k = self.kernels.rope_and_cache(qkv, positions, self.rotary.cos, self.rotary.sin, list(kv),
                                               meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads,
                                               rows.tables, rows.seqs, meta.block_size)
            v = qkv[:, cfg.q_size + cfg.kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            return self._out(paged_attention(q, k, v, kv, meta, self.kernels, written=True,
                                             window=self.window, scale=self.scale))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim)   # [T, Hq, D]
        k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)   # [T, Hkv, D]
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotary(positions, q, k)
        return self._out(paged_attention(q, k, v, kv, meta,
                                         self.kernels if applies(self.kernels, q) else None,
                                         window=self.window, scale=self.scale))

    def _out(self, attn: torch.Tensor) -> torch.Tensor:
        """[T, q_size] → [T, hidden]: o_proj, summed over the ranks' heads."""
        out = self.o_proj(attn)
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(UsesKernels, nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, width: int | None = None) -> None:
        """width: the MLP's intermediate size (default cfg.intermediate_size; Qwen2-MoE's shared expert)."""
        super().__init__()
        self.tp = tp
        width = width or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * width, bias=False)
        self.down_proj = Linear(width, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                    # [T, 2 I]
        if applies(self.kernels, gate_up):
            act = self.kernels.silu_and_mul(gate_up, gelu=self.gelu)
        else:
            gate, up = gate_up.chunk(2, dim=-1)           # [T, I] each
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        out = self.down_proj(act)                         # [T, hidden]: this rank's share of the sum
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int = 0,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp(cfg, layer, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def mlp(cfg: ModelConfig, layer: int, tp: TensorParallel | None) -> LlamaMLP | SparseMoeBlock:
    """Layer `layer`'s MLP: dense, or the sparse mixture of experts (with Qwen2-MoE's shared expert)."""
    if layer not in cfg.moe_layers:
        return LlamaMLP(cfg, tp)
    shared = cfg.shared_expert_intermediate_size
    return SparseMoeBlock(cfg, LlamaMLP(cfg, None, shared) if shared else None, tp)


def count_experts(cfg: ModelConfig, mlps: list[LlamaMLP | SparseMoeBlock], counts: torch.Tensor) -> None:
    """Each sparse layer's (row, choice) pairs per expert in the last forward, into counts [L, E]."""
    for i in cfg.moe_layers:
        block = mlps[i]
        assert isinstance(block, SparseMoeBlock) and block.choices is not None   # ran just now
        counts[i] = block.choices


def vocab_embedding(cfg: ModelConfig, tp: TensorParallel | None) -> Embedding:
    """The token table (this rank's part of the vocabulary, with tp)."""
    return Embedding(cfg.vocab_size if tp is None else tp.padded(cfg.vocab_size), cfg.hidden_size)


def embed(table: Embedding, ids: torch.Tensor, cfg: ModelConfig, tp: TensorParallel | None) -> torch.Tensor:
    return table(ids) if tp is None else tp.embed(table, ids, cfg.vocab_size)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = vocab_embedding(cfg, tp)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers: LayerList[LlamaDecoderLayer] = LayerList(LlamaDecoderLayer(cfg, rotary, i, tp)
                                                              for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.stack: DecoderStack | None = None   # the C++ decoder stack (build_stack), if it can run
        # a mixture of experts: each layer's (row, choice) pairs per expert in the last forward [L, E]
        self.expert_counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64, device="cpu") \
            if cfg.num_experts else None

    def build_stack(self, kernels: Kernels | None) -> None:
        """The C++ decoder stack of these (bound) layers where it can run them (models/stack.py); not
        with tp (its layers' all-reduces run between the Python layers' ops). None: the Python layers."""
        self.stack = None if self.tp is not None else \
            build_stack(kernels, self.cfg, list(self.layers), self.norm.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches, keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] → hidden states [T, hidden], or of the rows `keep` [R] (ascending)."""
        x, residual = embed(self.embed_tokens, input_ids, self.cfg, self.tp), None
        if self.stack is not None:                              # the whole step in one C++ call
            return run_stack(self.stack, self.cfg, x, positions, meta, kv_caches, keep, self.expert_counts)
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv, meta)
        if self.expert_counts is not None:                      # what each router chose, as the stack counts
            count_experts(self.cfg, [layer.mlp for layer in self.layers], self.expert_counts)
        assert residual is not None                             # a model has layers
        if keep is not None:
            x, residual = x[keep], residual[keep]
        x, _ = self.norm(x, residual)
        return x


# a part of a fused parameter: "q"/"k"/"v" of qkv_proj, 0/1 of gate_up_proj
Shard = Literal["q", "k", "v", 0, 1]
# checkpoint name part → (our fused parameter, shard)
_PACKED: dict[str, tuple[str, Shard]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class DecoderModel(Protocol):
    """The decoder LlamaForCausalLM holds (its model_class: LlamaModel, gemma3.py's Gemma3Model)."""
    embed_tokens: Embedding
    expert_counts: torch.Tensor | None      # [L, E] with experts (build_stack's and forward's counts)

    def build_stack(self, kernels: Kernels | None) -> None: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: KVCaches, keep: torch.Tensor | None = None) -> torch.Tensor: ...


class LlamaForCausalLM(nn.Module):
    model_class: Callable[[ModelConfig, TensorParallel | None], DecoderModel] = LlamaModel

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = self.model_class(cfg, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size if tp is None else tp.padded(cfg.vocab_size),
                                 bias=False)
        self.tie_weights()

    def build_stack(self, kernels: Kernels | None) -> None:
        """The decoder's C++ stack (the engine builder's step, after `bind_kernels(model, kernels)`)."""
        self.model.build_stack(kernels)

    def tie_weights(self) -> None:
        """Share the embedding with the output head (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden], or of the rows `keep` [R] (ascending): what compute_logits takes."""
        return self.model(input_ids, positions, meta, kv_caches, keep)

    def expert_choices(self) -> torch.Tensor | None:
        """A mixture of experts: each sparse layer's (row, choice) pairs per expert in the last forward
        [len(moe_layers), E] int64 (the stack's last layer: of the kept rows); None for a dense model."""
        counts = self.model.expert_counts       # None without experts
        return None if counts is None else counts[list(self.config.moe_layers)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] → logits [N, vocab] in fp32 (with tp: on rank 0, None on the others)."""
        logits = self.lm_head(hidden).float()
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters; returns the parameter names filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        cfg, loaded = self.config, set()
        shard: Shard | None
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # some checkpoints store the tied copy anyway
            moe = load_moe_weight(params, name, tensor, cfg.num_experts) if cfg.num_experts else None
            if moe is not None:
                loaded |= moe
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in _PACKED:
                fused, shard = _PACKED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            dst = param.data if shard is None else self._shard(param.data, shard)
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                 f"shape {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded |= _shard_names(target) if shard is None else {f"{target}:{shard}"}
        return loaded

    def _shard(self, data: torch.Tensor, shard: Shard) -> torch.Tensor:
        cfg = self.config
        if shard == "q":
            return data[: cfg.q_size]
        if shard == "k":
            return data[cfg.q_size: cfg.q_size + cfg.kv_size]
        if shard == "v":
            return data[cfg.q_size + cfg.kv_size:]
        half = data.shape[0] // 2
        return data[half * shard: half * (shard + 1)]

    def expected_weights(self) -> set[str]:
        """What load_weights must fill for the model to be complete."""
        return set().union(*(expert_shard_names(name, self.config.num_experts) or _shard_names(name)
                             for name, p in self.named_parameters()))


def _shard_names(param: str) -> set[str]:
    """A fused parameter counts as loaded once each of its shards is (a Phi-3 checkpoint fills all at
    once)."""
    if ".qkv_proj." in param:
        return {f"{param}:{s}" for s in "qkv"}
    if ".gate_up_proj." in param:
        return {f"{param}:0", f"{param}:1"}
    return {param}
