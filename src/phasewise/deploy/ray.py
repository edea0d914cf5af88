"""`phasewise serve --ray`: the model as Ray Serve replicas, and `build_app` for `serve run` and Serve config
files (`import_path: phasewise.deploy.ray:build_app`, `args` as serve's flags).

`EngineReplica` (one per replica, `num_cpus` each, its kernel threads that many) builds one engine and the
FastAPI app as `phasewise serve` does (`server/builder.py`'s `build_server`; the app wrapped by
`replica_app.ReplicaApp`): the whole OpenAI surface, no second implementation. How HTTP reaches it
(`--ray-ingress`):
- direct (what `serve --ray` starts): Ray Serve's HAProxy ingress. The engine deployment is the
  application's ingress, each replica listening on a port of its node; HAProxy asks `route.RouteIngress`
  which replica serves each request (the prompt's blocks, `PrefixAffinityRouter`) and forwards it there,
  the response streaming back through HAProxy alone. Ray reads the switches from the environment of its
  processes (`options.DIRECT_INGRESS_ENV`): a cluster joined with --ray-address must have been started
  with them, else `auto` is `proxy`.
- proxy: Serve's own HTTP proxy in front of `Ingress`, `relay.py`'s relay, which reads each body, hashes
  its prompt's blocks and calls an engine replica through a streaming DeploymentHandle routed by
  `PrefixAffinityRouter` (two Ray calls per streamed event; a replica that dies mid-stream ends it with
  an error event, where direct ingress cuts the connection).

A tensor-parallel replica (`--tensor-parallel-size N`) is a placement group of N bundles
(`--placement-strategy`): the replica is rank 0 in bundle 0, its other ranks Ray actors in the others
(`tp_ranks.py`). With `--prefill-decode` the engine replicas are two deployments, `PrefillReplica` and
`DecodeReplica`, one replica each, behind the relay whichever the ingress: the decode replica asks the
prefill one for its KV link's rendezvous (`kv_peer`) and joins it (torch.distributed, as `serve --role
prefill|decode`), and the relay sends each request to one, then the other (as `serve --role proxy` does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import signal
import sys
import threading
from typing import TYPE_CHECKING, AsyncIterator, TypedDict

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application, Deployment

from phasewise.config import KVRole
from phasewise.deploy.options import DeployOptions, app_options, check_ray_options, direct_ingress
from phasewise.deploy.prefix_router import PrefixAffinityRouter
from phasewise.deploy.relay import Relay, RelayedRequest
from phasewise.deploy.replica_app import MetricsVisit, ReplicaApp, ReplicaHandle, gather_metrics, own_metrics
from phasewise.deploy.route import RouteIngress
from phasewise.deploy.tp_ranks import rendezvous_address, start_replica_ranks

if TYPE_CHECKING:
    from starlette.types import Message   # ASGI's: a plain dict

APP_NAME = "phasewise"
TARGET_ONGOING_REQUESTS = 8                  # autoscaling's target of ongoing requests per replica
log = logging.getLogger("ray.serve")


class EngineReplica:
    """One phasewise engine and its FastAPI app. As the ingress (direct), Serve serves the app over HTTP
    (`__serve_build_asgi_app__`); behind the relay, `handle` runs it on one relayed request and yields the
    ASGI messages it sends, a batch at a time."""

    # Serve awaits an async constructor (mypy knows only sync ones)
    async def __init__(self, options: DeployOptions, role: KVRole | None = None,  # type: ignore[misc]
                       prefill: ReplicaHandle | None = None) -> None:
        """`role`: "prefill" (this replica's KV link waits at a free port of its node) or "decode" (it joins
        the link of the `prefill` deployment's replica); None: a whole engine."""
        from phasewise.server.builder import build_server

        self._replica = serve.get_replica_context().replica_id.to_full_id_str()
        engine, cpus = options.engine, options.replica_cpus
        size, threads = engine.tensor_parallel_size, engine.threads or cpus
        self._ranks = (start_replica_ranks(self._replica, size, cpus, threads, engine.device)
                       if size > 1 else None)
        self._kv_peer = rendezvous_address() if role == "prefill" else None
        if role == "decode" and prefill is not None:
            self._kv_peer = await prefill.kv_peer.remote()
        # kernel threads: --threads, else the replica's CPUs (a rank's, when it has several)
        config = dataclasses.replace(engine, kv_role=role, kv_peer=self._kv_peer, threads=threads)
        parts = await asyncio.to_thread(build_server, config, options.server)
        self._engine, self._app = parts.async_engine, parts.app

    def __serve_build_asgi_app__(self) -> ReplicaApp:
        """The app Serve runs when this deployment is the ingress: /metrics answers for every replica."""
        context = serve.get_replica_context()
        handle = serve.get_deployment_handle(context.deployment, context.app_name)
        return ReplicaApp(self._app, self._replica, lambda: gather_metrics(handle))

    async def metrics_text(self, visit: MetricsVisit) -> tuple[str, str]:
        """(this replica's id, its own /metrics text); `visit` is for the router."""
        return self._replica, await own_metrics(self._app)

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
            out.put_nowait(message)

        app = ReplicaApp(self._app, self._replica)

        # the app is done: the last batch, and its failure if any
        def ended(t: asyncio.Task[None]) -> None:
            out.put_nowait(None)
            _log_failure(t)

        task = asyncio.create_task(app({**request.scope, "root_path": ""}, receive, send))
        task.add_done_callback(ended)
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
        if self._ranks is not None and self._ranks.ended():
            raise RuntimeError("a tensor-parallel rank stopped")

    def kv_peer(self) -> str | None:
        """The rendezvous of this replica's KV link (tcp://host:port), if it is one side of a pair."""
        return self._kv_peer

    def rank_nodes(self) -> list[str]:
        """The Ray node of each rank, rank 0 (this replica) first."""
        return [ray.get_runtime_context().get_node_id(), *(self._ranks.node_ids() if self._ranks else ())]

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
        ranks = getattr(self, "_ranks", None)
        if ranks is not None:
            ranks.stop()


@serve.ingress()
class Ingress:
    """The HTTP ingress: `Relay` over handles to the engine replicas (and to the prefill replicas)."""

    def __init__(self, engine: ReplicaHandle,
                 prefill: ReplicaHandle | None = None) -> None:
        self._engine, self._prefill = engine, prefill

    def __serve_build_asgi_app__(self) -> Relay:
        return Relay(self._engine, self._prefill)


def application(options: DeployOptions,
                request_router: type | str = PrefixAffinityRouter) -> Application:
    """The Serve application of these options (`direct_ingress` picks how HTTP reaches the replicas), the
    engine replicas routed by `request_router` (another is for comparisons: benchmarks/ray_serve.py)."""
    check_ray_options(options)
    ingress = serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4096)(Ingress)
    # a prefill deployment and a decode one, their replicas paired by KV link
    if options.ray.prefill_decode:
        prefill = _engine_deployment(options, request_router, "PrefillReplica").bind(options, "prefill")
        decode = _engine_deployment(options, request_router, "DecodeReplica").bind(options, "decode", prefill)
        return ingress.bind(decode, prefill)
    if not direct_ingress(options.ray):
        return ingress.bind(_engine_deployment(options, request_router).bind(options))
    engine = _engine_deployment(options, request_router, as_ingress=True).bind(options)
    route = serve.deployment(name="RouteIngress", ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=4096)(RouteIngress)
    return engine._with_ingress_request_router(route.bind(engine))


