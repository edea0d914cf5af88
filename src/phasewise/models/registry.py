"""Architecture name → model class."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phasewise.models.config import ModelConfig, UnsupportedModelError

if TYPE_CHECKING:
    from phasewise.models.llama import LlamaForCausalLM


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    if cfg.architecture in ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen2_moe", "qwen3_moe",
                            "mixtral", "olmoe"):
        from phasewise.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if cfg.architecture in ("qwen3_5", "qwen3_5_moe"):
        from phasewise.models.qwen3_5 import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM
    if cfg.architecture == "qwen3_next":
        from phasewise.models.qwen3_next import Qwen3NextForCausalLM

        return Qwen3NextForCausalLM
    if cfg.architecture == "lfm2":
        from phasewise.models.lfm2 import Lfm2ForCausalLM

        return Lfm2ForCausalLM
    if cfg.architecture == "gemma3":
        from phasewise.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    raise UnsupportedModelError(f"no model class for architecture {cfg.architecture!r}")
