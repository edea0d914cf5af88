"""TensorParallel: one rank's place in a tensor-parallel group, and the three collectives a model
shard needs (Megatron-LM's split, as vLLM runs it).

- Column-parallel layers (qkv, gate_up) hold a slice of the output rows: no communication.
- Row-parallel layers (o, down) hold the matching slice of the input columns: each rank's output
  is a partial sum, `all_reduce` adds them (one per attention and one per MLP, every layer).
- The embedding and the output head hold a slice of the vocabulary (`vocab_part`): a lookup
  outside a rank's slice is zero before the all-reduce; the logits' slices are gathered on rank 0,
  where sampling happens once.
- Rank 0 drives: `broadcast` sends each step's plan (and any object) to the other ranks.

The group is passed to every module that needs it, never kept in a global: torch.distributed's
default group (gloo on CPUs, NCCL on GPUs) is only what `init_tensor_parallel` joins.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: dist.ProcessGroup | None = None   # None: the default group

    @property
    def driver(self) -> bool:
        return self.rank == 0

    def part(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of n items cut into `size` equal parts (the last padded: n need
        not divide)."""
        step = -(-n // self.size)
        return min(n, self.rank * step), min(n, (self.rank + 1) * step)

    def padded(self, n: int) -> int:
        """Items per rank when n is cut into `size` equal parts."""
        return -(-n // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, table: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
              vocab: int) -> torch.Tensor:
        """ids [T] → [T, hidden] from this rank's rows of the table (an embedding module), summed over the
        ranks."""
        start, stop = self.part(vocab)
        local = ids - start
        outside = (local < 0) | (local >= stop - start)
        x = table(local.masked_fill(outside, 0))
        return self.all_reduce(x.masked_fill_(outside[:, None], 0.0))

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """Each rank's logits [N, padded(vocab)] → [N, vocab] on rank 0 (None elsewhere)."""
        local = local.contiguous()
        if not self.driver:
            dist.gather(local, None, dst=0, group=self.group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab]

    def broadcast(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled: plain lists and small tensors); the other ranks pass
        nothing and know by the protocol what they get."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or anything setting its
    environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with more than one process; else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_device(device: str) -> str:
    """A CUDA device per rank on a node (torchrun's LOCAL_RANK); any other device as given."""
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def init_tensor_parallel(rank: int, size: int, init_method: str, device: str = "cpu",
                         timeout_s: float = 600.0) -> TensorParallel:
    """Join the group of `size` ranks at `init_method` (tcp://host:port or env://): gloo on the CPU,
    NCCL on CUDA. A collective that waits longer than `timeout_s` (a rank died) raises."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallel(rank, size)
