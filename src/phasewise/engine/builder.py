"""Building an engine from its config, in one place: the model file and its precision, the kernels,
the tokenizer, the tensor-parallel ranks, the KV cache and its size, the draft model, and the runner
and core over them. `build_engine` returns the parts; `LLMEngine` drives them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from phasewise.config import EngineConfig, SpeculativeConfig
from phasewise.core.engine_core import EngineCore
from phasewise.core.spec_policy import SpecPolicy
from phasewise.distributed import TensorParallel
from phasewise.kernels import build as kernel_build
from phasewise.kernels.kernel_api import Kernels
from phasewise.loading.loader import check_memory, load_config, load_prepared, parse_dtype, resolve_model_path
from phasewise.loading.sharding import check_tensor_parallel, shard_config
from phasewise.models.config import ModelConfig
from phasewise.engine.precision import Precision, choose as choose_precision
from phasewise.engine.prompt_cache import check_supported as check_prompt_cache, open_disk_tier
from phasewise.core.prompt_store import Clock
from phasewise.runner.kv_cache import (INT4, KVCache, key_group, kv_bytes_per_block, num_blocks_for_memory,
                                       state_slots_for_memory, tail_bytes, tail_slots_for_memory)
from phasewise.runner.model_runner import ModelRunner, Proposer
from phasewise.runner.thread_governor import ThreadGovernor
from phasewise.runner.tp_worker import Setup, TensorParallelRanks, start_ranks
from phasewise.spec_decode.draft_model import DraftModelProposer
from phasewise.spec_decode.mtp import MTPProposer
from phasewise.spec_decode.ngram import NgramProposer
from phasewise.structured import GrammarCompiler
from phasewise.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from phasewise.models.llama import LlamaForCausalLM     # what the loader builds (the registry's classes)
    from phasewise.models.qwen3_5 import Qwen3_5ForCausalLM


def check_device(device: str) -> None:
    """ValueError (one line) for a device torch does not know, or one this torch build cannot reach."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r} (cpu, cuda or cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch build sees no CUDA device (torch "
                         f"{torch.__version__})")


def choose_kernels(config: EngineConfig) -> Kernels | None:
    """The compiled CPU kernels for this engine (the ISA level isa.py picks), or None: another
    device, `kernels="torch"`, or nothing could be built. Chosen once, handed to every model."""
    if config.kernels == "torch" or torch.device(config.device).type != "cpu":
        return None
    return kernel_build.load()


@dataclass
class EngineParts:
    """What an engine is made of, built and ready."""
    config: EngineConfig
    model_path: Path
    model_config: ModelConfig
    precision: Precision
    kernels: Kernels | None
    tokenizer: Tokenizer
    ranks: TensorParallelRanks | None         # with tensor parallelism (this process is rank 0)
    model: LlamaForCausalLM
    kv_cache: KVCache
    draft_model: LlamaForCausalLM | None
    max_model_len: int
    grammars: GrammarCompiler
    core: EngineCore
    runner: ModelRunner                       # the core's runner (rank 0's, with tensor parallelism)
    threads: ThreadGovernor                   # the kernels' thread count (pinned, or adapting to the machine)
    load_ms: float                            # building took this long


