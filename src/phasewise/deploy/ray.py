"""`phasewise serve --ray`: the model as Ray Serve replicas, and `build_app` for `serve run` and Serve config
files (`import_path: phasewise.deploy.ray:build_app`, `args` as serve's flags).

Two deployments. `EngineReplica` (one per replica, `num_cpus` each, its kernel threads that many) builds one
engine and the FastAPI app of `phasewise serve` (`server.create_app`), and runs that app on the HTTP
requests handed to it: the whole OpenAI surface, no second implementation. `Ingress` is the application's
HTTP ingress behind Serve's proxy (`@serve.ingress`, its ASGI app built on the replica): a relay that reads
each request's body, hashes its prompt's blocks and calls an engine replica through a streaming
DeploymentHandle whose router is `PrefixAffinityRouter`. The relay exists because Serve's proxy routes
before it reads a body: a router behind the proxy sees only the URL and headers, not the prompt.

A replica that dies mid-stream ends its streams with an error event (`data: {"error": ...}`, then
`[DONE]`): the relay sees the handle fail, and the client sees an error, not a hang; Serve routes new
requests to the live replicas and starts a new one. Tensor-parallel replicas (a placement group of ranks
per replica) and prefill/decode pairs are not here yet: `EngineReplica` is where a replica would gain ranks,
through `placement_group_bundles` in `_engine_deployment`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from phasewise.deploy.options import app_options, check_ray_options
from phasewise.deploy.prefix_router import PrefixAffinityRouter, prompt_block_hashes

APP_NAME = "phasewise"
REPLICA_HEADER = "x-phasewise-replica"       # which replica served a response: its Serve replica id
TARGET_ONGOING_REQUESTS = 8                  # autoscaling's target of ongoing requests per replica
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers",
              "client", "server")
log = logging.getLogger("ray.serve")

Message = dict[str, Any]


@dataclass(frozen=True)
class RelayedRequest:
    """One HTTP request, from the ingress to an engine replica: the ASGI scope's plain fields, the whole body,
    and the prompt's block hashes (the router's key)."""
    scope: dict[str, Any]
    body: bytes
    block_hashes: tuple[bytes, ...]


class EngineReplica:
    """One phasewise engine and its FastAPI app; `handle` runs the app on one relayed request and yields
    the ASGI messages it sends, a batch at a time."""

    async def __init__(self, options: argparse.Namespace) -> None:
        self._replica = serve.get_replica_context().replica_id.to_full_id_str()
        self._engine, self._app = await asyncio.to_thread(build_server, options)

    async def handle(self, request: RelayedRequest) -> AsyncIterator[list[Message]]:
        out: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        pending_body = [request.body]

        async def receive() -> Message:
            if pending_body:
                return {"type": "http.request", "body": pending_body.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (REPLICA_HEADER.encode(), self._replica.encode())]
                message = {**message, "headers": headers}
            out.put_nowait(message)

        task = asyncio.create_task(self._app({**request.scope, "root_path": ""}, receive, send))
        task.add_done_callback(lambda t: (out.put_nowait(None), _log_failure(t)))
        try:
            while True:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                messages = [m for m in batch if m is not None]
                if messages:
                    yield messages
                if batch[-1] is None:
                    return
        finally:                         # the caller went away: the app's streams close, their requests abort
            gone.set()
            if not task.done():
                task.cancel()

    def check_health(self) -> None:
        if not self._engine.is_alive:
            raise RuntimeError("the engine thread stopped")

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()


def build_server(options: argparse.Namespace):
    """The engine and app `phasewise serve` builds (cli.cmd_serve), for one replica: (AsyncEngine, FastAPI).
    Kernel threads: --threads, else the replica's CPUs."""
    from phasewise.config import CacheConfig, EngineConfig, SchedulerConfig
    from phasewise.engine_args import speculative_config_from_args
    from phasewise.llm_engine import LLMEngine
    from phasewise.server import AsyncEngine, ServerConfig, create_app

    o = options
    config = EngineConfig(
        model=o.model, dtype=o.dtype, device=o.device,
        cache=CacheConfig(block_size=o.block_size, kv_cache_memory_gib=o.kv_cache_memory, kv_dtype=o.kv_dtype),
        scheduler=SchedulerConfig(o.max_num_batched_tokens, o.max_num_seqs, o.max_model_len),
        speculative=speculative_config_from_args(o), packed_cache=o.packed_cache,
        threads=o.threads or o.num_cpus_per_replica)

    def build() -> LLMEngine:                    # on the engine thread, which then owns the OpenMP pool
        engine = LLMEngine(config)
        engine.warmup()
        engine.grammars.prepare()
        return engine

    async_engine = AsyncEngine(build)
    path = Path(async_engine.engine.model_path)
    name = o.served_model_name or (path.name if path.is_dir() else path.stem)
    aliases = tuple(a for a in (o.model, str(path)) if a)
    app = create_app(async_engine, ServerConfig(served_model_name=name, model_aliases=aliases, api_key=o.api_key,
                                                max_waiting=o.max_waiting, max_body_bytes=o.max_body_bytes,
                                                model_root=str(path)))
    return async_engine, app


