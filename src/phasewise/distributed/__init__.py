"""Scaling past one process on torch.distributed: the tensor-parallel group a model's shard runs in."""

from phasewise.distributed.tensor_parallel import (TensorParallel, init_tensor_parallel, launched_rank,
                                                   rank_device)

__all__ = ["TensorParallel", "init_tensor_parallel", "launched_rank", "rank_device"]
