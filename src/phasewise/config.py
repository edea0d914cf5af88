"""Engine settings as frozen dataclasses, composed rather than inherited."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16                 # tokens per KV block
    kv_cache_memory_gib: float = 2.0     # pool size when num_blocks is not given
    num_blocks: int | None = None        # exact pool size (overrides the memory budget)
    enable_prefix_caching: bool = True   # reuse KV blocks of prompts seen before
    kv_dtype: str = "auto"               # auto (the model's dtype) | int8 (per-token, per-head scales)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory_gib}")
        if self.kv_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'int8', got {self.kv_dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512    # token budget of one step
    max_num_seqs: int = 64               # requests running at once
    max_model_len: int | None = None     # context cap; None → the model's own

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None             # .gguf file or HF folder; None → the default model
    dtype: str = "fp32"                  # weights: fp32 | bf16 | fp16
    device: str = "cpu"
    kernels: str = "auto"                # linear kernels: auto (oneDNN on CPU) | torch (plain F.linear)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.kernels not in ("auto", "torch"):
            raise ValueError(f"kernels must be 'auto' or 'torch', got {self.kernels!r}")
