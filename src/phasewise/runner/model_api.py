"""CausalLM: what the runner (and a draft-model proposer) asks of a model: models/llama.py's
`LlamaForCausalLM` (and its subclasses) is one."""

from __future__ import annotations

from typing import Protocol

import torch

from phasewise.kernels.kernel_api import Kernels
from phasewise.layers.attention import AttentionMetadata, LayerKV
from phasewise.models.config import ModelConfig


class CausalLM(Protocol):
    @property
    def config(self) -> ModelConfig:
        """The model's shape (vocab_size, layers, heads...); a tensor-parallel rank's part of it."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[LayerKV], keep: torch.Tensor | None = None) -> torch.Tensor:
        """The forward pass: hidden states [T, hidden], or of the rows `keep` [R] (ascending)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] → fp32 logits [N, vocab] (with tensor parallelism: on rank 0, None on the
        others)."""

    def expert_choices(self) -> torch.Tensor | None:
        """A mixture of experts: its routers' choices in the last forward [len(moe_layers), E]; None if
        dense."""

    def build_stack(self, kernels: Kernels | None) -> None:
        """The decoder's C++ stack, where it can run (the engine builder's step after loading)."""
