"""Hooks the engine thread calls as requests progress (the metrics, a trace recorder, the dashboard)."""

from __future__ import annotations

from typing import Protocol

from phasewise.core.request import Request
from phasewise.engine.step_event import StepEvent
from phasewise.outputs import StreamDelta
from phasewise.server.server_stats import ServerStats


class Observer(Protocol):
    """Hooks called on the engine thread. A class that names Observer as its base does nothing in the
    hooks it leaves out (metrics, the dashboard); one with all four hooks is one too (lab.trace's
    recorder)."""

    def on_add(self, request: Request) -> None: ...

    def on_step(self, step: StepEvent, stats: ServerStats) -> None: ...

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

    def on_step(self, step: StepEvent, stats: ServerStats) -> None:
        for o in self.observers:
            o.on_step(step, stats)

    def on_delta(self, delta: StreamDelta) -> None:
        for o in self.observers:
            o.on_delta(delta)

    def on_finish(self, request: Request, reason: str) -> None:
        for o in self.observers:
            o.on_finish(request, reason)
