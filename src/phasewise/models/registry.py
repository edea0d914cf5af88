"""Architecture name → model class."""

from __future__ import annotations

from torch import nn

from phasewise.models.config import ModelConfig, UnsupportedModelError


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.architecture in ("llama", "mistral", "qwen2", "phi3"):
        from phasewise.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise UnsupportedModelError(f"no model class for architecture {cfg.architecture!r}")
