"""What the event loop hands AsyncEngine's thread (add, abort, call: server/async_engine.py), and how
an answer goes back to the loop that asked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from phasewise.core.request import Request
from phasewise.core.sampling_params import SamplingParams
from phasewise.engine.client import ChatPrompt, EngineClient, Prompt
from phasewise.outputs import StreamDelta


@dataclass
class SubRequest:
    """One engine request of an API call (an API call with n > 1 or several prompts has several)."""
    request_id: str
    # a chat call's: its ChatPrompt (messages, tools, template variables)
    prompt: Prompt | ChatPrompt
    params: SamplingParams


@dataclass
class Add:
    items: list[SubRequest]
    chat: bool
    future: asyncio.Future[None]


@dataclass
class Live:
    request: Request
    loop: asyncio.AbstractEventLoop            # where its stream lives


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class Call:
    fn: Callable[[EngineClient], None]         # runs the caller's function; `call` keeps its result
    future: asyncio.Future[None]


Command: TypeAlias = Add | Abort | Call
Routed: TypeAlias = tuple[str, StreamDelta | Exception]   # (request id, a delta or the error that ends it)


def post(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """Run fn() on the loop soon; nothing if the loop has closed (shutdown)."""
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass


def resolve(future: asyncio.Future[None], error: BaseException | None = None) -> None:
    """Settle `future` on its loop (with `error`, or None), unless its awaiting coroutine was cancelled."""
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)
    post(future.get_loop(), settle)
