"""Engine settings as frozen dataclasses, composed rather than inherited; where phasewise keeps what it
builds and converts (`default_cache_dir`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from typing_extensions import TypedDict, Unpack   # typing has Unpack from Python 3.11

# bytes a process holds beside its weights and KV cache (torch, the tokenizer, buffers): the loader's
# memory check and `phasewise memory` count it
PROCESS_OVERHEAD = 400 * 2**20
# what weights run at (q4: the GGUF file's own blocks)
WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "int8", "q4")


def default_cache_dir() -> Path:
    """Where phasewise keeps what it builds and converts (kernels, tokenizers, packed weights):
    $PHASEWISE_CACHE, else $XDG_CACHE_HOME/phasewise, else ~/.cache/phasewise."""
    if os.environ.get("PHASEWISE_CACHE"):
        return Path(os.environ["PHASEWISE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "phasewise"


SpecMethod = Literal["ngram", "draft", "mtp"]     # who proposes drafts (speculative decoding)
KVRole = Literal["prefill", "decode"]             # a side of a disaggregated pair
KernelChoice = Literal["auto", "torch"]           # compiled CPU kernels (auto) or the PyTorch references
KVDtypeChoice = Literal["auto", "model", "int8", "int4"]


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    block_size: int = 16                 # tokens per KV block
    kv_cache_memory_gib: float = 2.0     # pool size when num_blocks is not given
    num_blocks: int | None = None        # exact pool size (overrides the memory budget)
    enable_prefix_caching: bool = True   # reuse KV blocks of prompts seen before
    # auto (engine/precision.py) | model (the weights' float type) | int8 | int4
    kv_dtype: KVDtypeChoice = "auto"
    prompt_cache_dir: str | None = None  # the prefix cache's disk tier (None: RAM only), shared by processes
    prompt_cache_size_gib: float = 10.0  # the directory's size limit (LRU eviction past it)
    prompt_cache_ttl: float = 3600.0     # seconds a block stays after its last use, unless its request says

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory_gib}")
        if self.kv_dtype not in get_args(KVDtypeChoice):
            raise ValueError(f"kv_dtype must be 'auto', 'model', 'int8' or 'int4', got {self.kv_dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if not self.prompt_cache_size_gib > 0 or not self.prompt_cache_ttl > 0:
            raise ValueError("prompt_cache_size and prompt_cache_ttl must be positive, got "
                             f"{self.prompt_cache_size_gib} GiB and {self.prompt_cache_ttl} s")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512    # token budget of one step
    max_num_seqs: int = 64               # requests running at once
    max_model_len: int | None = None     # context cap; None → the model's own

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")


class SpeculativeSettings(TypedDict, total=False):
    """SpeculativeConfig's fields besides the method and the draft model (what `parse` passes on)."""
    num_speculative_tokens: int
    ngram_min: int
    ngram_max: int
    draft_dtype: str
    adaptive: bool


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes draft tokens, and how many per step."""
    method: SpecMethod | None = None     # None (off) | "ngram" (prompt lookup) | "draft" (a draft model) |
                                         # "mtp" (the model's own multi-token-prediction layer)
    num_speculative_tokens: int = 4      # k: drafts verified per step (adaptive: at most)
    # each decode's k from measured acceptance and costs (core/spec_policy.py)
    adaptive: bool = True
    ngram_min: int = 2                   # n-gram sizes tried, longest first
    ngram_max: int = 4
    draft_model: str | None = None       # draft: a .gguf file or HF folder; None → the target's own file
    draft_dtype: str = "q4"              # draft weights: fp32 | bf16 | fp16 | int8 | q4

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in get_args(SpecMethod):
            raise ValueError(f"speculative method must be 'ngram', 'draft' or 'mtp', got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("n-gram sizes must satisfy 1 <= min <= max, got "
                             f"{self.ngram_min}..{self.ngram_max}")
        if self.draft_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"draft dtype must be one of {', '.join(WEIGHT_DTYPES)}, got "
                             f"{self.draft_dtype!r}")

    @classmethod
    def parse(cls, spec: str | None, **settings: Unpack[SpeculativeSettings]) -> SpeculativeConfig:
        """'ngram', 'draft' (the target's file), 'draft:MODEL', 'mtp', or None/'' (off)."""
        if not spec:
            return cls(method=None, **settings)
        method, _, model = spec.partition(":")
        if method == "ngram" and not model:
            return cls(method="ngram", **settings)
        if method == "mtp" and not model:
            return cls(method="mtp", **settings)
        if method == "draft":
            return cls(method="draft", draft_model=model or None, **settings)
        raise ValueError(f"--speculative must be 'ngram', 'draft[:MODEL]' or 'mtp', got {spec!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str | None = None             # .gguf file or HF folder; None → the default model
    # weights: auto (engine/precision.py) | fp32 | bf16 | fp16 | int8 | q4
    dtype: str = "auto"
    device: str = "cpu"
    # auto (compiled CPU kernels, oneDNN) | torch (the PyTorch references)
    kernels: KernelChoice = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    tensor_parallel_size: int = 1        # ranks the model is split over (runner/tp_worker.py)
    kv_role: KVRole | None = None        # one side of a disaggregated pair
    kv_peer: str | None = None           # the pair's rendezvous (tcp://host:port), both sides the same
    # map packed GGUF weights from <cache>/packed (loading/packed_cache.py)
    packed_cache: bool = True
    threads: int | None = None           # kernel threads: None adapts to the CPUs other programs leave free
                                         # (runner/thread_governor.py), N pins
    # a chat template's text in place of the model's (serve --chat-template)
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.kernels not in get_args(KernelChoice):
            raise ValueError(f"kernels must be 'auto' or 'torch', got {self.kernels!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.kv_role not in (None, "prefill", "decode"):
            raise ValueError(f"kv_role must be 'prefill' or 'decode', got {self.kv_role!r}")
        if (self.kv_role is None) != (self.kv_peer is None):
            raise ValueError("a prefill or decode role needs --kv-peer tcp://HOST:PORT "
                             "(the same on both sides)")
        if self.kv_role and self.tensor_parallel_size > 1:
            raise ValueError("a prefill or decode instance runs one rank (tensor parallelism "
                             "is not combined yet)")
