"""Tensor parallelism at load time: a rank's share of the config and of each checkpoint tensor.

Every rank reads the checkpoint's HF-named tensors and keeps only its part (distributed/
tensor_parallel.py has the split): q and o by query heads, k and v by KV heads (each rank one KV
head, the same head on several ranks, where the ranks outnumber the KV heads), gate/up and down
by the MLP's width, the embedding and the output head by vocabulary (the last part padded with
zero rows). Norms are whole on every rank. A GGUF's own blocks are cut the same way without
rounding: by rows, or along a row in whole blocks where the cut falls on a block boundary (else
that layer is quantized from its fp32 part, as a safetensors model is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from phasewise.distributed import TensorParallel
from phasewise.models.config import ModelConfig

COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}   # rows cut
ROW = {"o_proj": "q", "down_proj": "mlp"}                                                         # columns cut
VOCAB = {"model.embed_tokens.weight", "lm_head.weight"}


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """A ValueError naming what does not divide, when `cfg` cannot be cut into `size` ranks."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return
    divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
    if cfg.num_heads % size:
        raise ValueError(f"tensor parallelism over {size} ranks: this model's {cfg.num_heads} query heads do not "
                         f"divide by {size} (sizes that work: {', '.join(map(str, divisors))})")
    kv = cfg.num_kv_heads
    if (kv % size if size <= kv else size % kv):
        raise ValueError(f"tensor parallelism over {size} ranks: {kv} KV heads can be neither split evenly nor "
                         f"replicated evenly over {size} ranks")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor parallelism over {size} ranks: the MLP's width {cfg.intermediate_size} does "
                         f"not divide by {size}")


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


def _vocab_rows(t: torch.Tensor | np.ndarray, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor | np.ndarray:
    """This rank's rows of a [vocab, ...] table (a tensor, or a GGUF weight's stored rows), the last part
    padded with zero rows (zero bytes are a zero block in every GGUF type)."""
    start, stop = tp.part(cfg.vocab_size)
    part, pad = t[start:stop], tp.padded(cfg.vocab_size) - (stop - start)
    if isinstance(t, torch.Tensor):
        return torch.cat([part, part.new_zeros((pad, *part.shape[1:]))])
    return np.concatenate([part, np.zeros((pad, *part.shape[1:]), dtype=part.dtype)])


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of the HF-named checkpoint tensor `name` of the full model `cfg`."""
    kind = _kind(name)
    if tp.size == 1 or kind is None:
        return t
    axis, what = kind
    if axis == "vocab":
        return _vocab_rows(t, cfg, tp)
    start, stop = _span(what, cfg, tp)
    return (t[start:stop] if axis == "column" else t[:, start:stop]).contiguous()


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig,
                  tp: TensorParallel) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each cut to this rank's part. Phi-3's fused qkv_proj and gate_up_proj
    are split into their parts first."""
    for name, t in weights:
        if tp.size > 1 and name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
            head, tail = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
            if "qkv_proj" in name:
                pieces = zip(("q_proj", "k_proj", "v_proj"), t.split([cfg.q_size, cfg.kv_size, cfg.kv_size]))
            else:
                pieces = zip(("gate_proj", "up_proj"), t.chunk(2))
            for part, piece in pieces:
                yield f"{head}.{part}.{tail}", shard_tensor(f"{head}.{part}.{tail}", piece, cfg, tp)
            continue
        yield name, shard_tensor(name, t, cfg, tp)


def shard_raw(name: str, type_name: str, raw: np.ndarray, cfg: ModelConfig,
              tp: TensorParallel) -> np.ndarray | None:
    """This rank's part of a GGUF weight's stored rows [rows, row bytes] (HF row order), cut without
    rounding; None when a row-parallel cut falls inside a block."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = _kind(name)
    if tp.size == 1 or kind is None:
        return raw
    axis, what = kind
    if axis == "vocab":
        return _vocab_rows(raw, cfg, tp)
    start, stop = _span(what, cfg, tp)
    if axis == "column":
        return raw[start:stop]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if start % block or stop % block:
        return None
    return np.ascontiguousarray(raw[:, start // block * size:stop // block * size])
