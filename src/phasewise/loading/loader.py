"""Find a model, read its config and weights, and build it on a device in a dtype."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from phasewise.config import PROCESS_OVERHEAD
from phasewise.distributed import TensorParallel
from phasewise.layers.expert_linear import ExpertLinear
from phasewise.layers.linear import Linear, onednn_available
from phasewise.layers.rotary import RotaryEmbedding
from phasewise.loading.gguf import GGUFFile, ModelLoadError
from phasewise.loading.packaged import PACKAGED_MODELS, default_model_path, packaged_model_path
from phasewise.loading.quantize import (WEIGHT_FORMATS, FileWeights, fill_file_weights, packed_bytes,
                                        plan_file_weights, quantize_rest)
from phasewise.loading.safetensors import hf_tensors, safetensors_files
from phasewise.loading.sharding import Readable, check_tensor_parallel, shard_config, shard_weights
from phasewise.models.config import ModelConfig
from phasewise.models.llama import LlamaForCausalLM
from phasewise.models.registry import model_class
from phasewise.kernels import bind_kernels
from phasewise.kernels.kernel_api import Kernels

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "int8": torch.float32, "q4": torch.float32}   # quantized weights: fp32 for the rest


def resolve_model_path(model: str | Path | None) -> Path:
    """None → the default model; otherwise a .gguf file or an HF folder that must exist."""
    if model is None:
        return default_model_path()
    if str(model) in PACKAGED_MODELS:
        return packaged_model_path(str(model))
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path} (give a .gguf file or a Hugging Face model folder)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is a folder without config.json (not a Hugging Face model folder)")
    return path


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (choose from fp32, bf16, fp16, int8, q4)")
    return DTYPES[dtype]


def load_config(path: Path) -> ModelConfig:
    if path.is_dir():
        return ModelConfig.from_hf(path)
    return GGUFFile(path).model_config()


def load_model(path: Path, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
               tp: TensorParallel | None = None, packed_cache: bool = True,
               kernels: Kernels | None = None, mtp: bool = False) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for `path` (a .gguf file or an HF folder) with every weight loaded; with `tp`,
    this rank's part of it (loading/sharding.py), and the config of that part.

    dtype "int8" or "q4" loads in fp32, then fills the linear layers with quantized blocks
    (loading/quantize.py); q4 from a GGUF takes the file's blocks for every layer (and the token table) that
    has them without reading those weights in fp32 at all, and with `packed_cache` maps them from the
    packed-weight cache when an earlier load left them there (loading/packed_cache.py). `mtp`: with the
    checkpoint's multi-token-prediction layer (`model.mtp`; otherwise its weights are skipped).
    """
    weight_format = dtype if isinstance(dtype, str) and dtype in WEIGHT_FORMATS else None
    dtype = parse_dtype(dtype)
    cfg, gguf, checkpoint = _open_checkpoint(path)
    if cfg.mtp_layers and not mtp:
        cfg = replace(cfg, mtp_layers=0)
    full = cfg
    if tp is not None:
        check_tensor_parallel(cfg, tp.size)
        cfg = shard_config(cfg, tp)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, tp=tp) if tp is not None else model_class(cfg)(cfg)
    plan = FileWeights()
    if weight_format == "q4" and gguf is not None:
        plan = plan_file_weights(model, full, gguf, tp, packed_cache, kernels)
    # each read whole, or as this rank's part
    weights = shard_weights(((n, t) for n, t in checkpoint if n not in plan.names), full, tp)
    materialize(model, device)
    model.tie_weights()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_parameters()
    loaded = _read_weights(model, weights, path)
    fill_file_weights(model, plan)            # the planned layers' fp32 weights were never written
    missing = model.expected_weights() - loaded
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} weights missing from the checkpoint, "
                             f"e.g. {sorted(missing)[0]}")
    if weight_format:
        quantize_rest(model)
    return model.eval(), cfg


def _open_checkpoint(path: Path) -> tuple[ModelConfig, GGUFFile | None, Iterator[tuple[str, Readable]]]:
    """The model's config, its GGUF (None for an HF folder) and the checkpoint's tensors by HF name."""
    if path.is_dir():
        cfg = ModelConfig.from_hf(path)
        safetensors_files(path)  # fail early and clearly when there are no weights
        return cfg, None, hf_tensors(path)
    gguf = GGUFFile(path)
    cfg = gguf.model_config()
    return cfg, gguf, gguf.hf_tensors(cfg)


