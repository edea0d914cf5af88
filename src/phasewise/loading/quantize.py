"""Swap a loaded model's nn.Linear layers for QuantLinear: `--quantization int8` and `--quantization q4`.

- int8: every linear (the tied output head too) quantized per output channel from its fp32
  weight; fused projections (qkv, gate_up) are quantized after fusion, one scale per fused row.
- q4: the GGUF file's own blocks, repacked without rounding (kernels/gguf_blocks.py): Q4_1/Q4_0
  as 4-bit blocks, Q8_0 (how the default file stores its tied embedding, used as the output head)
  as 8-bit blocks, Q5_0 (Gemma 3's q, k, gate and up) in its own 5.5 bits, Q4_K as 4-bit blocks
  with fp32 scales, Q5_K and Q6_K as 8-bit blocks with fp32 half-block scales. A fused projection concatenates its
  parts' blocks along N (parts of different types repacked to one format, exactly). A layer the
  file holds in another type (F32, F16, a safetensors model) falls back to int8 per channel.

The embedding lookup keeps its fp32 table either way.
"""

from __future__ import annotations

from torch import nn

from phasewise.distributed import TensorParallel
from phasewise.kernels import quant
from phasewise.kernels.gguf_blocks import GGUF_BLOCKS, pack_gguf
from phasewise.layers.quant_linear import QuantLinear
from phasewise.loading.gguf import GGUFFile
from phasewise.loading.sharding import shard_raw
from phasewise.models.config import ModelConfig

# --dtype value → weight format
WEIGHT_FORMATS = {"int8": "i8", "q4": "q4"}
# fused module name → the checkpoint names of its parts, in order along N (models/llama.py's fusion)
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def quantize_model(model: nn.Module, dtype: str, cfg: ModelConfig, gguf: GGUFFile | None = None,
                   tp: TensorParallel | None = None) -> dict[str, int]:
    """Replace every nn.Linear in place; returns how many layers ended in each format. `cfg` is the
    whole model's; with `tp`, the file's blocks are cut to this rank's part."""
    fmt = WEIGHT_FORMATS[dtype]
    targets = [(parent, name, child, f"{prefix}.{name}" if prefix else name)
               for prefix, parent in model.named_modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    counts: dict[str, int] = {}
    for parent, name, linear, path in targets:
        packed = None
        if fmt == "q4" and gguf is not None:
            packed = file_blocks(gguf, cfg, path, tp)
        if packed is not None and (packed.n, packed.k) == (linear.out_features, linear.in_features):
            packed = _to(packed, linear.weight.device)
        elif linear.in_features % quant.QK:
            counts["fp32"] = counts.get("fp32", 0) + 1   # no int8 blocks for this width: stays as it is
            continue
        else:
            packed = None
        module = QuantLinear.from_linear(linear, packed)
        setattr(parent, name, module)
        counts[module.fmt] = counts.get(module.fmt, 0) + 1
    return counts


def file_blocks(gguf: GGUFFile, cfg: ModelConfig, path: str, tp: TensorParallel | None = None) -> quant.PackedWeight | None:
    """The layer `path`'s weight from the file's own blocks (None when some part is not in a block
    format, or with `tp` when this rank's part does not cut along whole blocks)."""
    names = [f"{path}.weight"]
    if gguf.weight(names[0], cfg) is None and path.rsplit(".", 1)[-1] in FUSED_PARTS:
        head, fused = path.rsplit(".", 1)
        names = [f"{head}.{part}.weight" for part in FUSED_PARTS[fused]]
    parts = []
    for hf_name in names:
        weight = gguf.weight(hf_name, cfg)
        if weight is None or weight.type_name not in GGUF_BLOCKS:
            return None
        rows = shard_raw(hf_name, weight, cfg, tp)
        if rows is None:
            return None
        parts.append(pack_gguf(weight.type_name, rows))
    try:
        return parts[0] if len(parts) == 1 else quant.concat(parts)
    except ValueError:   # a part that does not fill whole tiles
        return None


def _to(w: quant.PackedWeight, device) -> quant.PackedWeight:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return quant.PackedWeight(fmt=w.fmt, n=w.n, k=w.k, blocks=move(w.blocks), scale=move(w.scale),
                              u5_tiles=w.u5_tiles)
