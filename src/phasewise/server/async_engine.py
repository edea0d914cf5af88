"""AsyncEngine: an LLMEngine stepped by one background thread, fed and drained from asyncio.

LLMEngine is not thread-safe, so every call into it happens on the engine thread.
The event loop hands it commands (add, abort, call) through a locked inbox; the
thread takes them between steps, steps while any request is unfinished, and
sleeps on a condition when there is nothing to do. Each step's deltas go back to
the loop in one `call_soon_threadsafe`, which puts them on the asyncio.Queue of
the request's stream. A stream that is closed before its requests end (a client
that went away) aborts them, which frees their KV blocks on the next turn of the
thread. A step that raises fails the requests it held with an error and the
thread goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import ParamSpec, TypeVar

from phasewise.engine.client import ChatPrompt, EngineBrokenError, EngineClient, Prompt
from phasewise.outputs import StreamDelta
from phasewise.core.sampling_params import SamplingParams
from phasewise.server.errors import EngineDeadError, EngineError
from phasewise.server.request_stream import RequestStream
from phasewise.server.engine_commands import (Abort, Add, Call, Command, Live, Routed, SubRequest, post,
                                              resolve)
from phasewise.server.observer import Observer, Observers
from phasewise.server.server_stats import ServerStats

log = logging.getLogger("phasewise.server")

T = TypeVar("T")
P = ParamSpec("P")


class AsyncEngine:
    """`engine`: an EngineClient (an LLMEngine), or a function that builds one, which then runs on the engine
    thread. Build it there when you can: OpenMP keeps a thread pool per thread that ran parallel work, so
    a model loaded and warmed up on another thread leaves a second pool, and libgomp, seeing more
    threads than cores, stops spinning at barriers: a decode step of 32 rows took 41-43 ms instead
    of 30 here (docs/benchmarks.md). The constructor returns once the engine is built, or raises
    what building it raised."""

    def __init__(self, engine: EngineClient | Callable[[], EngineClient], observer: Observer | None = None,
                 max_pending: int = 1024) -> None:
        self.observer = observer or Observers()
        # unread chunks a stream may hold before its requests are aborted
        self.max_pending = max_pending
        built: list[BaseException] = []          # what building the engine raised, if it did
        ready = threading.Event()
        self._cond = threading.Condition()
        self._inbox: list[Command] = []
        # commands the thread took from the inbox and has not yet handled
        self._taken: list[Command] = []
        self._dead = False                     # the thread has stopped taking commands (under _cond)
        self._stopping = False
        self._submitted = 0                    # sub-requests sent to the thread, ever (loop side)
        self._received = 0                     # of them, taken in by the thread (thread side; published)
        self._streams: dict[str, RequestStream] = {}   # request id → its stream (loop side)
        # request id → engine Request and its caller's loop (thread side)
        self._live: dict[str, Live] = {}
        self._thread = threading.Thread(target=self._run, args=(engine, built, ready),
                                        name="phasewise-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if built:
            self._thread.join()
            raise built[0]
        engine = self.engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self._publish()
        self.num_blocks = self.stats.engine.num_blocks
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        self.token_budget = engine.config.scheduler.max_num_batched_tokens

    # ---- the event loop's side ----------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    @property
    def num_queued(self) -> int:
        """Sub-requests that will really wait: those not yet running (on their way to the engine, or
        in its scheduler's waiting queue) past the seats free for them (--max-num-seqs less the
        running ones), which the scheduler fills on its next step."""
        return self.queued_after(0)

    @property
    def is_idle(self) -> bool:
        """Nothing running, waiting or on its way to the engine."""
        s = self.stats
        return s.engine.num_running == 0 and s.engine.num_waiting == 0 and self._submitted == s.num_received

    def queued_after(self, n: int) -> int:
        """num_queued once n more sub-requests are sent. One published snapshot of the thread's counts
        (what it has received, what waits and runs), so nothing is counted twice or missed."""
        s, engine = self.stats, self.stats.engine
        not_running = engine.num_waiting + (self._submitted - s.num_received) + n
        return max(0, not_running - max(0, self.max_num_seqs - engine.num_running))

    @property
    def num_running(self) -> int:
        return self.stats.engine.num_running

    async def submit(self, items: list[SubRequest], chat: bool = False) -> RequestStream:
        """Add requests together (all or none). ValueError (context too long, ...) is raised here."""
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped")
        loop = asyncio.get_running_loop()
        rids = [it.request_id for it in items]
        stream = RequestStream(rids, self._close_stream, self.max_pending)
        for rid in rids:
            self._streams[rid] = stream
        future: asyncio.Future[None] = loop.create_future()
        try:
            self._send(Add(items, chat, future))
            self._submitted += len(items)
            await future
        except ValueError:
            stream._unfinished.clear()         # nothing was added
            stream.close()
            raise
        except BaseException:                  # cancelled (client gone) or the engine died
            stream.close()
            raise
        return stream

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """The deltas of one request; the request is aborted when the consumer stops early."""
        rid = request_id or f"req-{uuid.uuid4().hex}"
        stream = await self.submit([SubRequest(rid, prompt, params or SamplingParams())], chat)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def call(self, fn: Callable[[EngineClient], T]) -> T:
        """Run fn(engine) on the engine thread between steps (tokenizer use, inspection)."""
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        results: list[T] = []                  # set on the thread before the future is resolved
        self._send(Call(lambda engine: results.append(fn(engine)), future))
        await future
        return results[0]

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _send(self, command: Command) -> None:
        """Hand a command to the thread; once it has died, an add or call raises EngineDeadError (nothing
        would answer it) and an abort is dropped (nothing is left to abort)."""
        with self._cond:
            if self._dead:
                if isinstance(command, Abort):
                    return
                raise EngineDeadError("the engine has stopped")
            self._inbox.append(command)
            self._cond.notify()

    def _close_stream(self, request_ids: list[str], abort: list[str]) -> None:
        """On the loop: route nothing more to these requests; abort those given (a closed stream's)."""
        for rid in request_ids:
            self._streams.pop(rid, None)
        if abort:
            self._send(Abort(abort))

    def _dispatch(self, items: list[Routed]) -> None:
        """On the loop: route deltas (or errors) to their streams; unknown ids were closed already."""
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                stream._put(item)

    # ---- the engine thread's side ------------------------------------------------------------

    def _run(self, engine: EngineClient | Callable[[], EngineClient], built: list[BaseException],
             ready: threading.Event) -> None:
        try:
            self.engine = engine = engine() if callable(engine) else engine
        except BaseException as e:             # the constructor raises it
            built.append(e)
            return
        finally:
            ready.set()
        steps = engine.stats().num_steps
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._stopping and not engine.has_unfinished():
                        self._cond.wait()
                    if self._stopping:
                        break
                    self._taken, self._inbox = self._inbox, []
                while self._taken:                 # a command stays taken until handled: if handling it
                    self._handle(self._taken[0])   # kills the thread, _fail_all still answers it
                    self._taken.pop(0)
                if engine.has_unfinished():
                    self._step()
                self._publish()
                step = engine.last_step if self.stats.engine.num_steps != steps else None
                if step is not None:           # a step ran (a step with nothing scheduled records none)
                    steps = self.stats.engine.num_steps
                    self._observe(self.observer.on_step, step, self.stats)
        except EngineBrokenError as e:         # a rank is gone: say so once, fail everyone
            log.error("the engine stopped: %s", e)
        except BaseException:                  # a bug in this loop: make it loud, fail everyone
            log.exception("the engine thread died")
            raise
        finally:
            self._fail_all(EngineDeadError("the engine has stopped"))
            # a tensor-parallel engine's other ranks, from this thread
            close = getattr(engine, "close", None)
            if close is not None:
                close()

    def _handle(self, command: Command) -> None:
        if isinstance(command, Add):
            self._received += len(command.items)
            try:
                self._add(command.items, command.chat, command.future.get_loop())
            except Exception as e:
                resolve(command.future, error=e if isinstance(e, ValueError) else EngineError(str(e)))
            else:
                resolve(command.future)
            self._publish()                    # received and waiting change together, in one snapshot
        elif isinstance(command, Abort):
            for rid in command.request_ids:
                live = self._live.pop(rid, None)
                if live is not None:
                    self.engine.abort(rid)
                    self._observe(self.observer.on_finish, live.request, "abort")
        elif isinstance(command, Call):
            try:
                command.fn(self.engine)
            except Exception as e:
                resolve(command.future, error=e)
            else:
                resolve(command.future)

    def _add(self, items: list[SubRequest], chat: bool, loop: asyncio.AbstractEventLoop) -> None:
        """Tokenize, then add all (or none: a request the engine's admission refuses undoes the others)."""
        engine = self.engine
        encoded: dict[int, tuple[list[int], tuple[tuple[int, float], ...]]] = {}
        prepared = []
        for it in items:
            key = id(it.prompt)                # the choices of one prompt share its object: encode once
            if key not in encoded:
                encoded[key] = engine.encode_marked(it.prompt) if isinstance(it.prompt, ChatPrompt) else \
                    (engine.encode_prompt(it.prompt, chat), ())
            ids, marks = encoded[key]
            params = dataclasses.replace(it.params, cache_breakpoints=marks) if marks else it.params
            prepared.append((it.request_id, ids, params))
        added = []
        try:
            for rid, ids, params in prepared:
                engine.add_request(ids, params, request_id=rid)
                added.append(rid)
                request = engine.request(rid)
                assert request is not None             # just added: the engine holds it
                self._live[rid] = Live(request, loop)
            for rid in added:
                self._observe(self.observer.on_add, self._live[rid].request)
        except Exception:
            for rid in added:
                self._live.pop(rid, None)
                engine.abort(rid)
            raise

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except EngineBrokenError:
            raise                              # nothing more can run: the thread ends, everyone is told
        except Exception as e:
            log.exception("engine step failed")
            self._fail_step(e)
            return
        out: dict[asyncio.AbstractEventLoop, list[Routed]] = {}
        for d in deltas:
            live = self._live.get(d.request_id)
            if live is None:
                continue
            self._observe(self.observer.on_delta, d)
            if d.finished:
                del self._live[d.request_id]
                self._observe(self.observer.on_finish, live.request, d.output.finish_reason or "stop")
            out.setdefault(live.loop, []).append((d.request_id, d))
        self._deliver(out)

    def _fail_step(self, error: Exception) -> None:
        """The core finished the step's requests with an error; tell their streams. If it failed none
        (the step could not even be scheduled), fail them all so the thread cannot spin."""
        live_in_core = self.engine.live_request_ids()
        failed = [rid for rid in self._live if rid not in live_in_core] or list(self._live)
        for rid in [r for r in live_in_core if r not in self._live]:
            self.engine.abort(rid)             # not ours (cannot happen through this class): no spinning
        self._fail(failed, EngineError(f"the engine failed while running this request: {error}"))

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        out: dict[asyncio.AbstractEventLoop, list[Routed]] = {}
        for rid in request_ids:
            live = self._live.pop(rid)
            try:
                self.engine.abort(rid)         # forget it in the LLMEngine (and the core, if still there)
            except Exception:
                log.exception("abort failed")
            self._observe(self.observer.on_finish, live.request, "error")
            out.setdefault(live.loop, []).append((rid, error))
        self._deliver(out)

    def _fail_all(self, error: Exception) -> None:
        self._fail(list(self._live), error)
        with self._cond:
            self._dead = True
            commands, self._inbox = self._taken + self._inbox, []   # taken but not handled, then the rest
            self._taken = []
        for command in commands:
            if isinstance(command, (Add, Call)):
                resolve(command.future, error=error)
        self._publish()

    @staticmethod
    def _observe(hook: Callable[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
        try:
            hook(*args, **kwargs)
        except Exception:                      # metrics must never take the engine down
            log.exception("metrics observer failed")

    def _publish(self) -> None:
        engine = self.engine
        self.stats = ServerStats(engine=engine.stats(), threads=engine.thread_stats(),
                                 kv_block_bytes=engine.kv_block_bytes, num_received=self._received)

    def _deliver(self, out: dict[asyncio.AbstractEventLoop, list[Routed]]) -> None:
        for loop, items in out.items():
            post(loop, partial(self._dispatch, items))
