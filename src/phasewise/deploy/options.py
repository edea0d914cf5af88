"""The options of `phasewise serve --ray` and of `phasewise.deploy.ray:build_app`, which takes serve's flag
names as keys (`serve run phasewise.deploy.ray:build_app num-replicas=2`, or a Serve config file's `args`).
No Ray import here: the CLI adds these flags whether or not Ray is installed."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NoReturn, cast, get_args

from phasewise.config import EngineConfig
from phasewise.engine.args import (add_chat_args, add_engine_args, engine_config_from_args, positive_int,
                                   resolve_weights)
from phasewise.server.config import ServeOptions

RAY_EXTRA = "pip install 'phasewise[ray]'"
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
Ingress = Literal["auto", "direct", "proxy"]
PLACEMENT_STRATEGIES: tuple[PlacementStrategy, ...] = get_args(PlacementStrategy)
INGRESSES: tuple[Ingress, ...] = get_args(Ingress)
# Ray Serve's switches for HAProxy in front of the ingress replicas, read by Ray's processes at start
DIRECT_INGRESS_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                      "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
# ... and its retries: a request whose replica closed the connection without a byte of answer (it died) is
# sent again, to another replica (Serve's `option redispatch 1`), as one whose replica refused the
# connection is by default. A response begun is never retried (HAProxy cannot): a stream is cut.
HAPROXY_RETRY_ENV = {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response"}


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """serve's "Ray Serve replicas" group."""
    g = p.add_argument_group("Ray Serve replicas")
    g.add_argument("--ray", action="store_true",
                   help=f"serve the model as Ray Serve replicas behind Serve's HTTP proxy ({RAY_EXTRA})")
    g.add_argument("--ray-address", default=None, metavar="auto|ADDR",
                   help="join this Ray cluster (default: start one on this machine)")
    g.add_argument("--num-replicas", type=positive_int, default=None,
                   help="a fixed count of replicas (default 1)")
    g.add_argument("--min-replicas", type=positive_int, default=None,
                   help="autoscale between --min-replicas and --max-replicas on ongoing requests per replica")
    g.add_argument("--max-replicas", type=positive_int, default=None)
    g.add_argument("--num-cpus-per-replica", type=positive_int, default=1,
                   help="CPUs Ray reserves for each replica; the replica's kernel threads are this many (a "
                        "tensor-parallel replica's ranks share them evenly, at least one each)")
    g.add_argument("--placement-strategy", default="PACK", choices=PLACEMENT_STRATEGIES,
                   help="where a tensor-parallel replica's ranks go (Ray's placement group strategies: PACK "
                        "puts them in one node when they fit, SPREAD and STRICT_SPREAD across nodes)")
    g.add_argument("--prefill-decode", action="store_true",
                   help="a prefill/decode pair instead of whole replicas: a prefill deployment and a decode "
                        "deployment (one replica each) joined by a KV link, the relay sending each request "
                        "to one then the other")
    g.add_argument("--ray-ingress", default="auto", choices=INGRESSES,
                   help="how HTTP reaches the replicas: direct (Ray Serve's HAProxy ingress, each response "
                        "straight from its replica), proxy (Serve's Python proxy and a relay: an error event "
                        "when a replica dies mid-stream), auto (direct on a Ray started here or started with "
                        "Ray's HAProxy switches, else proxy)")
    g.add_argument("--prefix-margin", type=int, default=4,
                   help="a request goes to the replica holding its prompt's prefix unless that replica's "
                        "queue is longer than the shortest by more than this many requests")


@dataclass(frozen=True)
class RayOptions:
    """serve's "Ray Serve replicas" group, typed."""
    address: str | None = None                   # --ray-address (None: a Ray of its own)
    num_replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    num_cpus_per_replica: int = 1
    placement_strategy: PlacementStrategy = "PACK"
    prefill_decode: bool = False
    ingress: Ingress = "auto"
    prefix_margin: int = 4


