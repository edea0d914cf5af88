"""The errors a request can meet in the engine, apart from its own bad input (phasewise.engine.admission)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class EngineDeadError(EngineError):
    """The engine thread has stopped; no request can be served."""


class SlowClientError(EngineError):
    """The client stopped reading its stream: so many chunks waited for it that the request was
    aborted (its blocks freed) rather than buffered without end."""
