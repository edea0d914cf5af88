"""Scaling past one process on torch.distributed: the tensor-parallel group a model's shard runs in."""

from phasewise.distributed.tensor_parallel import TensorParallel, init_tensor_parallel

__all__ = ["TensorParallel", "init_tensor_parallel"]