class Relay:
    """The ingress's ASGI app: each HTTP request to an engine replica, its response back as it comes."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self._engine = engine.options(stream=True)

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        request = RelayedRequest({k: scope[k] for k in SCOPE_KEYS if k in scope}, body, prompt_block_hashes(_json(body)))
        started = event_stream = False
        try:
            async for messages in self._engine.handle.remote(request):
                for m in messages:
                    if m["type"] == "http.response.start":
                        started = True
                        event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                           for k, v in m.get("headers", ()))
                    await send(m)
        except asyncio.CancelledError:
            raise
        except Exception as e:               # the replica died or failed: an error the client sees, never a hang
            await _send_failure(send, f"the replica serving this request failed ({type(e).__name__})", started,
                                event_stream)


@serve.ingress()
class Ingress:
    """The HTTP ingress: `Relay` over a handle to the engine replicas."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self._engine = engine

    def __serve_build_asgi_app__(self) -> Relay:
        return Relay(self._engine)


def application(options: argparse.Namespace) -> Application:
    """The Serve application of these options: the ingress bound to the engine replicas."""
    check_ray_options(options)
    options = argparse.Namespace(**{k: v for k, v in vars(options).items() if k != "func"})   # the CLI's command
    engine = _engine_deployment(options).bind(options)
    return serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=4096).bind(engine)


def build_app(args: dict[str, Any]) -> Application:
    """Serve's app builder: `serve run phasewise.deploy.ray:build_app num-replicas=2 kv-cache-memory=0.25`."""
    return application(app_options(args))


def _engine_deployment(o: argparse.Namespace):
    if o.min_replicas is not None:
        scaling: dict[str, Any] = {"autoscaling_config": {"min_replicas": o.min_replicas, "max_replicas": o.max_replicas,
                                                          "target_ongoing_requests": TARGET_ONGOING_REQUESTS}}
    else:
        scaling = {"num_replicas": o.num_replicas or 1}
    return serve.deployment(
        EngineReplica, name="EngineReplica", ray_actor_options={"num_cpus": o.num_cpus_per_replica},
        max_ongoing_requests=2 * o.max_num_seqs, health_check_period_s=5, graceful_shutdown_timeout_s=5,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs={"margin": o.prefix_margin}),
        **scaling)


def run(options: argparse.Namespace) -> int:
    """`phasewise serve --ray`: start (or join) Ray, deploy, serve until Ctrl-C or SIGTERM, then tear down."""
    import ray

    app = application(options)
    ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": options.host, "port": options.port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:            # a replica's constructor failed (Serve tried it three times)
            raise ValueError(failure_line(str(e))) from None
        print(f"phasewise: serving on http://{options.host}:{options.port}/v1 as Ray Serve replicas "
              f"(Ray at {ray.get_runtime_context().gcs_address})", file=sys.stderr, flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        if options.ray_address is not None:       # a cluster joined: take the application away, leave the rest
            serve.delete(APP_NAME, _blocking=False)
        return 0
    finally:              # a Ray started here stops with its driver, Serve's actors with it (a Ctrl-C in a
        ray.shutdown()    # terminal has already signalled its processes: nothing here waits on them)


async def _lifespan(receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive: Callable[[], Awaitable[Message]]) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


async def _send_failure(send: Callable[[Message], Awaitable[None]], message: str, started: bool,
                        event_stream: bool) -> None:
    from phasewise.server.protocol import error_body

    error = json.dumps(error_body(message, "server_error", code="replica_failed")).encode()
    if not started:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": error})
    elif event_stream:
        await send({"type": "http.response.body", "body": b"data: " + error + b"\n\ndata: [DONE]\n\n"})
    else:                                    # a JSON body cut short: the client's parser fails on it
        await send({"type": "http.response.body", "body": b""})


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("phasewise app failed on a request: %r", task.exception())


def failure_line(fallback: str) -> str:
    """Why the application failed, in one line: the exception that ended a replica's constructor (the
    loader's message, without its class), from Serve's deployment status; else `fallback`."""
    app = serve.status().applications.get(APP_NAME)
    details = "\n".join(d.message for d in app.deployments.values() if d.message) if app else ""
    raised = [line.strip() for line in details.splitlines() if re.match(r"\s*[\w.]*(Error|Exception): ", line)]
    return raised[-1].split(": ", 1)[1] if raised else fallback
