"""A tensor-parallel Ray Serve replica's other ranks. The replica's placement group has one bundle per rank
(`--placement-strategy`: PACK by default, all in one node if it fits; SPREAD or STRICT_SPREAD across
nodes); Serve puts the replica (rank 0) in bundle 0, and `start_replica_ranks` starts ranks 1..N-1 as Ray
actors in bundles 1..N-1, each running tp_worker's worker loop (`run_rank`), and gives rank 0 torchrun's
environment (MASTER_ADDR: this node's address, MASTER_PORT, RANK 0, WORLD_SIZE), so that the engine joins
the group as it does under torchrun. The ranks then meet over torch.distributed (gloo on CPUs).

The actors are the replica's: they die with it (Ray ends an actor's children with it, and Serve removes
the replica's placement group). A rank that dies (or whose loop ends) fails the replica's health check,
and Serve replaces the whole replica."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import ray
from ray.actor import ActorProxy
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

SERVE_NAMESPACE = "serve"                    # where Serve names its replicas' actors; the ranks beside them


class Rank:
    """Rank r > 0 of one replica's tensor-parallel group (a Ray actor with two threads: `run` blocks in one).
    Its methods are `ray.method`s (unchanged) so that calls through a handle type-check."""

    @ray.method
    def run(self, rank: int, size: int, init_method: str, threads: int, device: str) -> None:
        """tp_worker's worker loop: returns when rank 0 stops or the group breaks."""
        from phasewise.runner.tp_worker import run_rank

        run_rank(rank, size, init_method, threads, device)

    @ray.method
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@dataclass
class ReplicaRanks:
    """Ranks 1..N-1 of a replica: their actors and the calls that run their loops."""
    # Ray's type of a handle (ActorHandle, or the class for method types)
    actors: list[ActorProxy[Rank]]
    loops: list[ray.ObjectRef[None]]        # each rank's `run`

    def node_ids(self) -> list[str]:
        return ray.get([a.node_id.remote() for a in self.actors], timeout=60)

    def ended(self) -> bool:
        """Whether a rank's loop has returned or its actor died (the group is broken)."""
        return bool(ray.wait(self.loops, num_returns=1, timeout=0)[0])

    def stop(self) -> None:
        for a in self.actors:
            # Ray types a handle as ActorProxy; kill's stub wants ActorHandle
            ray.kill(a)  # type: ignore[arg-type]


def start_replica_ranks(replica: str, size: int, cpus: int, threads: int, device: str) -> ReplicaRanks:
    """From inside the replica `replica` whose placement group has `size` bundles: start ranks 1..size-1 in
    bundles 1..size-1 (`cpus` each, `threads` kernel threads; actors named "<replica>#rank<r>") and set this
    process's environment for rank 0."""
    group = get_current_placement_group()
    if group is None:
        raise RuntimeError("a tensor-parallel replica runs in a placement group (placement_group_bundles)")
    init_method = rendezvous_address()
    address, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    actor = ray.remote(Rank)
    actors = [actor.options(name=f"{replica}#rank{rank}", namespace=SERVE_NAMESPACE, num_cpus=cpus,
                            max_concurrency=2, scheduling_strategy=PlacementGroupSchedulingStrategy(
                                group, placement_group_bundle_index=rank)).remote()
              for rank in range(1, size)]
    loops = [a.run.remote(rank, size, init_method, threads, device) for rank, a in enumerate(actors, start=1)]
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=port, RANK="0", WORLD_SIZE=str(size))
    return ReplicaRanks(actors, loops)


def rendezvous_address() -> str:
    """tcp://<this node's address>:<a free port there>: where a torch.distributed group can meet (this
    replica's tensor-parallel group, or the KV link of a prefill/decode pair)."""
    address = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((address, 0))
        return f"tcp://{address}:{s.getsockname()[1]}"
