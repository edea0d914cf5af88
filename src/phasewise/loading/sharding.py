"""Tensor parallelism at load time: a rank's share of the config and of each checkpoint tensor.

Each rank reads only its part of every HF-named checkpoint tensor (distributed/tensor_parallel.py
has the split): q and o by query heads, k and v by KV heads (each rank one KV head, the same head
on several ranks, where the ranks outnumber the KV heads), gate/up and down by the MLP's width,
the embedding and the output head by vocabulary (the last part padded with zero rows). Norms are
whole on every rank. The part is cut in the file, not after reading: safetensors' `get_slice`, a
GGUF's stored blocks before dequantizing (loading/gguf_tensor.py). A GGUF's blocks are also kept
as they are, cut without rounding: by rows, or along a row in whole blocks where the cut falls on
a block boundary (else that layer is quantized from its fp32 part, as a safetensors model is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np
import torch

from phasewise.distributed import TensorParallel
from phasewise.loading.gguf_tensor import GGUFTensor
from phasewise.models.config import ModelConfig

COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}  # rows cut
ROW = {"o_proj": "q", "down_proj": "mlp"}                                                        # columns cut
VOCAB = {"model.embed_tokens.weight", "lm_head.weight"}


class Readable(Protocol):
    """A checkpoint tensor not yet read (loading/safetensors.py, loading/gguf_tensor.py)."""
    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class Part:
    """What one rank keeps of a tensor: rows, or columns, then `pad` zero rows (the vocabulary's
    last part)."""
    rows: slice | None = None
    cols: slice | None = None
    pad: int = 0

    def shifted(self, skip: int) -> Part:
        """The same part of a tensor that starts `skip` rows into a fused one."""
        if self.rows is None or not skip:
            return self
        return dataclasses.replace(self, rows=slice(self.rows.start + skip, self.rows.stop + skip))


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """A ValueError naming what does not divide, when `cfg` cannot be cut into `size` ranks."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return
    if cfg.recurrent_layers:
        raise ValueError(f"tensor parallelism over {size} ranks: {cfg.architecture} (a hybrid with recurrent "
                         f"layers) is not split across ranks yet: run it with --tensor-parallel-size 1")
    if cfg.num_experts or cfg.qk_norm_whole:
        raise ValueError(f"tensor parallelism over {size} ranks: {cfg.architecture} (a mixture of experts) "
                         "is not split across ranks yet: run it with --tensor-parallel-size 1")
    works = ", ".join(str(d) for d in range(1, cfg.num_heads + 1) if _splits(cfg, d))
    if cfg.num_heads % size:
        raise ValueError(f"tensor parallelism over {size} ranks: this model's {cfg.num_heads} query heads do "
                         f"not divide by {size} (sizes that work: {works})")
    kv = cfg.num_kv_heads
    if (kv % size if size <= kv else size % kv):
        raise ValueError(f"tensor parallelism over {size} ranks: {kv} KV heads can be neither split evenly "
                         f"nor replicated evenly over {size} ranks")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor parallelism over {size} ranks: the MLP's width {cfg.intermediate_size} "
                         f"does not divide by {size}")


