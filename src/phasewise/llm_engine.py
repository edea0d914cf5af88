"""LLMEngine: tokenizer + engine core + detokenization. Text in, text deltas out, synchronously.

The offline API (`LLM`) and the server both drive this one class.
"""

from __future__ import annotations

import itertools
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from phasewise.admission import fit
from phasewise.config import CacheConfig, EngineConfig, SpeculativeConfig
from phasewise.distributed import TensorParallel, init_tensor_parallel, launched_rank
from phasewise.distributed.kv_link import KVLink
from phasewise.engine.core import EngineCore
from phasewise.engine.handoffs import EngineStats, RequestOutput, StepRecord
from phasewise.engine.request import FinishReason, Request
from phasewise.kernels import build as kernel_build
from phasewise.kernels.kernel_api import Kernels
from phasewise.loading.loader import check_memory, load_config, load_prepared, parse_dtype, resolve_model_path
from phasewise.loading.sharding import check_tensor_parallel, shard_config
from phasewise.models.config import ModelConfig
from phasewise.outputs import CompletionOutput, StreamDelta
from phasewise.precision import choose as choose_precision
from phasewise.runner.kv_cache import KVBlocks, KVCache, kv_bytes_per_block, num_blocks_for_memory
from phasewise.runner.model_runner import ModelRunner
from phasewise.runner.tp_worker import Setup, TPWorkers, threads_per_rank
from phasewise.sampling.params import SamplingParams
from phasewise.spec_decode.draft_model import DraftModelProposer
from phasewise.spec_decode.ngram import NgramProposer
from phasewise.structured import GrammarCompiler
from phasewise.tokenizer import IncrementalDetokenizer, Tokenizer


def choose_kernels(config: EngineConfig) -> Kernels | None:
    """The compiled CPU kernels for this engine (the ISA level isa.py picks), or None: another
    device, `kernels="torch"`, or nothing could be built. Chosen once, handed to every model."""
    if config.kernels == "torch" or torch.device(config.device).type != "cpu":
        return None
    return kernel_build.load()


class EngineBrokenError(RuntimeError):
    """The engine cannot run another step: a rank of its tensor-parallel group failed (or a step failed
    while the ranks ran it, so they are no longer in step). Its requests have ended; close() it."""


