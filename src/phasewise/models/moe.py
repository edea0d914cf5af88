"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): router, experts, shared expert.

A router (a float linear map, never quantized) scores every expert for each row; each row takes its
top-k experts, weighted as transformers weights them: softmax over all experts in fp32, then
`torch.topk`, then, where the config says so, the k weights renormalised to sum to 1
(`cfg.router == "topk_softmax"`: top-k of the logits, softmax over those). On the kernels the
routing is the decoder stack's own (`Kernels.moe_route`: ties go to the lower expert id), so the
Python layers and the stack choose alike. The experts are
three stacked weights (layers/expert_linear.py): `gate_proj` and `up_proj` [E I, H], `down_proj`
[E H, I], in blocks as the file holds them or in float. Rows are grouped by expert: for each expert
chosen by any row, one pass over its weights for all its rows; each row's k terms are then summed
in the router's order (j = 0 .. k - 1), an order that depends on that row alone. With the kernels
the whole sparse MLP is one call (kernels/csrc/expert_mlp.cpp), reading only the chosen experts'
blocks.
Qwen2-MoE adds a shared expert (a dense MLP) behind its own sigmoid gate.

Row independence at fp32: torch's float GEMM rounds a row differently with the number of rows in the
call (a single row is a GEMV; measured on MKL and oneDNN), so an expert's result for a row can differ
in the last bits with the rows that share its expert in a step, exactly as the dense float linears
do; greedy tokens alone and batched are tested equal (tests/test_moe.py). On the kernels each row's
bits do not depend on the rows beside it (tested alone, batched and chunked, per format).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.kernels import UsesKernels, applies
from phasewise.kernels.kernel_api import Kernels, StackSparse, WeightPart
from phasewise.layers.expert_linear import ExpertLinear
from phasewise.layers.linear import Linear, frozen
from phasewise.models.config import ModelConfig


