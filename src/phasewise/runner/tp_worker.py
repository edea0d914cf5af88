"""The other ranks of a tensor-parallel engine: processes that hold their part of the model and of
the KV cache and run whatever step rank 0's runner broadcasts (vLLM's driver and workers).

Started by `torchrun` (ranks on one machine or several), every process runs the same command:
rank 0 builds the engine, the others call `serve_launched_rank` instead (cli.py); a Ray Serve replica
(deploy/tp_ranks.py) gives its rank 0 the same environment and runs `run_rank` in Ray actors placed in
its placement group's other bundles. Otherwise, on one machine, `TPWorkers` starts ranks 1..N-1
as fresh interpreters running this module (never `fork` after OpenMP started, and unlike
multiprocessing's spawn, without re-importing the caller's script) and rank 0 joins the group with
them over loopback; each rank gets its share of the cores as torch threads. Rank 0 then sends the
setup every rank needs to build the same cache (`Setup`), and afterwards one message per forward
pass or logits request; a "stop" message, or the group failing (a rank died: collectives time out
or break), ends a worker.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from phasewise.distributed import TensorParallel, init_tensor_parallel, launched_rank, rank_device
from phasewise.kernels import build as kernel_build
from phasewise.loading.loader import load_prepared, parse_dtype
from phasewise.runner.kv_cache import INT4, KVCache
from phasewise.runner.model_runner import ModelRunner, RankStep


@dataclass(frozen=True)
class Setup:
    """What rank 0 decided and every rank must agree on."""
    model_path: str
    weights: str               # precision.Precision.weights
    kv_dtype: str              # "int8", "int4" or the weights' float type
    num_blocks: int
    block_size: int
    kernels: bool              # compiled CPU kernels (each rank loads its own, at the same ISA level)
    plain: bool                # kernels="torch": no oneDNN either
    tail_slots: int = 16       # a quantized KV cache's sequences at once (core/kv_cache_manager.py)


def threads_per_rank(size: int, threads: int | None = None) -> int:
    """The cores (or `threads`) shared evenly by `size` ranks on one machine, at least one each."""
    return max(1, (threads or os.cpu_count() or 1) // size)


class TPWorkers:
    """Ranks 1..size-1: child processes of this one (rank 0), or torchrun's (not ours to wait for or
    kill, only to tell)."""

    def __init__(self, init_method: str, procs: list[subprocess.Popen[bytes]]) -> None:
        self.init_method, self.procs = init_method, procs
        self.broken = False                              # the ranks are out of step: kill, do not ask

    @classmethod
    def spawn(cls, size: int, threads: int, device: str = "cpu") -> TPWorkers:
        with socket.socket() as s:                       # a free loopback port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        return cls(init_method,
                   [subprocess.Popen([sys.executable, "-m", "phasewise.runner.tp_worker", str(rank),
                                      str(size), init_method, str(threads),
                                      f"cuda:{rank}" if device == "cuda" else device])
                    for rank in range(1, size)])

    @classmethod
    def launched(cls) -> TPWorkers:
        return cls("env://", [])

    def stop(self, tp: TensorParallel | None, timeout: float = 30.0) -> None:
        """Tell the workers to end, wait for them, leave the group."""
        if tp is not None and not self.broken and all(p.poll() is None for p in self.procs):
            try:
                stop: RankStep = ("stop", None)
                tp.broadcast(stop)
            except RuntimeError:
                pass
        else:                                  # a rank died or the ranks are out of step: kill the rest
            timeout = 0
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class TensorParallelRanks:
    """Rank 0's handle on a tensor-parallel engine: its group, the other ranks' processes, and the
    finalizer that stops them (run by `stop()`, or when the handle is collected)."""
    group: TensorParallel
    workers: TPWorkers

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, self.workers.stop, self.group)

    def stop(self) -> None:
        self._finalizer()


def start_ranks(size: int, device: str) -> TensorParallelRanks | None:
    """With size > 1: spawn ranks 1..size-1 on this machine, join their group as rank 0, and share
    this process's threads among the ranks; under torchrun, join the group its environment names
    (this must be rank 0; the others run cli's worker path)."""
    if size == 1:
        return None
    launched = launched_rank()
    if launched is not None:
        rank, world = launched
        if (rank, world) != (0, size):
            raise ValueError(f"the engine runs on rank 0 of {size} (torchrun started rank {rank} of {world})")
        return TensorParallelRanks(init_tensor_parallel(0, size, "env://", device), TPWorkers.launched())
    threads = threads_per_rank(size, torch.get_num_threads())
    workers = TPWorkers.spawn(size, threads, device)
    torch.set_num_threads(threads)
    return TensorParallelRanks(init_tensor_parallel(0, size, workers.init_method, device), workers)


def run_rank(rank: int, size: int, init_method: str, threads: int, device: str = "cpu") -> None:
    """Rank `rank` of `size`: join the group at `init_method`, load this rank's part as rank 0's setup says,
    run steps until rank 0 stops (a spawned worker, a torchrun rank, a Ray actor of deploy/tp_ranks.py)."""
    torch.set_num_threads(threads)
    device = rank_device(device)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, size, init_method, device)
    try:
        # unpickled from rank 0, whose build_engine sends its Setup first
        setup = cast(Setup, tp.broadcast())
        kernels = kernel_build.load() if setup.kernels else None
        model, cfg = load_prepared(Path(setup.model_path), setup.weights, device, kernels, setup.plain, tp)
        kv_dtype = {"int8": torch.int8, "int4": INT4}.get(setup.kv_dtype) or parse_dtype(setup.weights)
        cache = KVCache(cfg, setup.num_blocks, setup.block_size, kv_dtype, device,
                        num_tail_slots=setup.tail_slots)
        runner = ModelRunner(model, cache, frozenset(), device, kernels, tp)
        if tp.broadcast() == "ready":              # rank 0 loaded its part too (else it failed: stop)
            serve_steps(runner)
    except RuntimeError:           # the group broke: rank 0 is gone
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_launched_rank(size: int, device: str = "cpu") -> None:
    """A rank > 0 that torchrun started (its environment names the group): run steps until rank 0
    stops. The model path and precision come from rank 0's setup, not from this command line."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"torchrun started {world} processes but --tensor-parallel-size is {size}")
    run_rank(rank, size, "env://", torch.get_num_threads(), device)


@torch.inference_mode()
def serve_steps(runner: ModelRunner) -> None:
    """Run what rank 0 sends until it says stop: a step's forward pass, or the logits of some of its
    rows (this rank's part of the vocabulary, gathered on rank 0)."""
    tp = runner.tp
    if tp is None:
        raise ValueError("serve_steps runs a rank > 0 of a tensor-parallel group: the runner has none")
    hidden: torch.Tensor | None = None
    while True:
        step = cast(RankStep, tp.broadcast())       # unpickled from rank 0: what its runner sends
        if step[0] == "forward":
            hidden = runner.forward(step[1])
        elif step[0] == "logits":
            assert hidden is not None               # rank 0 asks for logits of the step it ran
            runner.model.compute_logits(hidden[torch.tensor(step[1], dtype=torch.int64,
                                                            device=hidden.device)])
        else:
            return


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="one rank of a tensor-parallel phasewise "
                                             "engine (started by rank 0)")
    ap.add_argument("rank", type=int)
    ap.add_argument("size", type=int)
    ap.add_argument("init_method")
    ap.add_argument("threads", type=int)
    ap.add_argument("device", nargs="?", default="cpu")
    a = ap.parse_args()
    run_rank(a.rank, a.size, a.init_method, a.threads, a.device)
