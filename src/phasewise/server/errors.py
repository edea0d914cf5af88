"""The errors a request can meet in the engine, apart from its own bad input found by the app."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class RequestError(ValueError):
    """Bad input found on the engine thread; `param` names the request field at fault ("prompt" is
    the prompt or the messages)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """The prompt (plus max_tokens) does not fit the context."""


class EngineDeadError(EngineError):
    """The engine thread has stopped; no request can be served."""


class SlowClientError(EngineError):
    """The client stopped reading its stream: so many chunks waited for it that the request was
    aborted (its blocks freed) rather than buffered without end."""