def build_app(args: dict[str, object]) -> Application:
    """Serve's app builder: `serve run phasewise.deploy.ray:build_app num-replicas=2 kv-cache-memory=0.25`."""
    return application(app_options(args))


class _Scaling(TypedDict, total=False):
    """How many replicas of a deployment, and each one's placement group (serve.deployment's options)."""
    num_replicas: int
    autoscaling_config: dict[str, int]
    placement_group_bundles: list[dict[str, float]]
    placement_group_strategy: str


def _engine_deployment(options: DeployOptions, request_router: type | str, name: str = "EngineReplica",
                       as_ingress: bool = False) -> Deployment:
    o, tp = options.ray, options.engine.tensor_parallel_size
    if o.min_replicas is not None and o.max_replicas is not None:     # both or neither (check_ray_options)
        scaling: _Scaling = {"autoscaling_config": {
            "min_replicas": o.min_replicas, "max_replicas": o.max_replicas,
            "target_ongoing_requests": TARGET_ONGOING_REQUESTS}}
    else:
        scaling = {"num_replicas": o.num_replicas or 1}
    cpus = options.replica_cpus
    if tp > 1:
        scaling["placement_group_bundles"] = [{"CPU": cpus}] * tp
        scaling["placement_group_strategy"] = o.placement_strategy
    kwargs = {"margin": o.prefix_margin} if request_router is PrefixAffinityRouter else {}
    return serve.deployment(
        name=name, ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=2 * options.engine.scheduler.max_num_seqs, health_check_period_s=5,
        graceful_shutdown_timeout_s=5,
        request_router_config=RequestRouterConfig(
            # Ray's stub types **kwargs as dict[str, Any]
            request_router_class=request_router, request_router_kwargs=kwargs),  # type: ignore[arg-type]
        **scaling)(serve.ingress()(EngineReplica) if as_ingress else EngineReplica)


def run(options: DeployOptions) -> int:
    """`phasewise serve --ray`: start (or join) Ray, deploy, serve until Ctrl-C or SIGTERM, then tear down."""
    app = application(options)
    # "local": a Ray of its own, never whatever local cluster /tmp/ray/ray_current_cluster names (a stale
    # one, from a run that did not stop cleanly, would hang ray.init)
    ray.init(address=options.ray.address or "local", include_dashboard=False, log_to_driver=True)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": options.host, "port": options.port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:            # a replica's constructor failed (Serve tried it three times)
            raise ValueError(failure_line(str(e))) from None
        ingress = "HAProxy" if direct_ingress(options.ray) else "Serve's proxy"
        print(f"phasewise: serving on http://{options.host}:{options.port}/v1 as Ray Serve replicas behind "
              f"{ingress} (Ray at {ray.get_runtime_context().gcs_address})", file=sys.stderr, flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        # a cluster joined: take the application away, leave the rest
        if options.ray.address is not None:
            serve.delete(APP_NAME, _blocking=False)
        return 0
    finally:              # a Ray started here stops with its driver, Serve's actors with it (a Ctrl-C in a
        ray.shutdown()    # terminal has already signalled its processes: nothing here waits on them)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("phasewise app failed on a request: %r", task.exception())


def failure_line(fallback: str) -> str:
    """Why the application failed, in one line: the exception that ended a replica's constructor (the
    loader's message, without its class), from Serve's deployment status; else `fallback`."""
    app = serve.status().applications.get(APP_NAME)
    details = "\n".join(d.message for d in app.deployments.values() if d.message) if app else ""
    raised = [line.strip() for line in details.splitlines()
              if re.match(r"\s*[\w.]*(Error|Exception): ", line)]
    return raised[-1].split(": ", 1)[1] if raised else fallback
