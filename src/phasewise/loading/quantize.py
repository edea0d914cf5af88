"""Fill a model's linear layers with quantized blocks: `--quantization int8` and `--quantization q4`.

- int8: every linear (the tied output head too) quantized per output channel from its fp32
  weight; fused projections (qkv, gate_up) are quantized after fusion, one scale per fused row.
- q4: the GGUF file's own blocks, repacked without rounding (kernels/gguf_blocks.py): Q4_1/Q4_0
  as q4, Q8_0 as q8, Q5_0 in its own 5.5 bits, Q4_K and Q6_K at the file's width (k4, q6k), Q5_K
  as k6. A fused projection concatenates its parts' blocks along N, parts of different types each
  in its own format (quant.concat). A layer the file holds in another type (F32, F16, a
  safetensors model) falls back to int8 per channel.

With q4 the file's blocks are planned before any weight is read (`plan_file_weights`): the
loader then never reads those weights in fp32, and the token table stays in its blocks too
(its `Embedding` in blocks, sharing the head's when tied), so memory holds the packed weights and
little else. Every layer is filled in place (layers/linear.py): no module is replaced.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.kernels import quant
from phasewise.kernels.gguf_blocks import GGUF_BLOCKS, pack_gguf
from phasewise.layers.linear import Linear
from phasewise.loading import packed_cache
from phasewise.loading.gguf import GGUFFile
from phasewise.loading.sharding import shard_raw
from phasewise.models.config import ModelConfig
from phasewise.kernels.kernel_api import Kernels

# --dtype value → weight format
WEIGHT_FORMATS = {"int8": "i8", "q4": "q4"}
# fused module name → the checkpoint names of its parts, in order along N (models/llama.py's fusion)
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class FileWeights:
    """What a GGUF's own blocks give a model before its weights are read: packed linear layers
    by module path, the token table (None: it stays dense), and the checkpoint
    names they stand for (the loader skips reading those)."""
    linears: dict[str, quant.PackedWeight] = field(default_factory=dict)
    embedding: quant.PackedWeight | None = None
    names: set[str] = field(default_factory=set)


def plan_file_weights(model: nn.Module, cfg: ModelConfig, gguf: GGUFFile, tp: TensorParallel | None = None,
                      cache: bool = True, kernels: Kernels | None = None) -> FileWeights:
    """Pack every linear layer of `model` (meta or not) the file holds in blocks, and the token table
    (without tp); `cfg` is the whole model's. With `cache` (and no tp) the packed layers come from,
    or go to, the packed-weight cache (loading/packed_cache.py). `kernels` (a KernelSet, or None)
    repacks the types it can (gguf_blocks.pack_gguf)."""
    where = packed_cache.cache_path(gguf.path) if cache and tp is None and packed_cache.wanted(gguf.path) else None
    kept = packed_cache.load(where) if where is not None else None
    layers = {path: (linear.out_features, linear.in_features) for path, linear in _linears(model)}
    if kept is not None and all(layers.get(p) == (w.rows, w.k) for p, w in kept[0].items()):
        return FileWeights(*kept)
    plan = FileWeights()
    progress = _Progress(len(layers))
    # two layers at a time: numpy's and torch's element-wise passes let go of the GIL
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        packed = pool.map(lambda path: file_blocks(gguf, cfg, path, tp, kernels), layers)
        for (path, shape), found in zip(layers.items(), packed):
            if found is not None and (found[0].rows, found[0].k) == shape:
                plan.linears[path], names = found
                plan.names.update(names)
            progress.step(path)
    table = gguf.weight("model.embed_tokens.weight", cfg)
    if tp is None and table is not None and table.type_name in GGUF_BLOCKS:
        head = plan.linears.get("lm_head")
        tied = cfg.tie_word_embeddings and head is not None and "output.weight" not in gguf.tensors
        plan.embedding = head if tied else pack_gguf(table.type_name, table.raw(), kernels=kernels)
        plan.names.add("model.embed_tokens.weight")
    progress.done()
    if where is not None:
        packed_cache.save(where, gguf.path, plan.linears, plan.embedding, plan.names)
    return plan


class _Progress:
    """A line on stderr while a first load packs for more than two seconds."""

    def __init__(self, total: int) -> None:
        self.total, self.count, self.started, self.shown = total, 0, time.perf_counter(), False

    def step(self, path: str) -> None:
        self.count += 1
        if time.perf_counter() - self.started > 2 and sys.stderr.isatty() or self.shown:
            self.shown = True
            print(f"\rphasewise: packing the file's weights {self.count}/{self.total} ({path})\033[K",
                  end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.shown or time.perf_counter() - self.started > 2:
            head, tail = ("\r", "\033[K") if self.shown else ("", "")
            print(f"{head}phasewise: packed the file's weights in {time.perf_counter() - self.started:.1f} s{tail}",
                  file=sys.stderr, flush=True)


def packed_bytes(model: nn.Module, cfg: ModelConfig, gguf: GGUFFile) -> tuple[float, float]:
    """(bytes the q4 load packs, bytes of the same tensors in the file), without packing: each linear
    of `model` (meta is fine) in its parts' formats (int8 for other types) and an untied token table
    in its own."""
    packed = stored = 0.0
    for path, linear in _linears(model):
        parts = [gguf.weight(n, cfg) for n in part_names(gguf, cfg, path)]
        if any(p is None for p in parts):
            continue
        fmts = [GGUF_BLOCKS.get(p.type_name, "i8") for p in parts]
        if "i8" in fmts or (set(fmts) == {"q5", "q8"} and fmts == sorted(fmts, key=lambda f: f == "q8")):
            fmts = ["i8" if "i8" in fmts else "q8"] * len(fmts)     # int8 throughout; q5 parts as U5 bytes
        packed += sum(quant.bits_per_weight(f) / 8 * p.shape[0] for f, p in zip(fmts, parts)) * linear.in_features
        stored += sum(p.data.nbytes for p in parts)
    table = gguf.weight("model.embed_tokens.weight", cfg)
    if table is not None and (not cfg.tie_word_embeddings or "output.weight" in gguf.tensors):
        packed += quant.bits_per_weight(GGUF_BLOCKS.get(table.type_name, "i8")) / 8 * table.shape[0] * table.shape[1]
        stored += table.data.nbytes
    return packed, stored


def fill_file_weights(model: nn.Module, plan: FileWeights) -> None:
    """Fill the planned layers with their blocks (each keeps its loaded bias), and the token table."""
    moved: dict[int, quant.PackedWeight] = {}      # a tied table moves once: head and embedding share it
    def to(w: quant.PackedWeight, device) -> quant.PackedWeight:  # noqa: E306
        return moved.setdefault(id(w), _to(w, device))
    device = None
    for path, linear in _linears(model):
        device = linear.weight.device
        if path in plan.linears:
            linear.fill_blocks(to(plan.linears[path], device))
    if plan.embedding is not None:
        model.get_submodule("model.embed_tokens").fill_blocks(to(plan.embedding, device))


def quantize_rest(model: nn.Module) -> None:
    """Quantize every linear layer still dense to int8 per channel (with q4, what the file does not
    hold in blocks: `plan_file_weights` took the rest)."""
    for _, linear in _linears(model):
        if linear.in_features % quant.QK == 0:   # else no int8 blocks for this width: it stays dense
            linear.quantize()


def part_names(gguf: GGUFFile, cfg: ModelConfig, path: str) -> list[str]:
    """The checkpoint names of layer `path`'s weight: its own, or its fused parts' (qkv, gate_up)."""
    name = f"{path}.weight"
    if gguf.weight(name, cfg) is None and path.rsplit(".", 1)[-1] in FUSED_PARTS:
        head, fused = path.rsplit(".", 1)
        return [f"{head}.{part}.weight" for part in FUSED_PARTS[fused]]
    return [name]


def _linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """The linear layers still dense, by module path."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, Linear) and m.form == "dense"]


def file_blocks(gguf: GGUFFile, cfg: ModelConfig, path: str, tp: TensorParallel | None = None,
                kernels: Kernels | None = None) -> tuple[quant.PackedWeight, list[str]] | None:
    """The layer `path`'s weight from the file's own blocks and the checkpoint names of its parts
    (None when some part is not in a block format, or with `tp` when this rank's part does not cut
    along whole blocks)."""
    names = part_names(gguf, cfg, path)
    parts = []
    for hf_name in names:
        weight = gguf.weight(hf_name, cfg)
        if weight is None or weight.type_name not in GGUF_BLOCKS:
            return None
        rows = shard_raw(hf_name, weight, cfg, tp)
        if rows is None:
            return None
        parts.append(pack_gguf(weight.type_name, rows, kernels=kernels))
    try:
        return (parts[0] if len(parts) == 1 else quant.concat(parts)), names
    except ValueError:   # a part that does not fill whole tiles
        return None


def _to(w: quant.PackedWeight, device) -> quant.PackedWeight:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return quant.PackedWeight(fmt=w.fmt, n=w.n, k=w.k, blocks=move(w.blocks), scale=move(w.scale),
                              u5_tiles=w.u5_tiles, rest=tuple(_to(p, device) for p in w.rest))
