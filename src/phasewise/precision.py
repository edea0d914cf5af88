"""The weight and KV-cache precision an engine runs at: what was asked for, or by default ("auto")
the fastest pair measured to stay within 0.5% perplexity of the file's weights in fp32.

Measured with benchmarks/quality.py on the default model and the repo's text (docs/benchmarks.md):
q4 weights (a GGUF's own Q4_0/Q4_1/Q8_0 blocks) with the int8 KV cache +0.41% (+0.19% before its
readers took the query in int8 steps too), q4 alone +0.23%,
int8 per-channel weights -0.05%, the int8 KV cache alone about +0.2%. Both int8 paths need the
compiled kernels to be fast; without them (another device, `kernels="torch"`, no compiler) the
default is the file's weights in fp32 with a float KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from phasewise.kernels.kernel_api import Kernels

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "int8", "q4")
KV_DTYPES = ("model", "int8")


@dataclass(frozen=True)
class Precision:
    weights: str            # fp32 | bf16 | fp16 | int8 | q4
    kv: str                 # model (the weights' float type) | int8
    chosen: bool            # picked by "auto" rather than asked for
    why: str                # one line on the choice

    def describe(self) -> str:
        kv = "int8 KV cache" if self.kv == "int8" else "float KV cache"
        how = "chosen for this machine" if self.chosen else "as asked"
        return f"precision: {self.weights} weights, {kv} ({how}: {self.why})"


def weights_setting(dtype: str, quantization: str = "auto") -> str:
    """The one weights setting an engine takes (auto, fp32, bf16, fp16, int8 or q4) from the float
    type (`dtype`: auto, fp32, bf16, fp16) and the weight format (`quantization`: auto, none, int8,
    q4). ValueError when either is unknown or they disagree."""
    if quantization not in ("auto", "none", "int8", "q4"):
        raise ValueError(f"quantization must be auto, none, int8 or q4, got {quantization!r}")
    if dtype not in ("auto", "fp32", "bf16", "fp16"):
        hint = f": the weight format is quantization={dtype!r}" if dtype in ("int8", "q4") else ""
        raise ValueError(f"dtype must be auto, fp32, bf16 or fp16, got {dtype!r}{hint}")
    if quantization in ("int8", "q4"):
        if dtype not in ("auto", "fp32"):
            raise ValueError(f"quantization {quantization} runs its activations in fp32: drop dtype {dtype}")
        return quantization
    return "fp32" if quantization == "none" and dtype == "auto" else dtype


def gguf_block_types(path: Path) -> set[str]:
    """The GGUF types of a file's decoder weight matrices (empty for a folder or another file)."""
    if path.is_dir() or path.suffix != ".gguf":
        return set()
    from gguf.constants import GGMLQuantizationType

    from phasewise.loading.gguf import GGUFFile

    tensors = GGUFFile(path).tensors
    return {GGMLQuantizationType(t.ggml_type).name for name, t in tensors.items()
            if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) == 2}


def choose(path: Path, dtype: str, kv_dtype: str, kernels: Kernels | None) -> Precision:
    """Resolve "auto" for the weights and the KV cache. An explicit weight dtype keeps the KV cache
    in its float type unless int8 is asked for; "auto" weights take the int8 cache where kernels run."""
    from phasewise.kernels.gguf_blocks import GGUF_BLOCKS

    if dtype not in WEIGHT_DTYPES + ("auto",):
        raise ValueError(f"unsupported dtype {dtype!r} (choose from auto, {', '.join(WEIGHT_DTYPES)})")
    if kv_dtype not in KV_DTYPES + ("auto",):
        raise ValueError(f"kv_dtype must be 'auto', 'model' or 'int8', got {kv_dtype!r}")
    fast = dtype == "auto" and kernels is not None
    kv = kv_dtype if kv_dtype != "auto" else "int8" if fast else "model"
    if dtype != "auto":
        return Precision(dtype, kv, False, "--dtype/--kv-dtype")
    if kernels is None:
        return Precision("fp32", kv, True, "no compiled kernels here, so the file's weights in fp32")
    types = gguf_block_types(path)
    blocks = sorted(types & set(GGUF_BLOCKS))
    if blocks:
        others = sorted(types - set(GGUF_BLOCKS) - {"F32", "F16", "BF16"})
        rest = f", int8 per channel for its {'/'.join(others)} layers" if others else ""
        return Precision("q4", kv, True, f"the file's own {'/'.join(blocks)} blocks{rest} on the {kernels.isa} "
                                         "kernels, within 0.5% perplexity of fp32 as measured")
    return Precision("int8", kv, True, f"int8 per-channel weights on the {kernels.isa} kernels (measured apart: "
                                       "-0.05% perplexity, the int8 KV cache +0.2%)")
