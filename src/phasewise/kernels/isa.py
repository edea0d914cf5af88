"""Which instruction-set levels this CPU can run, and which one phasewise uses.

The kernels are built once per level (kernels/build.py), each with the compiler flags of its
level rather than `-march=native`, so a build runs on every CPU of that level:

- x86-64: `generic` (SSE2), `avx2` (x86-64-v3: AVX2, FMA, F16C; AVX-VNNI's dot products where the
  CPU has them), `avx512` (x86-64-v4 with VNNI: Ice Lake, Sapphire Rapids, Zen 4 on);
- AArch64: `generic`, `neon` (ARMv8.0), `neon-dotprod` (ARMv8.2 +dotprod: Apple M1 on, Graviton 2 on).

`PHASEWISE_ISA=<level>` picks a level below the machine's best (to test or measure it); the
default is the best. The choice is made once, when an engine is built.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path


class ISAError(ValueError):
    """PHASEWISE_ISA names a level this machine cannot run, or no level at all."""


@dataclass(frozen=True)
class Level:
    name: str
    arch: str                   # x86_64 | aarch64
    flags: tuple[str, ...]      # the compiler's target flags
    needs: frozenset[str]       # CPU features (as /proc/cpuinfo names them)


_X86_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
LEVELS = (
    Level("generic", "x86_64", ("-march=x86-64", "-mtune=generic"), frozenset()),
    Level("avx2", "x86_64", ("-march=x86-64-v3", "-mtune=generic"), _X86_V3),
    Level("avx512", "x86_64",
          ("-march=x86-64-v4", "-mavx512vnni", "-mprefer-vector-width=512", "-mtune=generic"),
          _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}),
    Level("generic", "aarch64", ("-march=armv8-a", "-DPW_GENERIC"), frozenset()),
    Level("neon", "aarch64", ("-march=armv8-a",), frozenset({"asimd"})),
    Level("neon-dotprod", "aarch64", ("-march=armv8.2-a+dotprod",), frozenset({"asimd", "asimddp"})),
)


def machine_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def levels_for(arch: str) -> list[Level]:
    """Every level of `arch`, lowest first (a CPU of another architecture gets none)."""
    return [lv for lv in LEVELS if lv.arch == arch]


@cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags: /proc/cpuinfo on Linux, sysctl on macOS (Apple silicon)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    feats: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            feats.update(value.split())
    if not text and platform.system() == "Darwin" and machine_arch() == "aarch64":
        feats.add("asimd")
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_DotProd"],
                                 capture_output=True, text=True)
            if out.stdout.strip() == "1":
                feats.add("asimddp")
        except OSError:
            pass
    return frozenset(feats)


def with_avx_vnni(level: Level, features: frozenset[str]) -> Level:
    """The avx2 level with AVX-VNNI's dot products where the CPU has them (Alder Lake, Zen 5)."""
    if level.name == "avx2" and "avx_vnni" in features:
        return Level("avx2", level.arch, level.flags + ("-mavxvnni",), level.needs | {"avx_vnni"})
    return level


def runnable_levels(features: frozenset[str] | None = None, arch: str | None = None) -> list[Level]:
    """The levels this CPU can run, lowest first (at least `generic` on x86-64 and AArch64)."""
    features = cpu_features() if features is None else features
    return [with_avx_vnni(lv, features) for lv in levels_for(arch or machine_arch()) if lv.needs <= features]


def chosen_level(features: frozenset[str] | None = None, arch: str | None = None,
                 requested: str | None = None) -> Level | None:
    """PHASEWISE_ISA's level (or `requested`), else the best this CPU runs; None on other architectures."""
    runnable = runnable_levels(features, arch)
    requested = requested if requested is not None else os.environ.get("PHASEWISE_ISA", "")
    if not requested:
        return runnable[-1] if runnable else None
    names = [lv.name for lv in levels_for(arch or machine_arch())]
    if requested not in names:
        raise ISAError(f"PHASEWISE_ISA={requested} is not a level of {arch or machine_arch()} "
                       f"(levels: {', '.join(names) or 'none'})")
    for lv in runnable:
        if lv.name == requested:
            return lv
    raise ISAError(f"PHASEWISE_ISA={requested}: this CPU cannot run it (it runs "
                   f"{', '.join(lv.name for lv in runnable) or 'no level'})")
