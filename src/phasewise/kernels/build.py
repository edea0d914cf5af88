"""Build and load phasewise's C++ CPU kernels: one library per ISA level, one torch binding.

- The kernels (csrc/*.cpp but the binding files) are plain C++ over raw pointers. Each ISA level
  (kernels/isa.py) compiles them with its own target flags into
  `<cache>/kernels/<level>-<hash>/libphasewise_kernels.so` (about 10 s a level on 2 cores).
- The binding (bindings.cpp, kernel_set.cpp, decoder_stack.cpp) is a torch extension built once
  for every level by `torch.utils.cpp_extension` (about a minute): its `KernelSet` opens a
  level's library and calls through its table of functions.

Hashes cover the sources, headers, flags and compiler, so a changed file rebuilds and a cache
copied to another machine is reused only where the same flags run. `load` returns None (after
one warning) when nothing can be built; callers then keep their PyTorch reference paths.
`python -m phasewise.kernels.build` builds every level this CPU runs, with timings.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

from phasewise.config import default_cache_dir
from phasewise.kernels.isa import Level, chosen_level, runnable_levels
from phasewise.kernels.kernel_api import Kernels

CSRC = Path(__file__).parent / "csrc"
BINDING_SOURCES = ("bindings.cpp", "kernel_set.cpp", "decoder_stack.cpp", "cache_views.cpp")
KERNEL_SOURCES = ("cpu_ops.cpp", "kv_write.cpp", "paged_attention.cpp", "tile_attention.cpp",
                  "quant_linear.cpp", "activation_quant.cpp", "dequantize_rows.cpp", "repack_gguf.cpp",
                  "int8_peak.cpp", "decoder.cpp", "expert_mlp.cpp", "gated_delta.cpp", "short_conv.cpp",
                  "thread_pool.cpp", "table.cpp")
COMMON_FLAGS = ("-std=c++17", "-O3", "-fPIC", "-ffast-math", "-fno-finite-math-only", "-fvisibility=hidden")
# Attention gives a row the same bits whichever of its kernels reads it (csrc/attention.h): its files
# keep every sum in the order written (no reassociation, no contraction beyond the explicit fmas).
# The linear layers' epilogues keep their order too, for a row's bits whatever rows share its
# register tile (the generic level's fma is a * b + c, which -ffast-math regrouped per tile height);
# contraction stays on there (off, AVX-512's in-place q6k GEMV ran 1.15x slower).
_IN_ORDER = ("-fno-associative-math", "-ffp-contract=off")
# dequantize_rows gives the reference's bits (d q, then + m): no contraction there either
# (clang fused them);
# kv_write quantizes an int8 cache's keys and values as layers/kv_int8.py does, value for value.
# gated_delta keeps a row's bits whatever chunk or batch it runs in: no code path the compiler regroups.
SOURCE_FLAGS = {"paged_attention.cpp": _IN_ORDER, "tile_attention.cpp": _IN_ORDER,
                "dequantize_rows.cpp": _IN_ORDER, "kv_write.cpp": _IN_ORDER, "gated_delta.cpp": _IN_ORDER,
                "short_conv.cpp": _IN_ORDER, "quant_linear.cpp": ("-fno-associative-math",)}


def source_flags(src: str) -> tuple[str, ...]:
    """The flags one kernel source adds to the common ones."""
    return SOURCE_FLAGS.get(src, ())


class KernelBuildError(RuntimeError):
    """The compiler failed or is missing."""


def disabled() -> bool:
    """PHASEWISE_NO_KERNELS=1 turns every C++ kernel off (the reference paths run)."""
    return os.environ.get("PHASEWISE_NO_KERNELS", "") not in ("", "0")


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


@dataclasses.dataclass(frozen=True)
class Threads:
    """How the kernels run their threads: OpenMP (`compile` and `link` its flags) or, without it, their
    own pool (csrc/thread_pool.h: the same splits, so the same results)."""
    openmp: bool
    compile: tuple[str, ...]
    link: tuple[str, ...]


OWN_THREADS = Threads(False, ("-fopenmp-simd", "-pthread"), ("-pthread",))


def threads_setup() -> Threads:
    """OpenMP as the platform has it: GCC's and Linux clang's -fopenmp; on macOS Apple clang's
    `-Xpreprocessor -fopenmp` against torch's bundled libomp, where its omp.h is found too. Otherwise,
    or with PHASEWISE_OPENMP=0, the kernels' own threads (-fopenmp-simd keeps the simd pragmas)."""
    own = OWN_THREADS
    if os.environ.get("PHASEWISE_OPENMP", "") in ("0", "off", "no"):
        return own
    if sys.platform != "darwin":
        return Threads(True, ("-fopenmp",), ("-fopenmp",))
    spec = importlib.util.find_spec("torch")
    locations = spec.submodule_search_locations if spec else None
    lib = Path(locations[0]) / "lib" if locations else None
    headers = [Path(p) for p in ("/opt/homebrew/opt/libomp/include", "/usr/local/opt/libomp/include")]
    candidates = ([lib.parent / "include"] if lib else []) + headers
    include = next((h for h in candidates if (h / "omp.h").exists()), None)
    if lib is None or not (lib / "libomp.dylib").exists() or include is None:
        return own
    return Threads(True, ("-Xpreprocessor", "-fopenmp", f"-I{include}"),
                   (f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}"))


def _headers(kernels: bool) -> list[Path]:
    """The headers a build reads: the bindings only csrc/*.h, the kernels the vector layer too."""
    extra = sorted(CSRC.glob("vec/*.h")) + sorted(CSRC.glob("arch/*.h")) if kernels else []
    return sorted(CSRC.glob("*.h")) + extra


@functools.cache
def _compiler_version(cxx: str) -> bytes:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, check=False).stdout
    except OSError:
        return b""