def build_engine(config: EngineConfig, clock: Clock | None = None) -> EngineParts:
    """Check the config against the model (cheap failures first), then load everything it names (TTLs
    by `clock`). ValueError (one line) for what cannot run; a tensor-parallel group started is stopped."""
    started = time.perf_counter()
    check_device(config.device)
    model_path = resolve_model_path(config.model)
    full = load_config(model_path)   # cheap: an unsupported architecture fails before anything slow
    _check_features(config, full)
    kernels = choose_kernels(config)
    asked = choose_precision(model_path, config.dtype, config.cache.kv_dtype, kernels, full.architecture)
    config, precision = _quantized_kv_fits(config, asked)
    spec, size, cache = config.speculative, config.tensor_parallel_size, config.cache
    kv_dtype = {"int8": torch.int8, "int4": INT4}.get(precision.kv) or parse_dtype(precision.weights)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    ranks = start_ranks(size, config.device)
    try:
        tp = ranks.group if ranks else None
        part = shard_config(full, tp) if tp else full     # what this rank holds
        slots, checkpoints, snapshots, tails, num_blocks = _cache_size(part, config, kv_dtype)
        states = slots + checkpoints + snapshots
        if tp:
            tp.broadcast(Setup(str(model_path), precision.weights, precision.kv, num_blocks, cache.block_size,
                               kernels is not None, config.kernels == "torch", tails))
        if precision.weights == "q4" and not tp and str(config.device).startswith("cpu"):
            check_memory(model_path, num_blocks * kv_bytes_per_block(part, cache.block_size, kv_dtype)
                         + states * part.state_bytes_per_seq + tails * tail_bytes(part, kv_dtype))
        model, model_config, tokenizer = _load(config, model_path, precision.weights, kernels, tp)
        if tp:
            tp.broadcast("ready")                               # every rank has loaded its part
        max_len = config.scheduler.max_model_len or model_config.max_position_embeddings
        max_model_len = min(max_len, model_config.max_position_embeddings)
        kv_cache = KVCache(model_config, num_blocks, cache.block_size, kv_dtype, config.device,
                           num_state_slots=states, num_tail_slots=tails)
        draft_model, proposer = _proposer(config, model_path, model, kernels, max_model_len, num_blocks,
                                          slots, tokenizer.eos_token_ids, kv_dtype)
        runner = ModelRunner(model, kv_cache, tokenizer.eos_token_ids, config.device, kernels, tp,
                             snapshot_slots=range(slots + checkpoints, slots + checkpoints + snapshots),
                             proposer=proposer)
        disk = open_disk_tier(config, model_path, precision.weights, kv_cache, kernels is not None, clock)
        core = EngineCore(runner, config.scheduler, num_blocks, cache.block_size, max_model_len,
                          cache.enable_prefix_caching, spec.num_speculative_tokens if proposer else 0,
                          model_config.kv_group_windows, slots, checkpoints, disk, _spec_policy(spec),
                          kv_cache.num_tail_slots)
    except BaseException:
        if ranks:
            ranks.stop()
        raise
    grammars = GrammarCompiler(tokenizer, model_config.vocab_size, tokenizer.eos_token_ids)
    adapt = config.threads is None and ranks is None and torch.device(config.device).type == "cpu"
    threads = ThreadGovernor(torch.get_num_threads(), adapt)
    return EngineParts(config, model_path, model_config, precision, kernels, tokenizer, ranks, model,
                       kv_cache, draft_model, max_model_len, grammars, core, runner, threads,
                       (time.perf_counter() - started) * 1e3)


def _proposer(config: EngineConfig, model_path: Path, target: LlamaForCausalLM, kernels: Kernels | None,
              max_model_len: int, num_blocks: int, state_slots: int, eos_token_ids: frozenset[int],
              kv_dtype: torch.dtype) -> tuple[LlamaForCausalLM | None, Proposer | None]:
    """The speculation method's proposer (and its draft model: `--speculative draft`), or none."""
    spec = config.speculative
    if spec.method == "ngram":
        return None, NgramProposer(spec.ngram_min, spec.ngram_max)
    # the target's own MTP layer, its K/V in a cache of the target's block layout
    if spec.method == "mtp":
        mtp_model = cast("Qwen3_5ForCausalLM", target)      # loaded with mtp=True (checked before loading)
        return None, MTPProposer(mtp_model, num_blocks, config.cache.block_size, kv_dtype, eos_token_ids,
                                 config.device, kernels, config.scheduler.max_num_seqs)
    if spec.method != "draft":
        return None, None
    draft, kv = _draft_model(config, model_path, target.config, kernels, max_model_len,
                             num_blocks, state_slots)
    return draft, DraftModelProposer(draft, kv, eos_token_ids, config.device, kernels,
                                     state_slots if draft.config.recurrent_layers else 0)


