"""Hooks the engine thread calls as requests progress (the metrics, a trace recorder, the dashboard)."""

from __future__ import annotations

from typing import Protocol

from phasewise.core.handoffs import EngineStats, StepRecord
from phasewise.core.request import Request
from phasewise.outputs import StreamDelta


class Observer(Protocol):
    """Hooks called on the engine thread. A class that names Observer as its base does nothing in the
    hooks it leaves out (metrics, the dashboard); one with all four hooks is one too (lab.trace's
    recorder)."""

    def on_add(self, request: Request) -> None: ...

    def on_step(self, record: StepRecord, stats: EngineStats) -> None: ...

    def on_delta(self, delta: StreamDelta) -> None: ...

    def on_finish(self, request: Request, reason: str) -> None: ...


class Observers(Observer):
    """Several observers called in turn (metrics and a trace recorder); none: an observer that does
    nothing."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = observers

    def on_add(self, request: Request) -> None:
        for o in self.observers:
            o.on_add(request)

    def on_step(self, record: StepRecord, stats: EngineStats) -> None:
        for o in self.observers:
            o.on_step(record, stats)

    def on_delta(self, delta: StreamDelta) -> None:
        for o in self.observers:
            o.on_delta(delta)

    def on_finish(self, request: Request, reason: str) -> None:
        for o in self.observers:
            o.on_finish(request, reason)
