"""Roofline: this machine's memory bandwidth and matmul throughput against what a model needs per token.

Decode reads every weight once per step (and the KV cache of its context) to do
~2 FLOPs per weight: it is bound by memory bandwidth. Prefill reuses each weight
for every prompt token: it is bound by compute. `analyse` states, for a measured
prefill and decode, the share of each bound achieved and which one binds.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypedDict

import torch

from phasewise.lab.memory import mlp_params, recurrent_params
from phasewise.layers.linear import Linear, onednn_available
from phasewise.models.config import ModelConfig


@dataclass(frozen=True)
class Machine:
    dram_gbs: float          # streaming read bandwidth of a buffer far larger than the caches
    cache_gbs: float         # the same for a buffer that fits the last-level cache
    matmul_gflops: float     # a large square matmul in the weights' dtype, best of torch's and our kernel
    int8_gops: float | None = None  # int8 dot-product peak (VNNI), the roof of the quantized kernels

    def compute_roof(self, quantized: bool) -> float:
        """The compute peak a phase is measured against: the int8 dot-product peak for quantized
        weights (their kernels multiply int8 activations by int8 or 4-bit weights), else the matmul."""
        return self.int8_gops if quantized and self.int8_gops else self.matmul_gflops


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_machine(dtype: torch.dtype = torch.float32, dram_mib: int = 1024, cache_mib: int = 8,
                    matmul_n: int = 2048, repeats: int = 5) -> Machine:
    """Read bandwidth (a sum over the buffer) and matmul throughput; best of `repeats`."""
    def read_gbs(mib: int) -> float:
        buf = torch.ones(mib * 2**20 // 4)
        reps = max(1, 256 // mib) if mib < 256 else 1
        secs = _best_seconds(lambda: [buf.sum() for _ in range(reps)], repeats)
        return buf.numel() * 4 * reps / secs / 1e9

    x = torch.randn(matmul_n, matmul_n).to(dtype)
    def layer(onednn: bool) -> Linear:
        linear = Linear(matmul_n, matmul_n).to(dtype)
        assert linear.weight is not None          # as built: dense
        torch.nn.init.normal_(linear.weight, std=matmul_n ** -0.5)
        if onednn:
            linear.pack_for_onednn()
        return linear
    kernels = [layer(False)] + ([layer(True)] if onednn_available(torch.device("cpu"), dtype) else [])
    secs = min(_best_seconds(partial(k, x), repeats) for k in kernels)
    return Machine(read_gbs(dram_mib), read_gbs(cache_mib), 2 * matmul_n**3 / secs / 1e9,
                   int8_peak_gops(repeats))


def _machine_key(dtype: torch.dtype) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
               platform.processor() or platform.machine())
    return f"{cpu} / {torch.get_num_threads()} threads / {str(dtype).removeprefix('torch.')}"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _machines_file() -> Path:
    from phasewise.config import default_cache_dir

    return default_cache_dir() / "machines.json"


def save_machine(machine: Machine, dtype: torch.dtype) -> Path:
    """Keep the figures for this CPU, thread count and dtype (the server's dashboard reads them)."""
    path = _machines_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known[_machine_key(dtype)] = dataclasses.asdict(machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=1))
    return path


def load_machine(dtype: torch.dtype) -> Machine | None:
    """The figures `phasewise roofline` measured on this CPU at this thread count and dtype, if any."""
    try:
        figures = json.loads(_machines_file().read_text()).get(_machine_key(dtype))
        return Machine(**figures) if figures else None
    except (OSError, ValueError, TypeError):
        return None


def int8_peak_gops(repeats: int = 3) -> float | None:
    """The int8 dot-product peak of all threads with the kernels' own instructions (best of
    `repeats`), or None without compiled kernels."""
    from phasewise.kernels import build

    kernels = build.load()
    return max(kernels.int8_peak_gops() for _ in range(repeats)) if kernels is not None else None


@dataclass(frozen=True)
class TokenCosts:
    weight_bytes: float      # linear weights read by one forward step (the embedding row is negligible)
    flops_per_token: float   # 2 per linear weight, plus attention at the given context