def _check_features(config: EngineConfig, cfg: ModelConfig) -> None:
    """What the model cannot run with of what the config asks (tensor parallelism, speculation, the
    prompt cache's disk tier): a ValueError saying so."""
    check_tensor_parallel(cfg, config.tensor_parallel_size)
    _check_speculation(cfg, config.speculative, config.tensor_parallel_size)
    check_prompt_cache(config, cfg)


def _check_speculation(cfg: ModelConfig, spec: SpeculativeConfig, tp_size: int) -> None:
    """What speculative decoding cannot run with yet: a ValueError saying so."""
    if tp_size > 1 and spec.method in ("draft", "mtp"):
        raise ValueError(f"--speculative {spec.method} does not run with tensor parallelism yet: "
                         "use --speculative ngram")
    if spec.method == "mtp" and not cfg.mtp_layers:
        raise ValueError(f"--speculative mtp needs a model with a multi-token-prediction layer (a Qwen3.5 or "
                         f"Qwen3-Next folder with mtp.* weights); this {cfg.architecture} model has none "
                         f"(GGUF files: not read yet): use --speculative ngram or draft")


def _quantized_kv_fits(config: EngineConfig, precision: Precision) -> tuple[EngineConfig, Precision]:
    """The config and precision, a quantized KV cache checked against what it needs (key groups of 16 tokens,
    int4: 64, within the blocks; at most a group's drafts a step, so that a rejected one leaves its sequence
    within its last two key groups): an int4 cache turns blocks of 16 or 32 tokens into 64; a float cache
    where "auto" chose a cache that cannot run, a ValueError where it was asked for."""
    if precision.kv not in ("int8", "int4"):
        return config, precision
    spec, group = config.speculative, key_group(INT4 if precision.kv == "int4" else torch.int8)
    bs = config.cache.block_size
    if bs < group and group % bs == 0:
        config = replace(config, cache=replace(config.cache, block_size=group))
        precision = replace(precision, why=f"{precision.why}; blocks of {group} tokens (the key groups')")
        bs = group
    clash = (f"a block size of {bs} (not a multiple of {group})" if bs % group else
             f"{spec.num_speculative_tokens} drafts a step (more than {group})"
             if spec.method and spec.num_speculative_tokens > group else None)
    if clash is None:
        return config, precision
    if config.cache.kv_dtype == precision.kv:
        raise ValueError(f"an {precision.kv} KV cache does not run with {clash}: use --kv-dtype model")
    return config, replace(precision, kv="model", why=f"{precision.why}; a float KV cache with {clash}")


def _spec_policy(spec: SpeculativeConfig) -> SpecPolicy | None:
    """The policy choosing each decode's drafts from measured costs (None: always num_speculative_tokens)."""
    return SpecPolicy(spec.num_speculative_tokens) if spec.adaptive else None


