"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) in plain PyTorch, float experts.

A router (a float linear map, never quantized) scores every expert for each row; each row takes its
top-k experts, weighted as transformers weights them: softmax over all experts in fp32, then
`torch.topk` (its order and ties), then, where the config says so, the k weights renormalised to sum
to 1 (`cfg.router == "topk_softmax"`: top-k of the logits, softmax over those). The experts are two
3-D weights, gate and up fused as in transformers: `gate_up_proj` [E, 2 I, H] and `down_proj`
[E, H, I]. Rows are grouped by expert: for each expert chosen by any row, one matmul over all its
rows, down-projected, scaled by each row's weight and added into the output (`index_add_`), experts
in ascending order, so a row's k terms are summed in an order that depends on that row alone.
Qwen2-MoE adds a shared expert (a dense MLP) behind its own sigmoid gate.

Row independence at fp32: torch's float GEMM rounds a row differently with the number of rows in the
call (a single row is a GEMV; measured on MKL and oneDNN), so an expert's result for a row can differ
in the last bits with the rows that share its expert in a step, exactly as the dense float linears
do; greedy tokens alone and batched are tested equal (tests/test_moe.py). Bit-exactness whatever
shares the step comes with the packed expert kernels (issue 54's later parts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.kernels import UsesKernels, applies
from phasewise.kernels.kernel_api import Kernels
from phasewise.layers.linear import frozen
from phasewise.models.config import ModelConfig


class Gate(nn.Module):
    """A float linear map without bias that no loader quantizes: the router, the shared expert's gate."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = frozen(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(logits: torch.Tensor, k: int, renorm: bool, order: str = "softmax_topk"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] → (weights [T, k] fp32, expert ids [T, k]), as transformers' routers compute them."""
    if order == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        return F.softmax(top, dim=-1, dtype=torch.float32), ids
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(UsesKernels, nn.Module):
    """E SwiGLU experts as two 3-D weights; each row runs its own k."""

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = frozen(torch.empty(num_experts, 2 * width, hidden))   # [E, 2 I, H]: gate, then up
        self.down_proj = frozen(torch.empty(num_experts, hidden, width))          # [E, H, I]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids and weights [T, k] → Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]): [T, H]."""
        T, k = ids.shape
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)                   # by expert, then row: [T k]
        rows, scale = order // k, weights.reshape(-1)[order].to(x.dtype)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            sel = rows[start:start + n]
            gate_up = F.linear(x[sel], self.gate_up_proj[e])       # [n, 2 I]
            if applies(self.ops, gate_up):
                act = self.ops.silu_and_mul(gate_up, gelu=False)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            y = F.linear(act, self.down_proj[e]) * scale[start:start + n, None]
            out.index_add_(0, sel, y)
            start += n
        return out


class SparseMoeBlock(UsesKernels, nn.Module):
    """Router, experts and (Qwen2-MoE) a shared expert `shared` (a dense MLP module) behind a sigmoid gate."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("tensor parallelism does not split experts yet")
        self.cfg = cfg
        self.gate = Gate(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared
        self.shared_expert_gate = Gate(cfg.hidden_size, 1) if shared is not None else None

    def bind_kernels(self, kernels: Kernels | None) -> None:
        self.ops = kernels
        self.experts.bind_kernels(kernels)
        if self.shared_expert is not None:
            self.shared_expert.bind_kernels(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] → [T, hidden]."""
        cfg = self.cfg
        weights, ids = route(self.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.router)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# ---- checkpoint names ----------------------------------------------------------------------------

# one expert's weight in a checkpoint (HF: mlp.experts.{e}.gate_proj; Mixtral: block_sparse_moe.experts.{e}.w1)
# → (our 3-D parameter, half of gate_up_proj: 0 gate, 1 up, None the whole of down_proj)
_EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
                 "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


def load_moe_weight(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> set[str] | None:
    """Copy a mixture-of-experts checkpoint tensor into its place; the shard names filled, or None when
    `name` is no expert weight (the caller loads it). Takes one expert's 2-D weight
    (`...experts.{e}.gate_proj.weight`, Mixtral's `w1/w3/w2`), all experts' 3-D weight of one
    projection (a GGUF's `ffn_{gate,up,down}_exps`, named `...experts.gate_proj.weight`), or
    transformers' fused 3-D parameters (`...experts.gate_up_proj`, `...experts.down_proj`)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")          # Mixtral's module name
    if name.endswith(".mlp.shared_expert_gate.weight") and tensor.dim() == 1:
        tensor = tensor[None]                                    # a GGUF stores it as [H]
    parts = name.split(".")
    if ".mlp.experts." not in name:
        if name.endswith(".mlp.gate.weight") or name.endswith(".mlp.shared_expert_gate.weight"):
            _copy(params, name, params[name].data if name in params else None, tensor)
            return {name}
        return None
    head = name[:name.index(".mlp.experts.") + len(".mlp.experts")]
    if parts[-1] in ("gate_up_proj", "down_proj"):                # transformers' own 3-D parameters
        expert, (target, half) = None, (parts[-1], None)
    elif parts[-2] in _EXPERT_PARTS and parts[-1] == "weight" and parts[-3].isdigit():
        expert, (target, half) = int(parts[-3]), _EXPERT_PARTS[parts[-2]]
    elif parts[-2] in _EXPERT_PARTS and parts[-1] == "weight" and tensor.dim() == 3:
        expert, (target, half) = None, _EXPERT_PARTS[parts[-2]]
    else:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
    target = f"{head}.{target}"
    data = params[target].data if target in params else None
    if data is not None and expert is not None:
        if expert >= data.shape[0]:
            raise KeyError(f"checkpoint tensor {name!r}: expert {expert} of {data.shape[0]}")
        data = data[expert]
    if data is not None and half is not None:
        width = data.shape[-2] // 2
        data = data[..., half * width:(half + 1) * width, :]
    _copy(params, name, data, tensor)
    experts = [expert] if expert is not None else range(params[target].shape[0])
    halves = [half] if half is not None else (0, 1)
    return {f"{target}:{e}:{h}" for e in experts for h in halves} if target.endswith("gate_up_proj") \
        else {f"{target}:{e}" for e in experts}


def _copy(params: dict[str, nn.Parameter], name: str, dst: torch.Tensor | None, tensor: torch.Tensor) -> None:
    if dst is None:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
    if dst.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(tensor)


def expert_shard_names(param: str, shape: torch.Size) -> set[str] | None:
    """What must be loaded for an experts' 3-D parameter to be complete: each expert's (and half's)
    part; None for any other parameter."""
    if param.endswith(".experts.gate_up_proj"):
        return {f"{param}:{e}:{h}" for e in range(shape[0]) for h in (0, 1)}
    if param.endswith(".experts.down_proj"):
        return {f"{param}:{e}" for e in range(shape[0])}
    return None
