"""What observers see of one engine step (the server's metrics and dashboard, traces): the core's record
of it and what the runner measured in it, each reported by its own part and composed here."""

from __future__ import annotations

from dataclasses import dataclass

from phasewise.core.handoffs import StepRecord
from phasewise.runner.step_extras import StepExtras, ThreadStats

__all__ = ["StepEvent", "StepExtras", "ThreadStats"]

MAX_STEP_EVENTS = 100_000    # a long-running server keeps only the latest steps


@dataclass(frozen=True)
class StepEvent:
    record: StepRecord       # the core's: what ran, how long it took
    extras: StepExtras       # the runner's: grammar time, threads, a mixture of experts' choices