class DenseMLP(Protocol):
    """A dense SwiGLU MLP (llama.py's LlamaMLP): a dense layer's, or Qwen2-MoE's shared expert."""

    @property
    def gate_up_proj(self) -> Linear: ...

    @property
    def down_proj(self) -> Linear: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Gate(UsesKernels, nn.Module):
    """A float linear map without bias that no loader quantizes: the router, the shared expert's gate.
    On the kernels each row's scores are the same bits whatever rows share the step (torch's GEMM
    rounds a lone row apart), so a row's experts do not depend on its neighbours."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = frozen(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if applies(self.kernels, x) and self.weight.dtype == torch.float32:
            return self.kernels.float_linear(x, self.weight)
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
    """E SwiGLU experts as three stacked weights (layers/expert_linear.py); each row runs its own k.

    On the kernels (the weights in blocks, fp32 rows on the CPU) one call runs them all
    (`Kernels.expert_mlp`); otherwise the float path below, which the kernel's results match to the
    activations' int8 rounding."""

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = ExpertLinear(num_experts, hidden, width)    # [E I, H]
        self.up_proj = ExpertLinear(num_experts, hidden, width)      # [E I, H]
        self.down_proj = ExpertLinear(num_experts, width, hidden)    # [E H, I]
        self._parts: tuple[WeightPart, WeightPart, WeightPart] | None = None

    def bind_kernels(self, kernels: Kernels | None) -> None:
        self.kernels = kernels
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        for p in projections:
            p.bind_kernels(kernels)
        gate, up, down = (p.kernel_part() for p in projections)
        self._parts = None
        if kernels is not None and gate is not None and up is not None and down is not None:
            self._parts = (gate, up, down)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Experts:
        out = super()._apply(fn, recurse)      # buffers may move: gather the kernel's arguments again
        self.bind_kernels(self.kernels)
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids and weights [T, k] → Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]): [T, H],
        the k terms summed in the router's order."""
        if self._parts is not None and applies(self.kernels, x):
            return self.kernels.expert_mlp(x, ids, weights, *self._parts, self.num_experts)
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)                   # by expert, then row: [T k]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        y = x.new_empty(T * k, x.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            slots = order[start:start + n]
            rows = x[slots // k]
            gate = F.linear(rows, self.gate_proj.expert_weight(e, x.dtype))
            up = F.linear(rows, self.up_proj.expert_weight(e, x.dtype))
            y[slots] = F.linear(F.silu(gate) * up, self.down_proj.expert_weight(e, x.dtype))
            start += n
        terms = y.view(T, k, -1) * weights.to(x.dtype)[..., None]
        out = terms[:, 0]
        for j in range(1, k):
            out = out + terms[:, j]
        return out


class SparseMoeBlock(UsesKernels, nn.Module):
    """Router, experts and (Qwen2-MoE) a shared expert `shared` (a dense MLP module) behind a sigmoid gate."""

    def __init__(self, cfg: ModelConfig, shared: DenseMLP | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("tensor parallelism does not split experts yet")
        self.cfg = cfg
        self.gate = Gate(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared
        self.shared_expert_gate = Gate(cfg.hidden_size, 1) if shared is not None else None
        self.choices: torch.Tensor | None = None     # [E] the last forward's (row, choice) pairs per expert

    def stack_args(self) -> StackSparse | None:
        """The decoder stack's description of this block (kernel_api.StackSparse), or None when its
        experts or router are not in the kernels' forms (the Python path runs it)."""
        cfg, parts = self.cfg, self.experts._parts
        shared = self.shared_expert_gate        # with a shared expert (and only then)
        gates = [self.gate.weight] + ([shared.weight] if shared is not None else [])
        if parts is None or not all(w.dtype == torch.float32 and w.device.type == "cpu" for w in gates):
            return None
        shared_gate = gates[1].detach() if len(gates) > 1 else None
        return StackSparse(self.gate.weight.detach(), *parts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                           cfg.router == "topk_softmax", shared_gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] → [T, hidden]."""
        cfg = self.cfg
        logits = self.gate(x)
        if applies(self.kernels, logits):        # the decoder stack's own routing (ties: the lower id first)
            weights, ids = self.kernels.moe_route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                              cfg.router == "topk_softmax")
        else:
            weights, ids = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.router)
        self.choices = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:     # (both or neither)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# ---- checkpoint names ----------------------------------------------------------------------------

# a checkpoint's name of an expert projection → ours (Mixtral's w1, w3, w2)
_PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def load_moe_weight(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
                    experts: int) -> set[str] | None:
    """Copy a mixture-of-experts checkpoint tensor into its place (a model of `experts` experts); the
    shard names filled, or None when `name` is no expert weight (the caller loads it). Takes one
    expert's 2-D weight (`...experts.{e}.gate_proj.weight`, Mixtral's `w1/w3/w2`), all experts' 3-D
    weight of one projection (a GGUF's `ffn_{gate,up,down}_exps`, named `...experts.gate_proj.weight`),
    or transformers' fused 3-D parameters (`...experts.gate_up_proj` [E, 2 I, H], `...experts.down_proj`)."""
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
    if parts[-1] == "gate_up_proj" and tensor.dim() == 3:        # transformers' own: gate, then up
        gate, up = tensor.chunk(2, dim=1)
        return _fill(params, name, f"{head}.gate_proj.weight", gate, None, experts) | \
            _fill(params, name, f"{head}.up_proj.weight", up, None, experts)
    if parts[-1] == "down_proj" and tensor.dim() == 3:
        return _fill(params, name, f"{head}.down_proj.weight", tensor, None, experts)
    if parts[-2] in _PROJECTIONS and parts[-1] == "weight" and (parts[-3].isdigit() or tensor.dim() == 3):
        expert = int(parts[-3]) if parts[-3].isdigit() else None
        return _fill(params, name, f"{head}.{_PROJECTIONS[parts[-2]]}.weight", tensor, expert, experts)
    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")


def _fill(params: dict[str, nn.Parameter], name: str, target: str, tensor: torch.Tensor, expert: int | None,
          experts: int) -> set[str]:
    """`tensor` into expert `expert`'s rows of the stacked weight `target` (None: all experts, [E, rows,
    in])."""
    if target not in params:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
    stacked = params[target].data
    data = stacked.view(experts, stacked.shape[0] // experts, stacked.shape[1])
    if expert is not None:
        if expert >= experts:
            raise KeyError(f"checkpoint tensor {name!r}: expert {expert} of {experts}")
        data = data[expert]
    _copy(params, name, data, tensor)
    return {f"{target}:{e}" for e in ([expert] if expert is not None else range(experts))}


def _copy(params: dict[str, nn.Parameter], name: str, dst: torch.Tensor | None, tensor: torch.Tensor) -> None:
    if dst is None:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
    if dst.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(tensor)


def expert_shard_names(param: str, experts: int) -> set[str] | None:
    """What must be loaded for a stacked expert weight to be complete: each expert's rows; None for
    any other parameter."""
    if ".mlp.experts." in param and param.endswith(("gate_proj.weight", "up_proj.weight",
                                                    "down_proj.weight")):
        return {f"{param}:{e}" for e in range(experts)}
    return None
