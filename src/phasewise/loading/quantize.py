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

import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.kernels import quant
from phasewise.kernels.gguf_blocks import pack_gguf
from phasewise.kernels.weight_formats import BY_GGUF_TYPE, INT8, fused_formats
from phasewise.layers.embedding import Embedding
from phasewise.layers.linear import Linear
from phasewise.loading import packed_cache
from phasewise.loading.gguf import GGUFFile
from phasewise.loading.gguf_tensor import GGUFTensor
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
                      cache: bool = True, kernels: Kernels | None = None,
                      min_bytes: int = packed_cache.MIN_BYTES) -> FileWeights:
    """Pack every linear layer of `model` (meta or not) the file holds in blocks, and the token table (no
    tp); `cfg` is the whole model's. With `cache` (no tp; a GGUF of `min_bytes` or more) they are views of
    the packed-weight cache's file (loading/packed_cache.py), found or packed into; `kernels` repack
    what they can. A tensor's pages of the file's map go once packed: memory holds the packed weights."""
    wanted = cache and tp is None and packed_cache.wanted(gguf.path, min_bytes)
    where = packed_cache.cache_path(gguf.path) if wanted else None
    kept = packed_cache.load(where) if where is not None else None
    layers = {path: (linear.out_features, linear.in_features) for path, linear in _linears(model)}
    if kept is not None and all(layers.get(p) == (w.rows, w.k) for p, w in kept[0].items()):
        return FileWeights(*kept)
    layout = file_layout(model, cfg, gguf) if tp is None else None
    writer = packed_cache.create(where, gguf.path, layout.linears, layout.embedding, layout.names) \
        if where is not None and layout is not None else None
    plan = FileWeights()
    todo = {p: layers[p] for p in layout.linears} if layout is not None else layers
    sizes = {p: _file_bytes(gguf, cfg, p) for p in todo}
    table = gguf.weight("model.embed_tokens.weight", cfg)
    own_table = table if _untied(layout) else None                # the token table, packed on its own
    progress = _Progress(sum(sizes.values()) + (own_table.data.nbytes if own_table is not None else 0))

    def pack(path: str) -> tuple[quant.PackedWeight, list[str]] | None:
        if writer is not None and (rows := _one_part(gguf, cfg, path)) is not None:
            _pack_into(writer, writer.linears[path], rows, kernels, progress)
            return writer.linears[path], part_names(gguf, cfg, path)
        found = file_blocks(gguf, cfg, path, tp, kernels)
        progress.step(sizes[path])
        if found is None or (found[0].rows, found[0].k) != todo[path]:
            return None
        if writer is None:
            return found
        writer.fill(writer.linears[path], found[0])      # the temporary goes: the map holds it
        return writer.linears[path], found[1]

    try:
        # two layers at a time: numpy's, torch's and the kernels' passes let go of the GIL
        with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
            for path, found in zip(todo, pool.map(pack, todo)):
                if found is not None:
                    plan.linears[path], names = found
                    plan.names.update(names)
        if layout is not None:
            _add_table(plan, layout, own_table, writer, kernels, progress)
        if writer is not None:
            writer.commit()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        progress.done()
    return plan


def _add_table(plan: FileWeights, layout: FileWeights, own_table: GGUFTensor | None,
               writer: packed_cache.Writer | None, kernels: Kernels | None, progress: _Progress) -> None:
    """Check the packed layers against their layout, then add the token table in blocks where the
    layout has it: the head's when tied, else `own_table` packed."""
    if plan.linears.keys() != layout.linears.keys():
        raise RuntimeError(f"packed {sorted(plan.linears.keys() ^ layout.linears.keys())[:3]} unlike "
                           "their layout")
    if layout.embedding is not None:
        plan.embedding = plan.linears["lm_head"] if own_table is None else \
            _pack_table(own_table, writer, kernels, progress)
        plan.names.add("model.embed_tokens.weight")


def _untied(layout: FileWeights | None) -> bool:
    """Whether the layout holds a token table of its own (not the head's)."""
    return layout is not None and layout.embedding is not None and \
        all(layout.embedding is not w for w in layout.linears.values())


def _pack_table(table: GGUFTensor, writer: packed_cache.Writer | None, kernels: Kernels | None,
                progress: _Progress) -> quant.PackedWeight:
    """The token table in its blocks: straight into the cache file, or packed in memory (its pages
    of the file's map let go)."""
    if writer is not None and writer.embedding is not None and not table.heads:
        return _pack_into(writer, writer.embedding, table, kernels, progress)
    packed = pack_gguf(table.type_name, table.raw(), kernels=kernels)
    _release(table.data)
    progress.step(table.data.nbytes)
    return packed