def linear_params(cfg: ModelConfig, active: bool = True) -> int:
    """Weights of the linear layers and the output head; of a mixture of experts those one token
    uses (`active`), or all of them; a hybrid's recurrent layers in place of attention."""
    h = cfg.hidden_size
    attn = h * ((2 if cfg.attn_output_gate else 1) * cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    mlps = sum(mlp_params(cfg, layer, active) for layer in range(cfg.num_layers))
    mixers = len(cfg.attention_layers) * attn + len(cfg.recurrent_layers) * recurrent_params(cfg)
    return mixers + mlps + cfg.vocab_size * h       # + the output head


def head_params(cfg: ModelConfig) -> int:
    """The output head's weights (vocab x hidden), counted in `linear_params`."""
    return cfg.vocab_size * cfg.hidden_size


def weight_bytes_per_param(model: torch.nn.Module, cfg: ModelConfig, element_size: int) -> float:
    """Bytes a decode step reads per linear weight: quantized layers' stored bytes (quants, scales), else
    the element size of the weights' dtype."""
    quant = [m for m in model.modules() if isinstance(m, Linear) and m.form == "blocks"]
    if not quant:
        return float(element_size)
    stored = sum(b.numel() * b.element_size() for m in quant for name, b in m.named_buffers()
                 if name != "bias")
    return stored / linear_params(cfg, active=False)


def token_costs(cfg: ModelConfig, bytes_per_weight: float, context: int, head: bool = True) -> TokenCosts:
    """Per token at `context` tokens of context: attention does QK^T and PV, 2 FLOPs each per element.
    `head`: the token's logits are computed (every decoded token; of a prompt, only the last)."""
    attention = 4 * len(cfg.attention_layers) * context * cfg.q_size
    params = linear_params(cfg) - (0 if head else head_params(cfg))
    return TokenCosts(linear_params(cfg) * bytes_per_weight, 2 * params + attention)


def request_flops(cfg: ModelConfig, prompt_tokens: int, output_tokens: int) -> float:
    """FLOPs of one request: its prompt (logits at the last position only, which give the first output
    token), then output_tokens - 1 decode steps, attention taken at each phase's mean context."""
    prefill = token_costs(cfg, 0, prompt_tokens // 2, head=False).flops_per_token * prompt_tokens
    decode = token_costs(cfg, 0, prompt_tokens + output_tokens // 2).flops_per_token * (output_tokens - 1)
    return prefill + 2 * head_params(cfg) + decode


def model_weights(model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> tuple[float, bool]:
    """Bytes per linear weight as stored, and whether the int8 kernels run them (their roof: the int8
    peak)."""
    element = torch.empty((), dtype=dtype).element_size()
    quantized = any(isinstance(m, Linear) and m.form == "blocks" and m.kernels is not None
                    for m in model.modules())
    return weight_bytes_per_param(model, cfg, element), quantized


class ServingRoofline(TypedDict):
    """The fields of the dashboard's Roofline (server/dashboard_feed.py)."""
    dram_gbs: float
    compute_gops: float
    compute_name: str
    weight_bytes: float
    flops_per_token: float
    head_flops: float


def serving_roofline(machine: Machine, model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype
                     ) -> ServingRoofline:
    """What the server's dashboard needs to say which resource its recent steps bind: the roofs, the
    linear weights one step reads, the FLOPs per token without and with the output head."""
    per_weight, quantized = model_weights(model, cfg, dtype)
    head = head_params(cfg)
    return {"dram_gbs": machine.dram_gbs, "compute_gops": machine.compute_roof(quantized),
            "compute_name": "int8 dot products" if quantized and machine.int8_gops else "matmul",
            "weight_bytes": linear_params(cfg) * per_weight,
            "flops_per_token": 2.0 * (linear_params(cfg) - head),
            "head_flops": 2.0 * head}


@dataclass(frozen=True, kw_only=True)
class PhaseRoofline:
    phase: str
    tokens: int
    seconds: float
    bytes_moved: float
    flops: float
    machine: Machine
    quantized: bool = False          # weights run by the int8 kernels: the int8 peak is the compute roof

    @property
    def achieved_gbs(self) -> float:
        return self.bytes_moved / self.seconds / 1e9

    @property
    def achieved_gflops(self) -> float:
        return self.flops / self.seconds / 1e9

    @property
    def bandwidth_share(self) -> float:
        return self.achieved_gbs / self.machine.dram_gbs

    @property
    def compute_share(self) -> float:
        return self.achieved_gflops / self.machine.compute_roof(self.quantized)

    @property
    def binds(self) -> str:
        """The resource the phase is closer to exhausting."""
        return "memory bandwidth" if self.bandwidth_share >= self.compute_share else "compute"


def analyse(cfg: ModelConfig, machine: Machine, bytes_per_weight: float, kv_bytes_per_token: float,
            prompt_tokens: int, prefill_s: float, decode_tokens: int, decode_s: float,
            quantized: bool = False) -> list[PhaseRoofline]:
    """Prefill reads the weights once for all prompt tokens and computes logits for the last one only;
    each decode step reads the weights again, plus the KV cache of its context (taken at the middle of
    the decode). `quantized`: the int8 kernels run the linear layers, so the compute roof is the
    int8 dot-product peak."""
    pre = token_costs(cfg, bytes_per_weight, prompt_tokens // 2, head=False)
    prefill = PhaseRoofline(phase="prefill", tokens=prompt_tokens, seconds=prefill_s,
                            bytes_moved=pre.weight_bytes + kv_bytes_per_token * prompt_tokens,
                            flops=pre.flops_per_token * prompt_tokens + 2 * head_params(cfg), machine=machine,
                            quantized=quantized)
    mid = prompt_tokens + decode_tokens // 2
    dec = token_costs(cfg, bytes_per_weight, mid)
    decode = PhaseRoofline(phase="decode", tokens=decode_tokens, seconds=decode_s,
                           bytes_moved=(dec.weight_bytes + kv_bytes_per_token * mid) * decode_tokens,
                           flops=dec.flops_per_token * decode_tokens, machine=machine, quantized=quantized)
    return [prefill, decode]


def report(machine: Machine, phases: list[PhaseRoofline]) -> list[str]:
    lines = [f"machine: DRAM read {machine.dram_gbs:.1f} GB/s, cache-resident read {machine.cache_gbs:.1f} "
             f"GB/s, matmul {machine.matmul_gflops:.1f} GFLOP/s"
             + (f", int8 dot products {machine.int8_gops:.0f} GOP/s" if machine.int8_gops else ""),
             f"{'phase':8}{'tokens':>8}{'ms':>10}{'GB/s':>9}{'of DRAM':>9}{'GFLOP/s':>10}{'of peak':>9}"
             "  binds" + ("  (peak: the int8 one)" if any(p.quantized and machine.int8_gops for p in phases)
                          else "")]
    for p in phases:
        lines.append(f"{p.phase:8}{p.tokens:>8}{p.seconds * 1e3:>10.1f}{p.achieved_gbs:>9.1f}"
                     f"{p.bandwidth_share:>9.0%}{p.achieved_gflops:>10.1f}{p.compute_share:>9.0%}  {p.binds}")
    return lines
