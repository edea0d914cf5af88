"""Qwen3-Next: Qwen3.5's layers (models/hybrid.py) as an earlier checkpoint lays them out.

Its Gated DeltaNet projects q, k, v and z in one weight (`in_proj_qkvz`) and b and a in another
(`in_proj_ba`), grouped per key head: for each of the Hk key heads, its q [dk], k [dk], then the v
and z of the Hv / Hk value heads it serves [r dv each], and b, a [r each]. We split them at load
into the flat q | k | v, z, b and a projections Qwen3.5 stores, value heads in the same order
(key-group-major). Everything else is Qwen3.5-MoE's, with Qwen2-MoE's layer rule for experts
(`decoder_sparse_step`, `mlp_only_layers`) and its `norm_topk_prob`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from phasewise.models.qwen3_5 import Qwen3_5ForCausalLM
from phasewise.models.recurrent import GatedDeltaNetShape


def ungrouped(name: str, tensor: torch.Tensor, shape: GatedDeltaNetShape) -> list[tuple[str, torch.Tensor]]:
    """A Qwen3-Next checkpoint tensor as Qwen3.5's: `...in_proj_qkvz.weight` [Hk (2 dk + 2 r dv), H] as
    `in_proj_qkv` [2 Hk dk + Hv dv, H] and `in_proj_z` [Hv dv, H]; `...in_proj_ba.weight` [Hk 2 r, H] as
    `in_proj_b` and `in_proj_a` [Hv, H]; any other tensor as it is."""
    r, dk, dv = shape.num_v_heads // shape.num_k_heads, shape.head_k_dim, shape.head_v_dim
    head = name.rsplit(".", 2)[0]                      # ...linear_attn
    if name.endswith(".in_proj_qkvz.weight"):
        grouped = tensor.reshape(shape.num_k_heads, -1, tensor.shape[-1])
        q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=1)
        flat = [t.reshape(-1, tensor.shape[-1]) for t in (q, k, v, z)]
        return [(f"{head}.in_proj_qkv.weight", torch.cat(flat[:3])), (f"{head}.in_proj_z.weight", flat[3])]
    if name.endswith(".in_proj_ba.weight"):
        b, a = tensor.reshape(shape.num_k_heads, 2 * r, tensor.shape[-1]).split([r, r], dim=1)
        return [(f"{head}.in_proj_b.weight", b.reshape(-1, tensor.shape[-1])),
                (f"{head}.in_proj_a.weight", a.reshape(-1, tensor.shape[-1]))]
    return [(name, tensor)]


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next's language model (its MTP layer as Qwen3.5's)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names; the grouped projections split (`ungrouped`), then as Qwen3.5's."""
        shape = self.config.recurrent
        assert isinstance(shape, GatedDeltaNetShape)

        def split() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield from ungrouped(name, tensor, shape)
        return super().load_weights(split())
