"""Qwen3.5's language model (dense and mixture of experts; Qwen3-Next's builds on it, models/qwen3_next.py):
the hybrid layers of models/hybrid.py and, when asked for, the checkpoint's MTP layer (models/mtp.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from phasewise.distributed import TensorParallel
from phasewise.models.config import ModelConfig
from phasewise.models.hybrid import HybridModel
from phasewise.models.llama import LlamaForCausalLM, Shard
from phasewise.models.mtp import MultiTokenPredictor

# checkpoint norms stored as an offset from 1 (the DeltaNet's gated norm, `linear_attn.norm`, is not)
_OFFSET_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
                 "q_norm.weight", "k_norm.weight", "mtp.norm.weight", "pre_fc_norm_embedding.weight",
                 "pre_fc_norm_hidden.weight")


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Qwen3.5's language model (a multimodal folder's vision tower skipped); its MTP layer (`mtp`,
    models/mtp.py) where the config keeps `mtp_layers` (the loader's `mtp=True`), else skipped too."""
    model_class = HybridModel

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__(cfg, tp)
        if cfg.mtp_layers > 1:
            raise ValueError(f"{cfg.mtp_layers} MTP layers: only one is supported (as the "
                             "released models have)")
        self.mtp = MultiTokenPredictor(cfg) if cfg.mtp_layers else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names (`model.language_model.` as `model.`), (1 + w) norms kept as 1 + w; from a GGUF
        (loading/gguf.py) also the decay rate `neg_A` = -exp(A_log) and the conv's taps as [C, K]."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model.mtp."):
                    name = name[len("model."):]
                if name.startswith("model.visual.") or (name.startswith("mtp.") and self.mtp is None):
                    continue
                name = name.replace("model.language_model.", "model.", 1)
                if name.endswith(".neg_A"):
                    name, tensor = name[:-len("neg_A")] + "A_log", torch.log(-tensor)
                if name.endswith(".conv1d.weight") and tensor.dim() == 2:
                    tensor = tensor[:, None, :]
                yield name, tensor + 1 if name.endswith(_OFFSET_NORMS) else tensor
        return super().load_weights(renamed())

    def _shard(self, data: torch.Tensor, shard: Shard) -> torch.Tensor:
        """q_proj gives q and its gate: twice q_size rows."""
        qs, kvs = 2 * self.config.q_size, self.config.kv_size
        if shard == "q":
            return data[:qs]
        if shard == "k":
            return data[qs:qs + kvs]
        if shard == "v":
            return data[qs + kvs:]
        return super()._shard(data, shard)
