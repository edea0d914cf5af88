"""Build the kernel library's C++ tests (tests/cpp/*.cpp) for every ISA level of an architecture and
run them: natively, or for AArch64 cross-compiled with Debian's g++-aarch64-linux-gnu and run under
qemu-user, each level on an emulated CPU that has just its features (so an instruction the level may
not use fails). Prints each level's result and a last 'N passed, N failed' line; exit 1 on a failure.

    python tests/cpp/run.py --arch aarch64     # make test-arm
    python tests/cpp/run.py --arch native      # this machine's levels
    python tests/cpp/run.py --only kv          # one part of the tests (kernel_tests.cpp's main)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from phasewise.kernels.build import COMMON_FLAGS, CSRC, KERNEL_SOURCES, OWN_THREADS, Threads, compiler, source_flags, threads_setup
from phasewise.kernels.isa import levels_for, machine_arch, runnable_levels

HERE = Path(__file__).parent
# qemu CPU models per AArch64 level: the oldest that has the level's features
QEMU_CPU = {"generic": "cortex-a53", "neon": "cortex-a53", "neon-dotprod": "cortex-a76"}


def build_and_run(cxx: str, level, threads: Threads, static: list[str], runner: list[str], tmp: Path,
                  only: str = "") -> tuple[str, str]:
    """The tests of one level built with cxx and `threads` (OpenMP or the kernels' own pool) and run (only
    their part `only`, or all): (their output, or "" when the build failed, and why)."""
    tag = f"{level.name}-{'omp' if threads.openmp else 'pool'}"
    exe = tmp / f"kernel_tests_{tag}"
    flags = [f for f in COMMON_FLAGS if f != "-fPIC"] + list(threads.compile) + list(level.flags) + static
    sources = sorted(HERE.glob("*.cpp")) + [CSRC / s for s in KERNEL_SOURCES]
    objects = [tmp / f"{tag}-{p.stem}.o" for p in sources]
    for src, obj in zip(sources, objects):      # each with its own flags, as build.py compiles them
        build = subprocess.run([cxx, *flags, *source_flags(src.name), f"-I{CSRC}", "-c", str(src), "-o", str(obj)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            return "", build.stderr[-3000:]
    build = subprocess.run([cxx, *flags, *threads.link, *map(str, objects), "-o", str(exe)], capture_output=True,
                           text=True)
    if build.returncode != 0:
        return "", build.stderr[-3000:]
    run = subprocess.run([*runner, str(exe), *([only] if only else [])], capture_output=True, text=True, timeout=600)
    return run.stdout.strip() or f"exit {run.returncode} {run.stderr.strip()[-500:]}", ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="native", choices=["native", "aarch64"])
    ap.add_argument("--openmp-parity", action="store_true",
                    help="also build without OpenMP (the kernels' own threads) and require the same result bits")
    ap.add_argument("--only", default="", choices=["", "ops", "kv", "quant", "stack", "experts", "delta"],
                    help="run one part of the tests: kv, the int8 and int4 caches' writers, readers and decoder stacks")
    args = ap.parse_args()
    if args.arch == "native":
        cxx, levels, runner, static = compiler(), runnable_levels(), lambda lv: [], []
    else:
        cxx, levels, static = "aarch64-linux-gnu-g++", levels_for("aarch64"), ["-static"]
        runner = lambda lv: ["qemu-aarch64", "-cpu", QEMU_CPU[lv.name]]  # noqa: E731
    for tool in (cxx, *(["qemu-aarch64"] if args.arch == "aarch64" else [])):
        if shutil.which(tool) is None:
            print(f"error: {tool} is missing (Debian: apt-get install g++-aarch64-linux-gnu qemu-user or clang)")
            return 2
    threads = threads_setup()
    builds = [threads] + ([OWN_THREADS] if args.openmp_parity and threads.openmp else [])
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for level in levels:
            digests = []
            for t in builds:
                out, error = build_and_run(cxx, level, t, static, runner(level), Path(tmp), args.only)
                name = f"{level.name} ({cxx}, {'OpenMP' if t.openmp else 'own threads'})"
                if error:
                    print(f"{name}: the build failed\n{error}")
                    failed += 1
                    continue
                print(f"{name}\n{out}")
                counts = re.search(r"^(\d+) passed, (\d+) failed$", out, re.M)
                if counts is None:
                    failed += 1
                    continue
                passed += int(counts.group(1))
                failed += int(counts.group(2))
                digests.append(re.search(r"^results digest (\w+)$", out, re.M).group(1))
            if len(builds) == 2 and len(digests) == 2:
                same = digests[0] == digests[1]
                print(f"{level.name}: the build without OpenMP gives {'the same' if same else 'OTHER'} result bits")
                passed, failed = passed + same, failed + (not same)
    where = machine_arch() if args.arch == "native" else "aarch64 under qemu-user"
    print(f"kernel tests at {', '.join(lv.name for lv in levels)} ({where})")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
