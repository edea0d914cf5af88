"""Build and load phasewise's C++ CPU kernels (torch extensions), once per machine, lazily.

Sources live in `kernels/csrc/`. They are compiled with the machine's compiler by
`torch.utils.cpp_extension.load` on first use (about a minute) into
`<phasewise cache>/kernels/<name>-<torch version>-<hash>/` and reused after (the hash covers the
sources, the flags and the CPU, since `-march=native` builds for this CPU only).
When the build fails or the CPU lacks AVX-512, `load` returns None after one
warning, and callers keep their pure-PyTorch reference path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).parent / "csrc"
# The one CPU extension: fused ops, paged attention, quantized linears, the decoder stack.
CPU_SOURCES = ("cpu_ops.cpp", "paged_attention.cpp", "tile_attention.cpp", "quant_linear.cpp", "decoder_stack.cpp",
               "bindings.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]


def cpu_supports_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f " in flags and " avx512bw " in flags


def cpu_identity() -> bytes:
    """The CPU's model name and feature flags: `-march=native` builds for this CPU only, so a cache
    shared with another machine (a copied home directory, an image) must not hand its build over."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return b""
    keep = [line for line in first.splitlines() if line.split(":")[0].strip() in ("vendor_id", "model name", "flags")]
    return "\n".join(keep).encode()


def disabled() -> bool:
    """PHASEWISE_NO_KERNELS=1 turns every C++ kernel off (the reference paths run)."""
    return os.environ.get("PHASEWISE_NO_KERNELS", "") not in ("", "0")


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip-installed one sits beside this Python (venv not activated)."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and scripts and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load(name: str, sources: tuple[str, ...]) -> ModuleType | None:
    """The compiled extension `name` built from csrc/`sources`, or None where it cannot be had."""
    if disabled():
        return None
    if not cpu_supports_avx512():
        warnings.warn(f"phasewise: this CPU has no AVX-512; the {name} kernels fall back to PyTorch", stacklevel=2)
        return None
    import torch
    from torch.utils import cpp_extension

    from phasewise.tokenizer import default_cache_dir

    _put_ninja_on_path()
    paths = [CSRC / s for s in sources]
    headers = sorted(CSRC.glob("*.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in paths + headers) + " ".join(FLAGS).encode()
                            + cpu_identity()).hexdigest()[:12]
    build = default_cache_dir() / "kernels" / f"{name}-{torch.__version__.replace('+', '_')}-{digest}"
    try:
        build.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(f"phasewise_{name}_{digest}", [str(p) for p in paths], extra_cflags=FLAGS,
                                  extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache ...: run the reference path
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"phasewise: could not build the {name} kernels ({first}); using PyTorch", stacklevel=2)
        return None