def file_layout(model: nn.Module, cfg: ModelConfig, gguf: GGUFFile) -> FileWeights:
    """What `plan_file_weights` packs (no tp), as weights of meta tensors: every layout follows from
    the file's tensor shapes, so nothing is read."""
    plan = FileWeights()
    for path, linear in _linears(model):
        found = file_blocks(gguf, cfg, path, meta=True)
        if found is not None and (found[0].rows, found[0].k) == (linear.out_features, linear.in_features):
            plan.linears[path], names = found
            plan.names.update(names)
    table = gguf.weight("model.embed_tokens.weight", cfg)
    if table is not None and table.type_name in BY_GGUF_TYPE:
        head = plan.linears.get("lm_head")
        tied = cfg.tie_word_embeddings and head is not None and "output.weight" not in gguf.tensors
        plan.embedding = head if tied else _full_width(_stand_in(table.type_name, *table.shape))
        plan.names.add("model.embed_tokens.weight")
    return plan


def _stand_in(type_name: str, n: int, k: int) -> quant.PackedWeight:
    """Rows [n, k] of a GGUF type as pack_gguf packs them, but one block wide: what quant.concat
    needs to lay out a fused projection (its tiles), on the CPU (ops on meta tensors import dynamo)."""
    f, nt = BY_GGUF_TYPE[type_name], -(-n // quant.TILE)
    scale = torch.zeros(nt, 1, quant.TILE * f.super_scales, dtype=torch.float16) if f.super_scales else None
    return quant.PackedWeight(fmt=f.name, n=n, k=k,
                              blocks=torch.zeros(nt, 1, f.block_bytes, dtype=torch.uint8), scale=scale)


def _full_width(w: quant.PackedWeight) -> quant.PackedWeight:
    """A stand-in at its real width, as meta tensors (the shapes packing gives)."""
    def meta(t: torch.Tensor, width: int) -> torch.Tensor:
        return torch.empty(t.shape[0], width, t.shape[2], dtype=t.dtype, device="meta")
    scale = None if w.scale is None else meta(w.scale, w.k // quant.QK // quant.SUPER)
    return replace(w, blocks=meta(w.blocks, w.k // quant.QK), scale=scale,
                   rest=tuple(_full_width(p) for p in w.rest))


def _one_part(gguf: GGUFFile, cfg: ModelConfig, path: str) -> GGUFTensor | None:
    """Layer `path`'s weight when it is one tensor of the file in blocks, stored in HF row order."""
    names = part_names(gguf, cfg, path)
    weight = gguf.weight(names[0], cfg) if len(names) == 1 else None
    return weight if weight is not None and weight.type_name in BY_GGUF_TYPE and not weight.heads else None


def _pack_into(writer: packed_cache.Writer, slot: quant.PackedWeight, weight: GGUFTensor,
               kernels: Kernels | None, progress: _Progress | None = None,
               chunk_rows: int = 4096) -> quant.PackedWeight:
    """Pack `weight` into its `slot` of the cache's map `chunk_rows` rows at a time (whole tiles),
    letting go of each run of the file's pages once packed: a 150k-row table costs no more memory
    than its slot."""
    for r0 in range(0, weight.shape[0], chunk_rows):
        rows = weight.data[r0:r0 + chunk_rows]
        writer.fill(slot, pack_gguf(weight.type_name, rows, kernels=kernels), r0 // quant.TILE)
        _release(rows)
        if progress is not None:
            progress.step(rows.nbytes)
    return slot


def _file_bytes(gguf: GGUFFile, cfg: ModelConfig, path: str) -> int:
    return sum(w.data.nbytes for n in part_names(gguf, cfg, path) if (w := gguf.weight(n, cfg)) is not None)


def _release(data: np.ndarray) -> None:
    """Let go of this process's pages of `data`, a view of a file's read-only map (the page cache
    keeps them; a later read maps them again): packing reads each weight once."""
    base: object = data
    while isinstance(base, np.ndarray):
        base = base.base
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return                                                  # not a file's map: nothing to let go
    page = mmap.PAGESIZE
    offset = data.ctypes.data - np.frombuffer(base, dtype=np.uint8).ctypes.data
    lo, hi = -(-offset // page) * page, (offset + data.nbytes) // page * page
    if 0 <= lo < hi <= len(base):
        base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class _Progress:
    """A line on stderr while a first load packs for more than two seconds: live on a terminal,
    else one line at the end."""

    def __init__(self, total: int) -> None:
        self.total, self.count, self.started, self.shown = total, 0, time.perf_counter(), False
        self.lock, self.last = threading.Lock(), 0.0

    def step(self, nbytes: int) -> None:
        """`nbytes` more of the file packed (from any thread)."""
        with self.lock:
            self.count += nbytes
            now = time.perf_counter()
            if (now - self.started > 2 and sys.stderr.isatty() or self.shown) and now - self.last > 0.1:
                self.shown, self.last = True, now
                print(f"\rphasewise: packing the file's weights {100 * self.count // max(self.total, 1)}% "
                      f"({self.count / 1e9:.2f} of {self.total / 1e9:.2f} GB)\033[K", end="", file=sys.stderr,
                      flush=True)

    def done(self) -> None:
        if self.shown or time.perf_counter() - self.started > 2:
            head, tail = ("\r", "\033[K") if self.shown else ("", "")
            print(f"{head}phasewise: packed the file's weights ({self.total / 1e9:.2f} GB) in "
                  f"{time.perf_counter() - self.started:.1f} s{tail}", file=sys.stderr, flush=True)


def packed_bytes(model: nn.Module, cfg: ModelConfig, gguf: GGUFFile) -> tuple[float, float]:
    """(bytes the q4 load packs, bytes of the same tensors in the file), without packing: each linear
    of `model` (meta is fine) in its parts' formats (int8 for other types) and an untied token table
    in its own."""
    packed = stored = 0.0
    for path, linear in _linears(model):
        found = [gguf.weight(n, cfg) for n in part_names(gguf, cfg, path)]
        parts = [p for p in found if p is not None]
        if len(parts) < len(found):
            continue
        # int8 throughout when a part is in no block format; q5 parts before q8 ones as U5 bytes
        fmts = fused_formats([BY_GGUF_TYPE.get(p.type_name, INT8) for p in parts])
        packed += sum(f.bits_per_weight() / 8 * p.shape[0] for f, p in zip(fmts, parts)) * linear.in_features
        stored += sum(p.data.nbytes for p in parts)
    table = gguf.weight("model.embed_tokens.weight", cfg)
    if table is not None and (not cfg.tie_word_embeddings or "output.weight" in gguf.tensors):
        fmt = BY_GGUF_TYPE.get(table.type_name, INT8)
        packed += fmt.bits_per_weight() / 8 * table.shape[0] * table.shape[1]
        stored += table.data.nbytes
    return packed, stored


def fill_file_weights(model: nn.Module, plan: FileWeights) -> None:
    """Fill the planned layers with their blocks (each keeps its loaded bias), and the token table."""
    moved: dict[int, quant.PackedWeight] = {}      # a tied table moves once: head and embedding share it
    def to(w: quant.PackedWeight, device: torch.device | None) -> quant.PackedWeight:  # noqa: E306
        return moved.setdefault(id(w), _to(w, device))
    device = None
    for path, linear in _linears(model):
        device = linear.dense_weight().device
        if path in plan.linears:
            linear.fill_blocks(to(plan.linears[path], device))
    if plan.embedding is not None:
        table = model.get_submodule("model.embed_tokens")
        if not isinstance(table, Embedding):
            raise TypeError(f"model.embed_tokens is a {type(table).__name__}, not an Embedding")
        table.fill_blocks(to(plan.embedding, device))


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
                kernels: Kernels | None = None,
                meta: bool = False) -> tuple[quant.PackedWeight, list[str]] | None:
    """The layer `path`'s weight from the file's own blocks and the checkpoint names of its parts
    (None when some part is not in a block format, or with `tp` when this rank's part does not cut
    along whole blocks); `meta` (no tp): only its shapes, as meta tensors, nothing read."""
    names = part_names(gguf, cfg, path)
    parts = []
    for hf_name in names:
        weight = gguf.weight(hf_name, cfg)
        if weight is None or weight.type_name not in BY_GGUF_TYPE:
            return None
        if meta:
            parts.append(_stand_in(weight.type_name, *weight.shape))
            continue
        rows = shard_raw(hf_name, weight, cfg, tp)
        if rows is None:
            return None
        parts.append(pack_gguf(weight.type_name, rows, kernels=kernels))
        _release(weight.data)
    try:
        packed = parts[0] if len(parts) == 1 else quant.concat(parts)
    except ValueError:   # a part that does not fill whole tiles
        return None
    return (_full_width(packed) if meta else packed), names


def _to(w: quant.PackedWeight, device: torch.device | None) -> quant.PackedWeight:
    scale = None if w.scale is None else w.scale.to(device)
    return quant.PackedWeight(fmt=w.fmt, n=w.n, k=w.k, blocks=w.blocks.to(device), scale=scale,
                              u5_tiles=w.u5_tiles, rest=tuple(_to(p, device) for p in w.rest))
