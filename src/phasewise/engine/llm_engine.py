"""LLMEngine: the request session over a built engine (tokenize, add, abort, step). Text in, text
deltas out, synchronously. The offline API (`LLM`) and the server both drive it."""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from phasewise.engine.admission import Admission
from phasewise.json_types import JsonValue
from phasewise.config import EngineConfig
from phasewise.core.handoffs import EngineStats, StepRecord
from phasewise.core.prompt_store import Clock
from phasewise.core.request import FinishReason, Request
from phasewise.engine.builder import build_engine
from phasewise.engine.client import ChatPrompt, EngineBrokenError, Prompt, is_chat
from phasewise.engine.kv_transfer import KVTransfer
from phasewise.engine.output_processor import OutputProcessor
from phasewise.engine.step_event import MAX_STEP_EVENTS, StepEvent, ThreadStats
from phasewise.outputs import CompletionOutput, StreamDelta
from phasewise.core.sampling_params import SamplingParams
from phasewise.structured import ThinkingGates
from phasewise.tokenization.tokenizer import Tokenizer


class LLMEngine:
    """The request session over an engine's parts (`builder.build_engine`): add and abort
    requests, step. Detokenization and stop strings are its `outputs` (an `OutputProcessor`), KV
    blocks between engines its `kv_transfer` (a `KVTransfer`). The server holds it as an
    `EngineClient`."""

    def __init__(self, config: EngineConfig | None = None, clock: Clock | None = None) -> None:
        """clock: what the prompt cache's disk tier measures TTLs by (a fake one in tests; wall clock)."""
        parts = build_engine(config or EngineConfig(), clock)
        # what it serves: the config, the model file, and what loading it chose
        self.config = parts.config
        self.model_path = parts.model_path
        self.model_config = parts.model_config
        self.max_model_len = parts.max_model_len
        self.precision = parts.precision
        self.load_ms = parts.load_ms
        # what runs a step: the scheduler core, the model (and a draft model), their KV cache, kernels
        # and kernel threads, and with tensor parallelism the other ranks
        self.core = parts.core
        self.runner = parts.runner
        self.model = parts.model
        self.draft_model = parts.draft_model
        self.kv_cache = parts.kv_cache
        self.kernels = parts.kernels
        self.threads = parts.threads
        self._ranks = parts.ranks
        self.tp = parts.ranks.group if parts.ranks else None
        # text in and out: tokens, grammars, detokenized deltas, thinking blocks
        self.tokenizer = parts.tokenizer
        self.grammars = parts.grammars
        self.outputs = OutputProcessor(self.tokenizer)
        self.thinking = ThinkingGates(self.tokenizer, self.tokenizer.eos_token_ids)
        # the session's own: request ids, KV blocks between engines, admission, a broken group
        self._ids = itertools.count()
        self.kv_transfer = KVTransfer(self.core.kv, self.kv_cache, self.config.kv_role, self.config.kv_peer,
                                      self.tp is not None)
        self.admission = Admission(self.max_model_len, self.model_config.vocab_size,
                                   self.core.kv.pool.num_blocks, self.core.blocks_needed)
        self.broken: str | None = None          # why no step can run any more (EngineBrokenError)
        self._steps: deque[StepEvent] = deque(maxlen=MAX_STEP_EVENTS)   # the latest steps, for observers

    def close(self) -> None:
        """Finish the prompt cache's queued disk writes and stop the other ranks of a tensor-parallel
        engine."""
        self.close_prompt_cache()
        if self._ranks is not None:
            self._ranks.stop()

    def close_prompt_cache(self) -> None:
        """Finish the disk tier's queued writes and stop its thread (no more are written after)."""
        if self.core.disk is not None:
            self.core.disk.close()

    # ---- requests ---------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt | ChatPrompt, chat: bool,
                      tools: Sequence[Mapping[str, JsonValue]] | None = None) -> list[int]:
        """Token ids of a prompt: a ChatPrompt (messages, tools, the template's own variables, how it ends)
        or chat messages (with OpenAI-style tools; an assistant turn opened) through the chat template."""
        if isinstance(prompt, ChatPrompt):
            return self.tokenizer.apply_chat_template(prompt.messages, prompt.add_generation_prompt,
                                                      prompt.tools, prompt.template_kwargs,
                                                      prompt.continue_final)
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=tools)
            return self.tokenizer.encode(prompt)
        if is_chat(prompt):
            return self.tokenizer.apply_chat_template(prompt, tools=tools)
        return list(prompt)

    def encode_marked(self, prompt: ChatPrompt) -> tuple[list[int], tuple[tuple[int, float], ...]]:
        """A chat prompt's token ids and its cache points in tokens (SamplingParams.cache_breakpoints):
        `encode_marked` below."""
        if not prompt.cache_points:
            return self.encode_prompt(prompt, True), ()
        return encode_marked(self.tokenizer, prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    chat: bool = False, request_id: str | None = None,
                    tools: Sequence[Mapping[str, JsonValue]] | None = None) -> str:
        """Queue a prompt (text, token ids, or chat messages, with tools for the template); returns the
        request id. RequestError for a request its admission refuses (`admission.check`: no
        max_tokens → as many as fit), ValueError for a structured_outputs constraint that does not
        compile."""
        arrival = time.perf_counter()
        prompt_ids, marks = self.encode_marked(prompt) if isinstance(prompt, ChatPrompt) else \
            (self.encode_prompt(prompt, chat, tools), ())
        params = self.admission.check(prompt_ids, params or SamplingParams())
        if marks:
            params = replace(params, cache_breakpoints=marks)
        request_id = request_id or f"req-{next(self._ids)}"
        compiled = time.perf_counter()
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        req = Request(request_id, prompt_ids, params, self.tokenizer.eos_token_ids,
                      arrival=arrival, grammar=grammar)
        if grammar is not None:
            req.metrics.grammar_compile_ms = (time.perf_counter() - compiled) * 1e3
        # the block tracked and kept in its budget; the grammar after it
        if params.thinking is not None:
            req.grammar = self.thinking.gate(params.thinking, prompt_ids, grammar, req.metrics)
        self.core.add_request(req)
        self.outputs.add(req, prompt if isinstance(prompt, str) else None)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks are freed at once."""
        self.outputs.abort(request_id)
        return self.core.abort(request_id)

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV blocks used, cached and free, step and speculation counters."""
        return self.core.stats()

    def thread_stats(self) -> ThreadStats:
        """The kernel threads and what other programs took of the CPUs."""
        return self.threads.stats()

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block (of one group, every layer)."""
        return self.kv_cache.bytes_per_block

    @property
    def last_step(self) -> StepEvent | None:
        """The latest step (what it ran, how long it took, what the runner measured), or None before the
        first."""
        return self._steps[-1] if self._steps else None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def request(self, request_id: str) -> Request | None:
        """A live request (its state and metrics), or None once it has ended or if it is unknown."""
        return self.core.scheduler.requests.get(request_id)

    def live_request_ids(self) -> set[str]:
        """The requests the engine still holds (waiting or running)."""
        return set(self.core.scheduler.requests)

    @property
    def steps(self) -> list[StepEvent]:
        """The latest steps, oldest first (the last MAX_STEP_EVENTS of them)."""
        return list(self._steps)

    # ---- stepping -----------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """One engine step; a delta for each request that produced a token (or ended). A failed step
        fails its requests (ValueError, RuntimeError...); under tensor parallelism it breaks the engine:
        every request is aborted (its blocks freed) and this and every later step raise
        EngineBrokenError."""
        if self.broken:
            raise EngineBrokenError(self.broken)
        self.threads.adjust()                   # fewer kernel threads while other programs take CPUs
        ran = self.core.num_steps
        try:
            outputs = self.core.step()
        except Exception as e:
            if self._ranks is None:             # no tensor parallelism
                raise
            self.broken = f"a rank of the tensor-parallel group failed: {e}"
            self._ranks.workers.broken = True
            for rid in self.outputs.request_ids():
                self.abort(rid)
            raise EngineBrokenError(self.broken) from e
        if self.core.num_steps != ran and self.core.last_step is not None:   # a step ran (not an empty one)
            self._record_step(self.core.last_step)
        deltas = []
        for o in outputs:
            if o.request_id in self.outputs:
                deltas.append(delta := self.outputs.process(o))
                if delta.finished and not o.finished:   # a stop string ended it: end it in the core too
                    self.core.finish(o.request_id, FinishReason.STOP)
        return deltas

    def _record_step(self, record: StepRecord) -> None:
        """Keep the step with what the runner measured in it; the one before lets its router choices go
        (layers x experts numbers a step: observers have seen them)."""
        if self._steps and self._steps[-1].extras.expert_choices is not None:
            last = self._steps[-1]
            self._steps[-1] = replace(last, extras=replace(last.extras, expert_choices=None))
        self._steps.append(StepEvent(record, self.runner.last_extras))

    def run_until_done(self, request_ids: list[str]) -> list[CompletionOutput]:
        """Step until every given request has finished; outputs in the given order."""
        outputs = {rid: self.outputs.output(rid) for rid in request_ids}
        while any(o.finish_reason is None for o in outputs.values()):
            self.step()
        return [outputs[rid] for rid in request_ids]

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny request through the whole path, so first-call costs are not timed later."""
        n = 3 if self.config.speculative.enabled else 2     # with speculation: one step verifies a draft
        rid = self.add_request([self.tokenizer.bos_token_id or 0] * 4,
                               SamplingParams(max_tokens=n, ignore_eos=True))
        policy = self.core.spec_policy
        self.core.use_spec_policy(None)     # k drafts, and a first call's costs are not this machine's
        try:
            self.run_until_done([rid])
        finally:
            self.core.use_spec_policy(policy)


def encode_marked(tokenizer: Tokenizer,
                  prompt: ChatPrompt) -> tuple[list[int], tuple[tuple[int, float], ...]]:
    """A chat prompt's token ids (as `apply_chat_template` encodes it) and its cache points in tokens: a point
    covers the prompt's tokens that end within the characters its cut renders alike (the longest common
    prefix of the two texts); a cut the template cannot render (a system prompt alone, for some) marks
    nothing. One tokenization, whatever the number of points."""
    def render(p: ChatPrompt) -> str:
        return tokenizer.render_chat(p.messages, p.add_generation_prompt, p.tools,
                                     p.template_kwargs, p.continue_final)

    text = render(prompt)
    ids, ends = tokenizer.encode_with_ends(text)
    marks: list[tuple[int, float]] = []
    for point in prompt.cache_points:
        try:
            cut = render(point.cut)
        except (ValueError, TypeError):
            continue
        n = bisect.bisect_right(ends, _common_prefix(text, cut))
        if n:
            marks.append((n, point.ttl))
    return ids, tuple(marks)


def _common_prefix(a: str, b: str) -> int:
    """How many leading characters a and b share (a binary search of slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