def check_device(device: str) -> None:
    """ValueError (one line) for a device torch does not know, or one this torch build cannot reach."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r} (cpu, cuda or cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch build sees no CUDA device (torch {torch.__version__})")


@dataclass
class _Tracked:
    output: CompletionOutput
    detok: IncrementalDetokenizer
    request: Request


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        started = time.perf_counter()
        self._finalizer = None                  # stops a tensor-parallel engine's other ranks
        self.broken: str | None = None          # why no step can run any more (EngineBrokenError)
        self.config = config = config or EngineConfig()
        check_device(config.device)
        self.model_path = resolve_model_path(config.model)
        full = load_config(self.model_path)   # cheap: an unsupported architecture fails before anything slow
        spec, size, cache = config.speculative, config.tensor_parallel_size, config.cache
        check_tensor_parallel(full, size)
        if size > 1 and spec.method == "draft":
            raise ValueError("a draft model does not run with tensor parallelism yet: use --speculative ngram")
        self.kernels = choose_kernels(config)
        self.precision = choose_precision(self.model_path, config.dtype, config.cache.kv_dtype, self.kernels)
        dtype = parse_dtype(self.precision.weights)
        kv_dtype = torch.int8 if self.precision.kv == "int8" else dtype
        with ThreadPoolExecutor(1) as pool:   # the tokenizer reads its files while the weights load
            tokenizer = pool.submit(Tokenizer.load, self.model_path)
            self._load(config, full, size, kv_dtype)
            self.tokenizer = tokenizer.result()
        self.grammars = GrammarCompiler(self.tokenizer.backend, self.model_config.vocab_size,
                                        self.tokenizer.eos_token_ids)
        runner = ModelRunner(self.model, self.kv_cache, self.tokenizer.eos_token_ids, config.device, self.kernels,
                             self.tp)
        self.draft_model = None
        self.core = EngineCore(runner, config.scheduler, self.kv_cache.num_blocks, cache.block_size, self.max_model_len,
                               cache.enable_prefix_caching, self._proposer(spec, self.kv_cache.num_blocks),
                               spec.num_speculative_tokens, self.model_config.kv_group_windows)
        self._ids = itertools.count()
        self._tracked: dict[str, _Tracked] = {}
        self.kv_link = KVLink(config.kv_role, config.kv_peer) if config.kv_role else None
        self.load_ms = (time.perf_counter() - started) * 1e3

    def _load(self, config: EngineConfig, full: ModelConfig, size: int, kv_dtype: torch.dtype) -> None:
        """Start the tensor-parallel ranks, size the KV cache, load the model and make its cache."""
        cache = config.cache
        self.tp, self._workers = self._start_tensor_parallel(size)
        part = shard_config(full, self.tp) if self.tp else full     # what this rank holds
        num_blocks = cache.num_blocks or num_blocks_for_memory(part, cache.block_size, kv_dtype,
                                                               cache.kv_cache_memory_gib)
        if self.tp:
            self.tp.broadcast(Setup(str(self.model_path), self.precision.weights, self.precision.kv, num_blocks,
                                    cache.block_size, self.kernels is not None,
                                    config.kernels == "torch"))
        if self.precision.weights == "q4" and not self.tp and str(config.device).startswith("cpu"):
            check_memory(self.model_path, num_blocks * kv_bytes_per_block(part, cache.block_size, kv_dtype))
        self.model, self.model_config = load_prepared(self.model_path, self.precision.weights, config.device,
                                                      self.kernels, plain=config.kernels == "torch", tp=self.tp,
                                                      packed_cache=config.packed_cache)
        if self.tp:
            self.tp.broadcast("ready")                               # every rank has loaded its part
        max_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        self.max_model_len = min(max_len, self.model_config.max_position_embeddings)
        self.kv_cache = KVCache(self.model_config, num_blocks, cache.block_size, kv_dtype, config.device)

    def _start_tensor_parallel(self, size: int) -> tuple[TensorParallel | None, TPWorkers | None]:
        """With size > 1: spawn ranks 1..size-1 on this machine, join their group as rank 0, and share
        this process's threads among the ranks; under torchrun, join the group its environment names
        (this must be rank 0; the others run cli's worker path). `close()` (or exit) stops them."""
        if size == 1:
            return None, None
        launched = launched_rank()
        if launched is not None:
            rank, world = launched
            if (rank, world) != (0, size):
                raise ValueError(f"the engine runs on rank 0 of {size} (torchrun started rank {rank} of {world})")
            tp = init_tensor_parallel(0, size, "env://", self.config.device)
            workers = TPWorkers.launched()
            self._finalizer = weakref.finalize(self, workers.stop, tp)
            return tp, workers
        threads = threads_per_rank(size, torch.get_num_threads())
        workers = TPWorkers.spawn(size, threads, self.config.device)
        torch.set_num_threads(threads)
        tp = init_tensor_parallel(0, size, workers.init_method, self.config.device)
        self._finalizer = weakref.finalize(self, workers.stop, tp)
        return tp, workers

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do otherwise)."""
        if self._finalizer is not None:
            self._finalizer()

    def _proposer(self, spec: SpeculativeConfig, num_blocks: int):
        """The draft-token proposer of `spec`, or None. A draft model gets its own KV cache with the
        target's block layout (same block count and size, its own dtype)."""
        if spec.method == "ngram":
            return NgramProposer(spec.ngram_min, spec.ngram_max)
        if spec.method != "draft":
            return None
        if self.model_config.kv_group_windows[0] is not None:
            raise ValueError("a draft model needs a target with full-attention layers (every layer of this one "
                             "has a sliding window): use --speculative ngram")
        path = resolve_model_path(spec.draft_model) if spec.draft_model else self.model_path
        draft, cfg = load_prepared(path, spec.draft_dtype, self.config.device, self.kernels,
                                   plain=self.config.kernels == "torch", packed_cache=self.config.packed_cache)
        if cfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"the draft model {path} has {cfg.vocab_size} tokens in its vocabulary, the "
                             f"target {self.model_config.vocab_size}: they must share the tokenizer")
        if cfg.max_position_embeddings < self.max_model_len:
            raise ValueError(f"the draft model {path} holds {cfg.max_position_embeddings} positions, fewer "
                             f"than the context length {self.max_model_len}: lower --max-model-len")
        kv = KVCache(cfg, num_blocks, self.config.cache.block_size, parse_dtype(spec.draft_dtype),
                     self.config.device, grouped=False)   # read through the target's first group's table
        self.draft_model = draft
        return DraftModelProposer(draft, kv, self.tokenizer.eos_token_ids, self.config.device, self.kernels)

    # ---- requests ---------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int] | list[dict], chat: bool,
                      tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt: chat messages (with OpenAI-style tools) through the chat template."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt, tools=tools)
        if isinstance(prompt, list):
            return list(prompt)
        if chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=tools)
        return self.tokenizer.encode(prompt)

    def admit(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """The request checks the server and the CLI share (phasewise.admission.fit): prompt + max_tokens
        against the context and the KV pool, stop_token_ids against the vocabulary; no max_tokens → as
        many as fit. RequestError (a ValueError naming the field) when it cannot run."""
        return fit(num_prompt_tokens, params, self.max_model_len,
                   self.kv_cache.num_blocks * self.kv_cache.block_size, self.model_config.vocab_size)

    def add_request(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
                    chat: bool = False, request_id: str | None = None, tools: list[dict] | None = None) -> str:
        """Queue a prompt (text, token ids, or chat messages, with tools for the template); returns the
        request id. ValueError for a prompt that cannot fit or a structured_outputs constraint that does
        not compile."""
        params = params or SamplingParams()
        arrival = time.perf_counter()
        prompt_ids = self.encode_prompt(prompt, chat, tools)
        request_id = request_id or f"req-{next(self._ids)}"
        compiled = time.perf_counter()
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        req = Request(request_id, prompt_ids, params, self.tokenizer.eos_token_ids, arrival=arrival, grammar=grammar)
        if grammar is not None:
            req.metrics.grammar_compile_ms = (time.perf_counter() - compiled) * 1e3
        self.core.add_request(req)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop)
        out = CompletionOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                               prompt_token_ids=prompt_ids, text="", token_ids=[], finish_reason=None,
                               stop_reason=None, logprobs=[] if params.logprobs is not None else None,
                               metrics=req.metrics)
        self._tracked[request_id] = _Tracked(out, detok, req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks are freed at once."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and tracked.output.finish_reason is None:
            tracked.output.finish_reason = FinishReason.ABORT.value
        return self.core.abort(request_id)

    # ---- KV blocks between engines (prefill/decode disaggregation) ---------------------------

    def export_kv(self, token_ids: list[int]) -> KVBlocks:
        """The blocks of this engine's prefix cache that hold the longest computed prefix of token_ids
        (whole blocks, never the last token's: the receiver computes that one), copied out. Run the
        prompt first (e.g. max_tokens=1): its blocks stay cached after it ends."""
        self._no_tp("exporting KV blocks")
        blocks = self.core.kv.cached_prefix(token_ids)
        bs = self.kv_cache.block_size
        return KVBlocks(list(token_ids[:len(blocks) * bs]), bs, self.kv_cache.read_blocks(blocks))

    def import_kv(self, kv: KVBlocks) -> int:
        """Enter another engine's blocks (same model, block size and KV precision) in this engine's
        prefix cache: a request with that prefix then computes only the rest. Returns the tokens
        imported; ValueError when the layouts differ or the pool has no room for them."""
        self._no_tp("importing KV blocks")
        if kv.block_size != self.kv_cache.block_size:
            raise ValueError(f"KV blocks of {kv.block_size} tokens cannot enter a cache of {self.kv_cache.block_size}")
        n = len(kv.token_ids)
        for name, t in self.kv_cache.read_blocks([]).items():       # this cache's layout, 0 tokens long
            want = (*t.shape[:2], n, *t.shape[3:])
            theirs = kv.parts.get(name)
            if theirs is None or theirs.dtype != t.dtype or tuple(theirs.shape) != want or n % kv.block_size:
                got = None if theirs is None else f"{tuple(theirs.shape)} {theirs.dtype}"
                raise ValueError(f"the KV blocks' {name} ({got}) does not match this engine's cache "
                                 f"({want} {t.dtype})")
        placed = self.core.kv.adopt_prefix(kv.token_ids, kv.num_blocks)
        if placed is None:
            raise ValueError(f"no room for {kv.num_blocks} KV blocks: {self.core.kv.pool.num_free} are free")
        fill = [i for i, (_, fresh) in enumerate(placed) if fresh]
        if fill:
            self.kv_cache.write_blocks([placed[i][0] for i in fill],
                                       {name: torch.cat([kv.block(i)[name] for i in fill], dim=2) for name in kv.parts})
        return kv.num_blocks * kv.block_size

    def send_kv(self, transfer_id: str, token_ids: list[int]) -> Future:
        """A prefill instance: send the cached blocks of this computed prompt to the decode instance
        (kv_link); the future resolves once they are sent."""
        if self.kv_link is None or self.kv_link.role != "prefill":
            raise ValueError("only a prefill instance (--role prefill) sends KV blocks")
        kv = self.export_kv(token_ids)
        return self.kv_link.send(transfer_id, (kv.token_ids, kv.block_size, kv.parts))

    def expect_kv(self, transfer_id: str) -> Future:
        """A decode instance: the future of the blocks the prefill instance sends under transfer_id
        (a KVBlocks for import_kv)."""
        if self.kv_link is None or self.kv_link.role != "decode":
            raise ValueError("only a decode instance (--role decode) receives KV blocks")
        out: Future = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(KVBlocks(*f.result()))
        self.kv_link.expect(transfer_id).add_done_callback(done)
        return out

    def _no_tp(self, what: str) -> None:
        if self.tp is not None:
            raise ValueError(f"{what} is not implemented under tensor parallelism yet")

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV blocks used, cached and free, step and speculation counters."""
        return self.core.stats()

    @property
    def last_step(self) -> StepRecord | None:
        """The latest step's record (what it ran, how long it took), or None before the first."""
        return self.core.steps[-1] if self.core.steps else None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def request(self, request_id: str) -> Request | None:
        """A live request (its state and metrics), or None once it has ended or if it is unknown."""
        return self.core.scheduler.requests.get(request_id)

    def live_request_ids(self) -> set[str]:
        """The requests the engine still holds (waiting or running)."""
        return set(self.core.scheduler.requests)

    @property
    def steps(self) -> list[StepRecord]:
        """The latest steps' records, oldest first (the last MAX_STEP_RECORDS of them)."""
        return list(self.core.steps)

    # ---- stepping -----------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """One engine step; a delta for each request that produced a token (or ended). A failed step
        fails its requests (ValueError, RuntimeError...); under tensor parallelism it breaks the engine:
        every request is aborted (its blocks freed) and this and every later step raise
        EngineBrokenError."""
        if self.broken:
            raise EngineBrokenError(self.broken)
        try:
            outputs = self.core.step()
        except Exception as e:
            if self.tp is None:
                raise
            self.broken = f"a rank of the tensor-parallel group failed: {e}"
            self._workers.broken = True
            for rid in list(self._tracked):
                self.abort(rid)
            raise EngineBrokenError(self.broken) from e
        return [self._process(o) for o in outputs if o.request_id in self._tracked]

    def _process(self, o: RequestOutput) -> StreamDelta:
        tracked = self._tracked[o.request_id]
        out, detok = tracked.output, tracked.detok
        new_ids, new_lps = o.new_token_ids, o.new_logprobs
        if len(new_ids) > 1 and detok.has_stop_strings:   # accepted drafts: keep none past a stop string
            text = ""
            for i, t in enumerate(new_ids):
                text += detok.add([t])
                if detok.stopped:
                    new_ids, new_lps = new_ids[:i + 1], new_lps[:i + 1]
                    break
        else:
            text = detok.add(new_ids)
        out.token_ids.extend(new_ids)
        out.cached_tokens = o.request.num_cached_tokens or 0
        if out.prompt_logprobs is None and o.request.prompt_logprobs is not None:   # the prompt has run
            out.prompt_logprobs = list(o.request.prompt_logprobs)
        if out.logprobs is not None:
            out.logprobs.extend(new_lps)
        finished, reason = o.finished, o.finish_reason
        if detok.stopped:  # a stop string: end it in the core too
            if not finished:
                self.core.finish(o.request_id, FinishReason.STOP)
            finished, reason = True, FinishReason.STOP
        if finished:
            if detok.stopped:
                out.stop_reason = detok.stop_reason
            else:
                text += detok.finish()
                last = out.token_ids[-1] if out.token_ids else None
                if reason is FinishReason.STOP and last in o.request.sampling_params.stop_token_ids:
                    out.stop_reason = last
            out.finish_reason = reason.value
            del self._tracked[o.request_id]
        out.text += text
        return StreamDelta(request_id=o.request_id, text=text, token_ids=list(new_ids), logprobs=list(new_lps),
                           finished=finished, output=out)

    def run_until_done(self, request_ids: list[str]) -> list[CompletionOutput]:
        """Step until every given request has finished; outputs in the given order."""
        outputs = {rid: self._tracked[rid].output for rid in request_ids}
        while any(o.finish_reason is None for o in outputs.values()):
            self.step()
        return [outputs[rid] for rid in request_ids]

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny request through the whole path, so first-call costs are not timed later."""
        n = 3 if self.config.speculative.enabled else 2     # with speculation: one step verifies a draft
        rid = self.add_request([self.tokenizer.bos_token_id or 0] * 4, SamplingParams(max_tokens=n, ignore_eos=True))
        self.run_until_done([rid])
