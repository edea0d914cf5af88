"""Build the kernel library's C++ tests (tests/cpp/*.cpp) for every ISA level of an architecture and
run them: natively, or for AArch64 cross-compiled with Debian's g++-aarch64-linux-gnu and run under
qemu-user, each level on an emulated CPU that has just its features (so an instruction the level may
not use fails). Prints each level's result and a last 'N passed, N failed' line; exit 1 on a failure.

    python tests/cpp/run.py --arch aarch64     # make test-arm
    python tests/cpp/run.py --arch native      # this machine's levels
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from phasewise.kernels.build import COMMON_FLAGS, CSRC, KERNEL_SOURCES, source_flags
from phasewise.kernels.isa import levels_for, machine_arch, runnable_levels

HERE = Path(__file__).parent
# qemu CPU models per AArch64 level: the oldest that has the level's features
QEMU_CPU = {"generic": "cortex-a53", "neon": "cortex-a53", "neon-dotprod": "cortex-a76"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="native", choices=["native", "aarch64"])
    args = ap.parse_args()
    if args.arch == "native":
        cxx, levels, runner, static = "c++", runnable_levels(), lambda lv: [], []
    else:
        cxx, levels, static = "aarch64-linux-gnu-g++", levels_for("aarch64"), ["-static"]
        runner = lambda lv: ["qemu-aarch64", "-cpu", QEMU_CPU[lv.name]]  # noqa: E731
        for tool in (cxx, "qemu-aarch64"):
            if shutil.which(tool) is None:
                print(f"error: {tool} is missing (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)")
                return 2
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for level in levels:
            exe = Path(tmp) / f"kernel_tests_{level.name}"
            flags = [f for f in COMMON_FLAGS if f != "-fPIC"] + list(level.flags) + static
            sources = [p for p in sorted(HERE.glob("*.cpp"))] + [CSRC / s for s in KERNEL_SOURCES]
            objects = [Path(tmp) / f"{level.name}-{p.stem}.o" for p in sources]
            for src, obj in zip(sources, objects):      # each with its own flags, as build.py compiles them
                build = subprocess.run([cxx, *flags, *source_flags(src.name), f"-I{CSRC}", "-c", str(src), "-o",
                                        str(obj)], capture_output=True, text=True)
                if build.returncode != 0:
                    break
            else:
                build = subprocess.run([cxx, *flags, *map(str, objects), "-o", str(exe)], capture_output=True,
                                       text=True)
            if build.returncode != 0:
                print(f"{level.name}: the build failed\n{build.stderr[-3000:]}")
                failed += 1
                continue
            run = subprocess.run([*runner(level), str(exe)], capture_output=True, text=True, timeout=600)
            print(run.stdout.strip())
            counts = re.search(r"^(\d+) passed, (\d+) failed$", run.stdout, re.M)
            if run.returncode != 0 and counts is None:
                print(f"{level.name}: exit {run.returncode} {run.stderr.strip()[-500:]}")
                failed += 1
                continue
            passed += int(counts.group(1))
            failed += int(counts.group(2))
    where = machine_arch() if args.arch == "native" else "aarch64 under qemu-user"
    print(f"kernel tests at {', '.join(lv.name for lv in levels)} ({where})")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