@dataclass(frozen=True)
class DeployOptions:
    """What a Ray deployment is built from, read once from `phasewise serve --ray`'s flags or a Serve
    config's `args` (`deploy_options`): each replica's engine (its role, KV peer and threads set where it
    runs), its server, the replicas, and where Serve's proxy listens."""
    engine: EngineConfig
    server: ServeOptions
    ray: RayOptions
    host: str = "127.0.0.1"
    port: int = 8000

    @property
    def replica_cpus(self) -> int:
        """The CPUs of one rank of a replica: --num-cpus-per-replica shared by its ranks, at least one
        each."""
        return max(1, self.ray.num_cpus_per_replica // self.engine.tensor_parallel_size)


def deploy_options(args: argparse.Namespace) -> DeployOptions:
    """The typed options of a parse of serve's flags (weights resolved), checked: ValueError for what a Ray
    deployment cannot take yet, and replica counts that disagree."""
    if getattr(args, "role", None) or getattr(args, "trace", None):
        raise ValueError("--ray serves whole replicas: --role and --trace are one process's")
    ray = RayOptions(address=args.ray_address, num_replicas=args.num_replicas, min_replicas=args.min_replicas,
                     max_replicas=args.max_replicas, num_cpus_per_replica=args.num_cpus_per_replica,
                     placement_strategy=cast(PlacementStrategy, args.placement_strategy),
                     prefill_decode=args.prefill_decode, ingress=cast(Ingress, args.ray_ingress),
                     prefix_margin=args.prefix_margin)
    engine = engine_config_from_args(args, kv_role=None, kv_peer=None, threads=args.threads)
    options = DeployOptions(engine, ServeOptions.from_args(args), ray, args.host, args.port)
    check_ray_options(options)
    return options


def replica_parser() -> argparse.ArgumentParser:
    """The flags a replica reads: the engine's, the server's a replica uses (the same names and defaults as
    `phasewise serve`'s; tests/ray_cluster/test_ray_serve.py checks they agree) and the Ray group."""
    p = _RaisingParser(prog="phasewise.deploy.ray:build_app", add_help=False)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", nargs="+", default=None)
    s.add_argument("--served-model-name", nargs="+", default=None)
    s.add_argument("--max-waiting", type=int, default=1024)
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=512)
    add_chat_args(s)
    add_engine_args(p)
    add_ray_args(p)
    return p


def app_options(args: Mapping[str, object]) -> DeployOptions:
    """Serve's app-builder arguments (flag names with dashes or underscores, values as strings or typed)
    → the options `phasewise serve --ray` would have read. ValueError names a bad key or value."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    parsed = replica_parser().parse_args(argv)
    resolve_weights(parsed)
    return deploy_options(parsed)


def check_ray_options(deploy: DeployOptions) -> None:
    """What a Ray deployment cannot take yet, and replica counts that disagree: ValueError."""
    options, tp = deploy.ray, deploy.engine.tensor_parallel_size
    if tp > 1 and deploy.engine.device != "cpu":
        raise ValueError("--ray runs tensor-parallel replicas on CPUs only (no GPU bundles yet)")
    auto = options.min_replicas is not None or options.max_replicas is not None
    if options.prefill_decode and (auto or (options.num_replicas or 1) > 1 or tp > 1):
        raise ValueError("--prefill-decode runs one pair of single-rank replicas (no --num-replicas above 1, "
                         "autoscaling or --tensor-parallel-size yet)")
    if auto and options.num_replicas is not None:
        raise ValueError("--num-replicas is a fixed count: drop it, or --min-replicas and --max-replicas")
    if auto and not (options.min_replicas and options.max_replicas
                     and options.min_replicas <= options.max_replicas):
        raise ValueError("autoscaling needs --min-replicas A --max-replicas B with A <= B")
    if options.prefix_margin < 0:
        raise ValueError(f"--prefix-margin must be at least 0, got {options.prefix_margin}")


def start_direct_ingress(options: RayOptions) -> None:
    """Before Ray (and Ray Serve) is imported and started here: turn on Ray Serve's HAProxy ingress (and
    its retries) for the Ray about to start, unless the options ask for the proxy or join a running cluster
    (whose switches were set when it started)."""
    if options.ingress == "direct" or (options.ingress == "auto" and options.address is None):
        os.environ.update(DIRECT_INGRESS_ENV)
        for name, value in HAPROXY_RETRY_ENV.items():     # a retry policy of the user's own stands
            os.environ.setdefault(name, value)


def direct_ingress(options: RayOptions) -> bool:
    """Whether the application uses Ray Serve's HAProxy ingress: asked for, or `auto` and this process's
    environment has Ray's switches on. ValueError: asked for without them."""
    switched_on = all(os.environ.get(k) == v for k, v in DIRECT_INGRESS_ENV.items())
    if options.ingress == "direct" and not switched_on:
        raise ValueError("--ray-ingress direct needs Ray started with " +
                         " ".join(f"{k}={v}" for k, v in DIRECT_INGRESS_ENV.items()))
    return options.ingress != "proxy" and switched_on


class _RaisingParser(argparse.ArgumentParser):
    """A bad key or value is a ValueError (one line), not an exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"build_app: {message}")
