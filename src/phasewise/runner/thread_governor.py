"""ThreadGovernor: how many threads run the kernels, chosen from the CPUs other programs leave free.

A step's kernels meet at a few hundred barriers; a thread the OS has descheduled holds every one of
them until it runs again, so where another program keeps a core busy, two threads on two cores
decode slower than one on the free core (docs/benchmarks.md, "On a busy machine"). Every `WINDOW_S`
of steps the governor reads how long the CPUs this process may use were busy (/proc/stat), minus
this process's own CPU time: the CPUs other programs took. With free = cpus − others, it drops to
the free CPUs at once when free falls half a CPU below the threads, and adds threads back once free
has stayed 0.7 above them for two windows. The count is set with `torch.set_num_threads` on the
engine thread: the same OpenMP pool, fewer of its threads per region (a second pool would stop
libgomp spinning; see AsyncEngine). Outputs do not depend on the count: every reduction's order is
fixed by the data, not by the threads (tests/test_thread_governor.py).

It also sums how long this process's threads waited for a CPU while runnable (the run-queue delay
of /proc/self/task/*/schedstat): the time other programs cost it. Linux only; elsewhere, with a
pinned count (`--threads N`) or with tensor parallelism, the count stays as it is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from phasewise.runner.step_extras import ThreadStats

WINDOW_S = 0.2          # seconds of steps between two looks at the CPUs
DROP = 0.5              # fewer threads when free CPUs fall this far below them
RISE = 0.7              # more threads when this much of one more CPU has stayed free
RISE_WINDOWS = 2        # ... for this many windows in a row


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative seconds at one moment."""
    wall: float          # monotonic clock
    busy: float          # the CPUs this process may use, busy with anything (steal included)
    own: float           # this process's CPU time, every thread
    waited: float        # this process's threads' run-queue delay (runnable, no CPU)


def usable_cpus() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class CpuReader:
    """Reads `CpuTimes` from /proc for the CPUs `cpus` (None where /proc is missing)."""

    def __init__(self, cpus: list[int]) -> None:
        self.cpus = cpus
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._waited: dict[str, int] = {}      # per live task: its last run-queue delay (ns)
        self._waited_total = 0

    def __call__(self) -> CpuTimes | None:
        try:
            busy = self._busy_ticks() / self.tick
        except (OSError, ValueError):
            return None
        return CpuTimes(time.monotonic(), busy, time.process_time(), self._waited_ns() / 1e9)

    def _busy_ticks(self) -> int:
        """user nice system idle iowait irq softirq steal ...: all but idle and iowait, of our CPUs."""
        wanted, ticks = {f"cpu{c}" for c in self.cpus}, 0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name in wanted:
                    v = [int(x) for x in fields[:8]]
                    ticks += sum(v) - v[3] - v[4]
        return ticks

    def _waited_ns(self) -> int:
        """The run-queue delay of this process's threads since the reader started (threads that ended
        keep what they added)."""
        seen = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    seen[tid] = int(f.read().split()[1])
            except (OSError, ValueError, IndexError):
                continue
            self._waited_total += max(0, seen[tid] - self._waited.get(tid, seen[tid]))
        self._waited = seen
        return self._waited_total


class ThreadGovernor:
    """The engine's kernel thread count: `max_threads` on a free machine, fewer while other programs
    take some of the `cpus` (`adapt`), or `max_threads` always (pinned). `adjust()` before each step;
    `read`, `set_threads` and `clock` default to /proc, torch and time.monotonic."""

    def __init__(self, max_threads: int, adapt: bool, cpus: list[int] | None = None,
                 read: Callable[[], CpuTimes | None] | None = None,
                 set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = self.threads = max(1, max_threads)
        self.clock = clock                     # the clock `read` stamps its times with
        self.cpus = len(cpus := cpus if cpus is not None else usable_cpus())
        self.read = read or CpuReader(cpus)
        self.set_threads = set_threads or _torch_set_threads
        self.last = self.read()
        self.adapt = adapt and self.last is not None
        self.others = 0.0                      # CPUs other programs kept busy in the latest window
        self.changes = 0                       # times the count changed
        self._rising = 0                       # windows in a row with room for one more thread

    def pin(self, threads: int | None) -> None:
        """Pin the count at `threads` (at most the maximum), or adapt again from the maximum (None)."""
        self.adapt = threads is None and self.last is not None
        self._rising = 0
        self._set(self.max_threads if threads is None else max(1, min(threads, self.max_threads)))

    def stats(self) -> ThreadStats:
        """The threads now, what other programs took of the CPUs lately, and the engine's CPU waits."""
        return ThreadStats(threads=self.threads, cpus_busy_elsewhere=self.others,
                           cpu_wait_seconds=self.cpu_wait_s)

    @property
    def cpu_wait_s(self) -> float:
        """How long this process's threads waited for a CPU, since the engine started."""
        return self.last.waited if self.last else 0.0

    def adjust(self) -> int:
        """Once a window has passed, look at the CPUs (pinned too: the metrics) and, when adapting, set
        the thread count; returns it."""
        if self.last is None or self.clock() - self.last.wall < WINDOW_S:   # a clock read: ~50 ns a step
            return self.threads
        now = self.read()                                                    # /proc: ~0.1 ms a window
        if now is None:
            return self.threads
        wall = now.wall - self.last.wall
        self.others = max(0.0, (now.busy - self.last.busy) - (now.own - self.last.own)) / wall
        self.last = now
        if self.adapt:
            self._choose(self.cpus - self.others)
        return self.threads

    def _choose(self, free: float) -> None:
        """Down at once when `free` CPUs fall DROP below the threads; up after RISE_WINDOWS with RISE more
        free."""
        if free < self.threads - DROP:
            self._rising = 0
            self._set(max(1, round(free)))
        elif self.threads < self.max_threads and free >= self.threads + RISE:
            self._rising += 1
            if self._rising >= RISE_WINDOWS:             # as many more as have RISE of a CPU free each
                self._rising = 0
                self._set(min(self.max_threads, int(free + 1 - RISE)))
        else:
            self._rising = 0

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            self.threads = threads
            self.changes += 1
            self.set_threads(threads)


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