def _splits(cfg: ModelConfig, size: int) -> bool:
    """Whether `size` ranks split the query heads and MLP width evenly and the KV heads evenly or by
    replication."""
    kv = cfg.num_kv_heads
    return (cfg.num_heads % size == 0 and cfg.intermediate_size % size == 0
            and (kv % size == 0 if size <= kv else size % kv == 0))


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The sizes one rank holds: its query heads, KV heads and MLP width (the vocabulary stays whole
    in the config; the embedding and head take `tp.padded(vocab_size)` rows)."""
    if tp.size == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size,
                               num_kv_heads=max(1, cfg.num_kv_heads // tp.size),
                               intermediate_size=cfg.intermediate_size // tp.size)


def _span(kind: str, cfg: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """[start, stop) of this rank's part along the cut axis, in the full tensor's units."""
    D = cfg.head_dim
    if kind == "q":
        n = cfg.num_heads // tp.size * D
        return tp.rank * n, (tp.rank + 1) * n
    if kind == "kv":
        kv = cfg.num_kv_heads
        if tp.size <= kv:
            n = kv // tp.size * D
            return tp.rank * n, (tp.rank + 1) * n
        head = tp.rank * kv // tp.size                  # replicated: ranks share a head
        return head * D, (head + 1) * D
    n = cfg.intermediate_size // tp.size
    return tp.rank * n, (tp.rank + 1) * n


def _kind(name: str) -> tuple[str, str] | None:
    """(axis "column" | "row" | "vocab", what is cut) of an HF tensor name, or None (whole)."""
    if name in VOCAB:
        return "vocab", "vocab"
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in COLUMN:
        return "column", COLUMN[parts[-2]]
    if len(parts) >= 2 and parts[-2] in ROW and parts[-1] == "weight":
        return "row", ROW[parts[-2]]
    return None


def part_of(name: str, cfg: ModelConfig, tp: TensorParallel | None) -> Part:
    """This rank's part of the HF-named checkpoint tensor `name` of the full model `cfg`."""
    kind = _kind(name)
    if tp is None or tp.size == 1 or kind is None:
        return Part()
    axis, what = kind
    if axis == "vocab":
        start, stop = tp.part(cfg.vocab_size)
        return Part(rows=slice(start, stop), pad=tp.padded(cfg.vocab_size) - (stop - start))
    start, stop = _span(what, cfg, tp)
    return Part(rows=slice(start, stop)) if axis == "column" else Part(cols=slice(start, stop))


def _read(t: torch.Tensor | Readable, part: Part) -> torch.Tensor:
    """`part` of t, padded."""
    if isinstance(t, torch.Tensor):
        out = t if part.rows is None else t[part.rows]
        out = out if part.cols is None else out[:, part.cols]
    else:
        out = t.read(part.rows, part.cols)
    if part.pad:
        out = torch.cat([out, out.new_zeros((part.pad, *out.shape[1:]))])
    return out.contiguous()


def _pieces(name: str, cfg: ModelConfig) -> list[tuple[str, int]]:
    """(part name, first row) of Phi-3's fused qkv_proj and gate_up_proj (their parts' rows follow one
    another); [(name, 0)] for any other tensor."""
    head, _, tail = name.rpartition(".")
    if head.endswith(".qkv_proj"):
        stem = head.removesuffix("qkv_proj")
        return [(f"{stem}q_proj.{tail}", 0), (f"{stem}k_proj.{tail}", cfg.q_size),
                (f"{stem}v_proj.{tail}", cfg.q_size + cfg.kv_size)]
    if head.endswith(".gate_up_proj") and tail == "weight":
        stem = head.removesuffix("gate_up_proj")
        return [(f"{stem}gate_proj.weight", 0), (f"{stem}up_proj.weight", cfg.intermediate_size)]
    return [(name, 0)]


def shard_weights(weights: Iterable[tuple[str, torch.Tensor | Readable]], cfg: ModelConfig,
                  tp: TensorParallel | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each read as this rank's part (whole without `tp`); a fused tensor
    is cut part by part, and its parts come out under their own names."""
    for name, t in weights:
        if tp is None or tp.size == 1:
            yield name, _read(t, Part())
            continue
        for part_name, skip in _pieces(name, cfg):
            yield part_name, _read(t, part_of(part_name, cfg, tp).shifted(skip))


def shard_raw(name: str, weight: GGUFTensor, cfg: ModelConfig,
              tp: TensorParallel | None) -> np.ndarray | None:
    """This rank's part of a GGUF weight's stored rows [rows, row bytes] (HF row order; a fused
    weight's parts one after another), cut without rounding; None when a row-parallel cut falls
    inside a block."""
    if tp is None or tp.size == 1:
        return weight.raw()
    out: list[np.ndarray] = []
    for part_name, skip in _pieces(name, cfg):
        part = part_of(part_name, cfg, tp).shifted(skip)
        raw = weight.raw(part.rows, part.cols)
        if raw is None:
            return None
        out += [raw, np.zeros((part.pad, raw.shape[1]), dtype=raw.dtype)] if part.pad else [raw]
    return out[0] if len(out) == 1 else np.concatenate(out)
