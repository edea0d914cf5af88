"""What the runner measured in a step beyond what the scheduler needs: the observers' part of a step
(server metrics, the dashboard, traces), reported beside the core's StepRecord, never on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepExtras:
    grammar_ms: float = 0.0            # computing the grammar masks of the step's constrained rows
    threads: int = 0                   # threads that ran its kernels (runner/thread_governor.py)
    # a mixture of experts: per sparse layer, the (row, choice) pairs each expert took this step; only
    # the newest step keeps it (layers x experts numbers a step: LLMEngine drops the last one's)
    expert_choices: list[list[int]] | None = None


@dataclass(frozen=True, kw_only=True)
class ThreadStats:
    """The kernel threads now (runner/thread_governor.py)."""
    threads: int = 0                   # kernel threads in use
    cpus_busy_elsewhere: float = 0.0   # CPUs other programs kept busy lately
    cpu_wait_seconds: float = 0.0      # how long the engine's threads waited for a CPU, ever
