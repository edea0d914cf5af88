"""The weight and KV-cache precision an engine runs at: what was asked for, or by default ("auto")
the fastest pair measured to stay within 0.5% perplexity of the file's weights in fp32.

Perplexity is a property of each file: benchmarks/quality.py measures it (the repo's text,
teacher-forced) and `--record` keeps the figures in the cache (`measured`), and MEASURED holds
those of the files phasewise ships. A GGUF's own blocks (q4) run with the int8 KV cache where that
pair holds 0.5% on the file and on a held-out text for the model's family (`INT8_KV_HOLDS`), and with
a float KV cache otherwise, so a file nobody measured gets what its family measured, never a guess.
The int8 cache quantizes K per channel over groups of 16 tokens (docs/architecture.md): Qwen's large,
nearly constant key channels had cost +9.2% perplexity with one scale per token and head on a
held-out text (Qwen2.5-Coder-0.5B, 2,048-token windows), and cost nothing now.
int8 per-channel weights measured -0.05% on the default model. Both int8 paths need the compiled
kernels to be fast; without them (another device, `kernels="torch"`, no compiler) the default is
the file's weights in fp32 with a float KV cache. A mixture of experts is no different: its experts
run in the file's blocks (kernels/csrc/expert_mlp.cpp). The int4 KV cache costs +1.7-1.8% on the same
held-out text (`INT4_KV_MEASURED`), so "auto" picks it only where a measurement says it holds 0.5%
(`INT4_KV_HOLDS`, or the file's own "q4/int4"): `--kv-dtype int4` asks for it, and the line says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from phasewise.config import WEIGHT_DTYPES, default_cache_dir
from phasewise.kernels.kernel_api import Kernels

KV_DTYPES = ("model", "int8", "int4")
# Families whose int8 KV cache was measured within LIMIT on a held-out text, with what it cost against a
# float cache at fp32 weights (benchmarks/quality.py --dtypes fp32,fp32/int8 --text
# /usr/share/common-licenses/GPL-3 --window 2048: 7.5k tokens, not in the repo).
INT8_KV_HOLDS = {"llama": "SmolLM2-135M +0.03% on a held-out text",
                 "qwen2": "Qwen2.5-Coder-0.5B -0.04%, 1.5B +0.05% on a held-out text"}
# the int8 cache's layout a record's "…/int8" figures were measured with (2: K per channel)
INT8_KV_SCHEME = 2
# Families whose int4 KV cache (docs/architecture.md, "int4 KV cache") was measured within LIMIT of fp32 in
# total at the file's q4 weights: none, so "auto" never picks it (`--kv-dtype int4` asks for it); a file's
# own record ("q4/int4" of INT4_KV_SCHEME, benchmarks/quality.py --record) within LIMIT picks it too.
INT4_KV_HOLDS: dict[str, str] = {}
# What the int4 cache cost against a float one where it was measured (fp32 weights, the same held-out text
# and windows as INT8_KV_HOLDS; docs/notes/kv_quantization.md), for the line of an engine that asks for it.
INT4_KV_MEASURED = {"llama": "SmolLM2-135M +1.67% on a held-out text, over 0.5%",
                    "qwen2": "Qwen2.5-Coder-0.5B +1.82% on a held-out text, over 0.5%"}
INT4_KV_SCHEME = 1          # the int4 cache's layout a record's "…/int4" figures were measured with
LIMIT = 0.005               # the perplexity a default precision may add to the file's weights in fp32

# Perplexity against the file's weights in fp32 (benchmarks/quality.py, lighthouses.txt; docs/benchmarks.md)
# of the files phasewise ships, by file name and size: "q4/int8" the default pair, "q4" with a float KV cache.
MEASURED: dict[tuple[str, int | None], dict[str, float]] = {
    ("SmolLM2-135M-Instruct.Q4_1.gguf", 98362432): {"q4/int8": 0.0011, "q4": 0.0023},
    ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491400064): {"q4/int8": 0.0047, "q4": 0.0029},
    ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1117320768): {"q4/int8": 0.0031, "q4": 0.0021},
}


@dataclass(frozen=True)
class Precision:
    weights: str            # fp32 | bf16 | fp16 | int8 | q4
    kv: str                 # model (the weights' float type) | int8 | int4
    chosen: bool            # picked by "auto" rather than asked for
    why: str                # one line on the choice

    def describe(self) -> str:
        kv = f"{self.kv} KV cache" if self.kv in ("int8", "int4") else "float KV cache"
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
            if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) >= 2}


def choose(path: Path, dtype: str, kv_dtype: str, kernels: Kernels | None, family: str) -> Precision:
    """Resolve "auto" for the weights and the KV cache of a model of architecture `family`. An explicit
    weight dtype keeps the KV cache in its float type unless int8 or int4 is asked for; "auto" weights take
    the int8 cache where kernels run and the family holds it (INT8_KV_HOLDS), int4 only where measured to
    hold (INT4_KV_HOLDS, or the file's own figures)."""
    from phasewise.kernels.weight_formats import BY_GGUF_TYPE

    if dtype not in WEIGHT_DTYPES + ("auto",):
        raise ValueError(f"unsupported dtype {dtype!r} (choose from auto, {', '.join(WEIGHT_DTYPES)})")
    if kv_dtype not in KV_DTYPES + ("auto",):
        raise ValueError(f"kv_dtype must be 'auto', 'model', 'int8' or 'int4', got {kv_dtype!r}")
    fast, asked = dtype == "auto" and kernels is not None, kv_dtype != "auto"
    kv = kv_dtype if asked else "int8" if fast else "model"
    if dtype != "auto":
        return Precision(dtype, kv, False, f"--dtype {dtype}" + (_kv_note(family, kv, True) if asked else
                                                                 "; a KV cache of the weights' float type"))
    if kernels is None:
        return Precision("fp32", kv, True, "no compiled kernels here, so the file's weights in fp32"
                         + (_kv_note(family, kv, True) if asked
                            else "; a float KV cache (the int8 one needs them)"))
    types = gguf_block_types(path)
    blocks = sorted(types & set(BY_GGUF_TYPE))
    if blocks:
        others = sorted(types - set(BY_GGUF_TYPE) - {"F32", "F16", "BF16"})
        rest = f", int8 per channel for its {'/'.join(others)} layers" if others else ""
        kv, quality = _q4_kv(measured(path), kv_dtype, family)
        own = f"the file's own {'/'.join(blocks)} blocks{rest} on the {kernels.isa} kernels, {quality}"
        return Precision("q4", kv, True, own)
    if not asked and family not in INT8_KV_HOLDS:
        kv = "model"
    return Precision("int8", kv, True, f"int8 per-channel weights on the {kernels.isa} kernels (measured "
                                       f"apart: -0.05% perplexity){_kv_note(family, kv, asked)}")



def _key(path: Path) -> tuple[str, int]:
    return path.name, path.stat().st_size


def record_path(path: Path) -> Path:
    """Where benchmarks/quality.py --record keeps a file's figures."""
    name, size = _key(path)
    return default_cache_dir() / "quality" / f"{name}-{size}.json"


def measured(path: Path) -> dict[str, float]:
    """A file's perplexity per precision ("q4/int8", "q4", ...) relative to its weights in fp32, as recorded
    in the cache or shipped in MEASURED; empty when nobody measured it. A record's int8 (int4) cache
    figures count only when it names the cache's current layout ("int8_kv" INT8_KV_SCHEME, "int4_kv"
    INT4_KV_SCHEME)."""
    try:
        record = {k: float(v) for k, v in json.loads(record_path(path).read_text()).items()}
        current = {"int8": record.pop("int8_kv", None) == INT8_KV_SCHEME,
                   "int4": record.pop("int4_kv", None) == INT4_KV_SCHEME}
        return {k: v for k, v in record.items() if current.get(k.rpartition("/")[2], True)}
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    name, size = _key(path)
    return MEASURED.get((name, size)) or MEASURED.get((name, None)) or {}


def _kv_note(family: str, kv: str, asked: bool) -> str:
    """What the precision line says of the KV cache beside the weights: asked for by --kv-dtype (and what the
    family measured), or what the family's held-out measurement made "auto" choose."""
    if asked:
        note = {"model": "a float KV cache", "int8": "the int8 KV cache", "int4": "the int4 KV cache"}[kv]
        figures = {"int8": INT8_KV_HOLDS, "int4": INT4_KV_HOLDS or INT4_KV_MEASURED}.get(kv, {})
        if kv == "model":
            return f"; {note} as --kv-dtype model asks"
        said = f"measured {figures[family]}" if family in figures else f"not measured on {family} models"
        return f"; {note} as --kv-dtype {kv} asks ({said})"
    if kv == "int8" and family in INT8_KV_HOLDS:
        return f"; the int8 KV cache measured {INT8_KV_HOLDS[family]}"
    if kv == "int4":
        return f"; the int4 KV cache measured {INT4_KV_HOLDS[family]}" if family in INT4_KV_HOLDS else ""
    if kv != "model" or family in INT8_KV_HOLDS:
        return ""
    return (f"; a float KV cache: the int8 one is not measured to hold 0.5% on {family} models "
            "(benchmarks/quality.py --dtypes fp32,fp32/int8 --text FILE --window 2048)")


def _q4_kv(figures: dict[str, float], kv_dtype: str, family: str) -> tuple[str, str]:
    """The KV cache beside q4 weights (int8 where the family holds it and this file's figures do not say
    otherwise, or what was asked for) and what was measured, for the precision line."""
    both, alone, four = figures.get("q4/int8"), figures.get("q4"), figures.get("q4/int4")
    asked = kv_dtype != "auto"
    if asked:
        kv = kv_dtype
    elif four is not None and four <= LIMIT or four is None and family in INT4_KV_HOLDS:
        kv = "int4"
    elif family not in INT8_KV_HOLDS:
        kv = "model"
    else:
        kv = "model" if both is not None and both > LIMIT and alone is not None and alone <= LIMIT else "int8"
    figure = both if kv == "int8" else four if kv == "int4" else alone
    if figure is None:
        pair = "q4" if kv == "model" else f"q4/{kv}"
        return kv, (f"{pair} perplexity not measured for this file (benchmarks/quality.py --model FILE "
                    f"--record; the default model's q4/int8: +0.11%){_kv_note(family, kv, asked)}")
    within = "within" if figure <= LIMIT else "over"
    note = f"; the int8 KV cache measured {both:+.2%}" if kv == "model" and both is not None else ""
    return kv, f"{figure:+.2%} perplexity against fp32 as measured on this file ({within} 0.5%){note}" + \
        _kv_note(family, kv, asked)