def _read_weights(model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]],
                  path: Path) -> set[str]:
    """Load `weights` into `model`; the names loaded. A tensor with no place in the model, or of the
    wrong shape, is a ModelLoadError naming `path`."""
    with torch.no_grad():
        try:
            return model.load_weights(weights)
        except ModelLoadError:
            raise
        except (KeyError, ValueError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise ModelLoadError(f"{path}: {msg}") from None


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Module.to_empty without its path through torch's reference ops, whose first call imports
    sympy (0.8 s at start): every meta parameter and buffer becomes uninitialised memory on `device`."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                   requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_meta:   # assigning to a buffer's name keeps it a buffer, as it was
                setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def q4_weight_bytes(path: Path) -> tuple[float, float] | None:
    """(packed bytes, the file's bytes) of the weights a q4 load of this GGUF holds (None: not a
    GGUF), computed from its header without reading a weight."""
    if path.is_dir():
        return None
    gguf = GGUFFile(path)
    cfg = gguf.model_config()
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return packed_bytes(model, cfg, gguf)


PACKED_AT_MOST = 2.0       # q4's packed weights against a GGUF's bytes, at most (Q5_K as k6: 2.0; Q4_0: 1.11)


def check_memory(path: Path, kv_bytes: float, available: float | None = None) -> None:
    """A one-line ModelLoadError, before anything is loaded, when a q4 load of `path` with a KV pool
    of `kv_bytes` would not fit in `available` bytes (default: the system's MemAvailable)."""
    if available is None:
        available = _mem_available()
    besides = kv_bytes + PROCESS_OVERHEAD                 # what the process needs beyond its weights
    if available is None or (path.is_file() and PACKED_AT_MOST * path.stat().st_size + besides <= available):
        return                                # fits whatever the packing (and no model built to know)
    q4 = q4_weight_bytes(path)
    if q4 is None or q4[0] + besides <= available:
        return
    gib = lambda b: b / 2**30  # noqa: E731
    room = available - q4[0] - PROCESS_OVERHEAD
    hint = f"--kv-cache-memory {room / 2**30 * 0.9:.2f} would fit" if room > 0.05 * 2**30 else \
        "the weights alone do not fit"
    raise ModelLoadError(f"{path.name} needs {gib(q4[0] + besides):.2f} GiB ({gib(q4[0]):.2f} GiB of "
                         f"weights, a {gib(kv_bytes):.2f} GiB KV pool, {gib(PROCESS_OVERHEAD):.1f} GiB "
                         f"besides) and {gib(available):.2f} GiB is available: {hint}")


def _mem_available() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_prepared(path: Path, dtype: str, device: str = "cpu", kernels: Kernels | None = None,
                  plain: bool = False, tp: TensorParallel | None = None, packed_cache: bool = True,
                  mtp: bool = False) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model at `path` in `dtype` (with `tp`, this rank's part; `mtp`: with its MTP layer), its layers
    given `kernels` (or their reference paths); `plain`: no oneDNN either (kernels="torch")."""
    model, cfg = load_model(path, dtype, device, tp, packed_cache, kernels, mtp)
    torch_dtype = parse_dtype(dtype)
    choose_weight_forms(model, device, torch_dtype, kernels, onednn=not plain)
    bind_kernels(model, kernels if torch_dtype == torch.float32 else None)
    return model, cfg


def choose_weight_forms(model: nn.Module, device: torch.device | str, dtype: torch.dtype,
                        kernels: Kernels | None = None, onednn: bool = True) -> int:
    """Each linear layer's form for running: blocks stay where `kernels` can run them (the CPU) and
    are dequantized once into `dtype` otherwise; dense weights are packed for oneDNN where it is
    available (and `onednn`). Returns how many layers were given a fast kernel."""
    device = torch.device(device)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    blocks = [m for m in linears if m.form == "blocks"]
    if blocks and (kernels is None or device.type != "cpu"):
        warnings.warn(f"phasewise: no compiled kernels for the {blocks[0].fmt} weights here; they are "
                      f"dequantized to {str(dtype).removeprefix('torch.')} once at load "
                      "(float speed and memory)",
                      stacklevel=2)
        for layer in blocks:
            layer.dequantize(dtype)
        blocks = []
    if not onednn or not onednn_available(device, dtype):
        if onednn and device.type == "cpu" and dtype == torch.bfloat16:
            warnings.warn("phasewise: this CPU has no bf16 kernels in oneDNN; bf16 runs PyTorch's generic "
                          "linears (slow): --dtype fp32 or the default is faster here", stacklevel=2)
        return len(blocks)
    # experts: cut by rows
    dense = [m for m in linears if m.form == "dense" and not isinstance(m, ExpertLinear)]
    for layer in dense:
        layer.pack_for_onednn()
    return len(dense) + len(blocks)