def _cache_size(cfg: ModelConfig, config: EngineConfig,
                kv_dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(recurrent-state slots, checkpoint slots, snapshot slots, tail slots, KV blocks) within the cache's
    memory budget: a hybrid's states first, one per sequence that may run and, with prefix caching, as many
    checkpoints, with speculation k snapshots each (the states a verify step may roll back to), all in at
    most half the budget; a quantized cache's tail slots (tail_slots_for_memory); then blocks in the rest."""
    cache, k = config.cache, config.speculative.num_speculative_tokens if config.speculative.method else 0
    slots = state_slots_for_memory(cfg, config.scheduler.max_num_seqs, cache.kv_cache_memory_gib,
                                   cache.enable_prefix_caching, k)
    checkpoints = slots if cache.enable_prefix_caching else 0
    snapshots = slots * k if cfg.recurrent_layers else 0
    tails = tail_slots_for_memory(cfg, kv_dtype, config.scheduler.max_num_seqs, cache.kv_cache_memory_gib)
    kv_gib = cache.kv_cache_memory_gib - ((slots + checkpoints + snapshots) * cfg.state_bytes_per_seq
                                          + tails * tail_bytes(cfg, kv_dtype)) / 2**30
    if config.speculative.method == "mtp":     # the MTP layer's own cache: one more attention layer's K/V
        kv_gib *= len(cfg.attention_layers) / (len(cfg.attention_layers) + 1)
    num_blocks = cache.num_blocks or num_blocks_for_memory(cfg, cache.block_size, kv_dtype, kv_gib)
    return slots, checkpoints, snapshots, tails, num_blocks


def _draft_model(config: EngineConfig, target_path: Path, target: ModelConfig, kernels: Kernels | None,
                 max_model_len: int, num_blocks: int, state_slots: int) -> tuple[LlamaForCausalLM, KVCache]:
    """The draft model of `--speculative draft` (the target itself unless another is named) and its own
    KV cache in the target's block layout (same block count and size, its own dtype); a hybrid draft's
    states two per sequence that may run (`state_slots`): its committed tokens' and its drafts'."""
    spec: SpeculativeConfig = config.speculative
    if target.kv_group_windows[0] is not None:
        raise ValueError("a draft model needs a target with full-attention layers (every layer of this one "
                         "has a sliding window): use --speculative ngram")
    path = resolve_model_path(spec.draft_model) if spec.draft_model else target_path
    draft, cfg = load_prepared(path, spec.draft_dtype, config.device, kernels,
                               plain=config.kernels == "torch", packed_cache=config.packed_cache)
    draft.build_stack(_bound(kernels, spec.draft_dtype))
    if cfg.recurrent_layers and not target.recurrent_layers:
        raise ValueError(f"a hybrid draft model ({cfg.architecture}) needs a hybrid target (its states "
                         "follow the target's state slots): use an attention-only draft, "
                         "or --speculative ngram")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {path} has {cfg.vocab_size} tokens in its vocabulary, the "
                         f"target {target.vocab_size}: they must share the tokenizer")
    if cfg.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model {path} holds {cfg.max_position_embeddings} positions, fewer "
                         f"than the context length {max_model_len}: lower --max-model-len")
    kv = KVCache(cfg, num_blocks, config.cache.block_size, parse_dtype(spec.draft_dtype), config.device,
                 grouped=False,   # read through the target's first group's table
                 num_state_slots=2 * state_slots if cfg.recurrent_layers else 0)
    return draft, kv


def _load(config: EngineConfig, model_path: Path, weights: str, kernels: Kernels | None,
          tp: TensorParallel | None) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
    """The model with its C++ decoder stack (where it can run), and its tokenizer, which reads its
    files while the weights load."""
    with ThreadPoolExecutor(1) as pool:
        tokenizer_loading = pool.submit(_tokenizer, model_path, config.chat_template)
        model, model_config = load_prepared(model_path, weights, config.device, kernels,
                                            plain=config.kernels == "torch", tp=tp,
                                            packed_cache=config.packed_cache,
                                            mtp=config.speculative.method == "mtp")
        tokenizer = tokenizer_loading.result()
    model.build_stack(_bound(kernels, weights))
    return model, model_config, tokenizer


def _tokenizer(model_path: Path, chat_template: str | None) -> Tokenizer:
    """The model's tokenizer; with a chat template given (serve --chat-template), that one in place of its
    own."""
    tokenizer = Tokenizer.load(model_path)
    return tokenizer.with_chat_template(chat_template) if chat_template is not None else tokenizer


def _bound(kernels: Kernels | None, dtype: str) -> Kernels | None:
    """The kernels load_prepared bound a model of `dtype` to (none for float types but fp32)."""
    return kernels if parse_dtype(dtype) == torch.float32 else None