def _digest(sources: tuple[str, ...], flags: tuple[str, ...], cxx: str) -> str:
    data = b"".join(p.read_bytes() for p in [CSRC / s for s in sources] + _headers(sources == KERNEL_SOURCES))
    return hashlib.sha256(data + " ".join(flags).encode() + _compiler_version(cxx)).hexdigest()[:12]


def _say(message: str) -> None:
    print(f"phasewise: {message}", file=sys.stderr, flush=True)


def library_path(level: Level, cxx: str | None = None) -> Path:
    cxx = cxx or compiler()
    flags = COMMON_FLAGS + threads_setup().compile + level.flags + \
        tuple(f"{s}:{f}" for s in KERNEL_SOURCES for f in source_flags(s))
    return default_cache_dir() / "kernels" / f"{level.name}-{_digest(KERNEL_SOURCES, flags, cxx)}" / \
        "libphasewise_kernels.so"


def build_library(level: Level, out: Path | None = None, cxx: str | None = None, jobs: int = 2) -> Path:
    """Compile the kernels for `level` (once: an existing build is reused) and return the library."""
    cxx = cxx or compiler()
    out = out or library_path(level, cxx)
    if out.exists():
        return out
    threads = threads_setup()
    flags = list(COMMON_FLAGS + threads.compile + level.flags)
    started = time.perf_counter()
    _say(f"building the {level.name} kernels (once per machine, about 10 s) ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        def compile_one(src: str) -> Path:
            obj = Path(tmp) / (src + ".o")
            _run([cxx, *flags, *source_flags(src), "-c", str(CSRC / src), "-o", str(obj)])
            return obj
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_one, KERNEL_SOURCES))
        staged = Path(tmp) / out.name
        # Linked without -ffast-math: GCC 12 would add crtfastmath.o, whose constructor turns on
        # flush-to-zero for the whole process (torch included) when the library is loaded.
        _run([cxx, "-shared", *threads.link, *map(str, objects), "-o", str(staged)])
        os.replace(staged, out)           # atomic: a concurrent build finds it whole or not at all
    _say(f"built the {level.name} kernels in {time.perf_counter() - started:.1f} s")
    return out


def _run(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise KernelBuildError(f"cannot run the compiler {cmd[0]!r}: {e.strerror or e}") from None
    if done.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd[:1] + cmd[-3:])} failed:\n{done.stderr.strip()[-4000:]}")


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip-installed one sits beside this Python
    (venv not activated)."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and scripts and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def bindings() -> ModuleType:
    """The torch extension that opens kernel libraries (KernelSet) and runs the decoder stack."""
    import torch
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    flags = ("-O2", "-std=c++17")
    digest = _digest(BINDING_SOURCES, flags, compiler())
    # One build directory per checkout too: torch's ninja file names the sources by absolute path, so
    # two checkouts sharing one directory would rebuild it each time the other had run.
    where = hashlib.sha256(str(CSRC.resolve()).encode()).hexdigest()[:6]
    version = torch.__version__.replace('+', '_')
    build = default_cache_dir() / "kernels" / f"bindings-{version}-{digest}-{where}"
    fresh = not any(build.glob("*.so"))
    if fresh:
        _say("building the torch bindings of the kernels (once per torch version, about a minute) ...")
    started = time.perf_counter()
    build.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build / "lock")
    module = cpp_extension.load(f"phasewise_kernels_{digest}", [str(CSRC / s) for s in BINDING_SOURCES],
                                extra_cflags=list(flags), extra_ldflags=["-ldl"], build_directory=str(build),
                                verbose=False)
    if fresh:
        _say(f"built the torch bindings in {time.perf_counter() - started:.1f} s")
    return module


STALE_LOCK_S = 600     # a build takes about a minute; a lock this old was left by one that was killed


def _clear_stale_lock(lock: Path) -> None:
    """torch's extension builder waits for its lock file without end: a build killed half-way (Ctrl-C
    on the first run, a CI job stopped) would leave every later process waiting forever."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        _say(f"removing a build lock left {age / 60:.0f} minutes ago by a build that did not finish: {lock}")
        lock.unlink(missing_ok=True)


def load(level_name: str | None = None) -> Kernels | None:
    """The KernelSet of `level_name` (default: PHASEWISE_ISA, else the CPU's best level), or None
    where it cannot be had (kernels disabled, another architecture, no compiler). An unknown or
    unsupported PHASEWISE_ISA raises ISAError."""
    if disabled():
        return None
    level = chosen_level(requested=level_name)
    if level is None:
        warnings.warn("phasewise: no C++ kernels for this CPU architecture; using PyTorch", stacklevel=2)
        return None
    return _load_level(level)


@functools.cache
def _load_level(level: Level) -> Kernels | None:
    """One KernelSet per level and process (None after one warning when it cannot be built)."""
    try:
        return bindings().KernelSet(str(build_library(level)))
    except Exception as e:  # no compiler, no ninja, a read-only cache ...: run the reference path
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"phasewise: could not build the {level.name} kernels ({first}); using PyTorch",
                      stacklevel=2)
        return None


def main() -> int:
    """Build the bindings and every level this CPU runs; print each build's time."""
    started = time.perf_counter()
    try:
        bindings()
        levels = runnable_levels()
        for level in levels:
            build_library(level)
        chosen = chosen_level()
    except Exception as e:
        print(f"phasewise: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    names = ", ".join(lv.name for lv in levels)
    _say(f"kernels ready for {names} in {time.perf_counter() - started:.1f} s; "
         f"this machine runs {chosen.name if chosen else 'no level'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
