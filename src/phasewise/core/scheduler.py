"""Decode-first scheduling under one token budget, with chunked prefill and preemption.

Each request's computed-token count catches up with its token count; there are
no separate prefill and decode phases. Every step: running requests first (a
decode needs one token, an unfinished prefill takes what the budget allows),
then waiting requests in arrival order. When a running request needs a block
and none is free, the newest running request is preempted: its blocks are
freed and it is recomputed later from its prompt and output so far.

Speculative decoding (num_spec_tokens > 0): a decoding request's chunk also
reserves budget and KV slots for up to k draft tokens (k chosen per decode by a
SpecPolicy when there is one, core/spec_policy.py), which a proposer fills
before the forward pass. Accepted drafts advance the request like sampled tokens;
rejected ones do not advance `num_computed_tokens`, so the prefix cache only ever
hashes committed tokens. Drafts are dropped before anyone is preempted for them.
"""

from __future__ import annotations

import time
from collections import deque

from phasewise.config import SchedulerConfig
from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.core.handoffs import NewRequest, RequestOutput, RunnerOutput, ScheduledChunk, SchedulerOutput
from phasewise.core.request import FinishReason, Request, RequestStatus
from phasewise.core.spec_policy import SpecPolicy


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, num_spec_tokens: int = 0,
                 spec_policy: SpecPolicy | None = None) -> None:
        self.config = config
        self.kv = kv
        self.num_spec_tokens = num_spec_tokens     # draft tokens a decode may carry (0: no speculation)
        self.spec_policy = spec_policy             # chooses each decode's k up to that (None: always that)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.runner_knows: set[str] = set()       # requests whose NewRequest the runner has had
        self.finished_ids: list[str] = []         # of those, ended since the last step was scheduled

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        now = time.perf_counter()
        i, preempted = 0, False
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._to_boundary(req, req.num_computed_tokens,
                                  min(req.num_tokens - req.num_computed_tokens, budget))
            drafts = self._draft_room(req, n, budget)
            while not self.kv.allocate_slots(req, n + drafts):
                if drafts:                      # drop the drafts before preempting anyone for them
                    drafts = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: nothing after it remains either
            chunks.append(ScheduledChunk.of(req, n, drafts))
            budget -= n + drafts
            i += 1
        # Then waiting requests, in arrival order, after their prefix-cache hits; no admissions
        # in a step that had to preempt (the pool is already short).
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not preempted:
            req = self.waiting[0]
            # no logits in a hit
            hits = self.kv.get_computed_blocks(req) if req.prompt_logprobs is None else []
            cached = len(hits[0]) * self.kv.block_size if hits else 0
            n = self._to_boundary(req, cached, min(req.num_tokens - cached, budget))
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.num_computed_tokens = cached
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = now
                req.num_cached_tokens = cached
            req.status = RequestStatus.RUNNING
            chunks.append(ScheduledChunk.of(req, n))
            budget -= n
        return self._hand_off(chunks)

    def _hand_off(self, chunks: list[ScheduledChunk]) -> SchedulerOutput:
        """The step's chunks as the runner takes them: with the requests it has not seen, those ended
        since, the token counts and a hybrid's state copies (they go with the next step that runs: no
        forward writes a slot before it)."""
        out = SchedulerOutput(chunks, state_copies=self.kv.take_state_copies() if chunks else [])
        if chunks:
            out.new_requests = [NewRequest.of(self.requests[c.request_id]) for c in chunks
                                if c.request_id not in self.runner_knows]
            self.runner_knows.update(r.request_id for r in out.new_requests)
            out.finished_ids, self.finished_ids = self.finished_ids, []
        for c in chunks:
            if c.is_decode:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += c.num_tokens
        return out

    def _to_boundary(self, req: Request, start: int, n: int) -> int:
        """A chunk of n tokens from `start`, cut at the block boundary where a hybrid checkpoints its
        prompt's state (KVCacheManager.prompt_boundary), if the chunk crosses it."""
        boundary = self.kv.prompt_boundary(req)
        return boundary - start if boundary is not None and start < boundary < start + n else n

    def _draft_room(self, req: Request, n: int, budget: int) -> int:
        """How many draft tokens may follow a one-token decode: k, within the budget, max_tokens
        and the context (a step commits at most drafts + 1 tokens)."""
        if not self.num_spec_tokens or n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return 0
        k = self.spec_policy.choose(req) if self.spec_policy is not None else self.num_spec_tokens
        room = min(k, budget - 1)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(req.output_token_ids) - 1)
        if req.max_model_len is not None:
            room = min(room, req.max_model_len - req.num_tokens - 1)
        return max(room, 0)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.preempted_at.append(time.perf_counter())
        self.waiting.appendleft(req)

    def update(self, sched: SchedulerOutput, result: RunnerOutput, started: float) -> list[RequestOutput]:
        """Advance computed counts, append sampled (and accepted draft) tokens, finish what is done
        (the step began at `started`). Several tokens committed in one step share its timestamp."""
        now = time.perf_counter()
        outputs = []
        for chunk in sched.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None:  # aborted while the step ran
                continue
            if not chunk.is_decode:
                req.metrics.prefill_chunks.append((started, now, chunk.num_tokens))
            scored = result.prompt_logprobs.get(req.request_id)
            if scored is not None and req.prompt_logprobs is not None:   # (first position, this chunk's)
                first, lps = scored
                req.prompt_logprobs[first:first + len(lps)] = lps
            sampled = result.sampled.get(req.request_id)
            if sampled is not None and req.sampling_params.max_tokens == 0:   # only the prompt was asked for
                req.num_computed_tokens += chunk.num_tokens
                self.kv.commit(req)
                self.finish(req.request_id, FinishReason.LENGTH)
                outputs.append(RequestOutput(request_id=req.request_id, new_token_ids=[], new_logprobs=[],
                                             finished=True, finish_reason=req.finish_reason, request=req))
                continue
            if sampled is None:
                req.num_computed_tokens += chunk.num_tokens
                self.kv.commit(req)
                continue
            accepted = result.accepted.get(req.request_id, [])
            if chunk.draft_token_ids:
                m = req.metrics
                m.spec_steps += 1
                m.spec_draft_tokens += len(chunk.draft_token_ids)
                m.spec_accepted_tokens += len(accepted)
            # The chunk's own tokens and the accepted drafts now have KV; rejected drafts do not count.
            req.num_computed_tokens += chunk.num_tokens + len(accepted)
            new, reason = [], None
            for tok in (*accepted, sampled):
                req.append_output(tok.token_id, tok.logprobs)
                new.append(tok)
                if req.metrics.first_token is None:
                    req.metrics.first_token = now
                req.metrics.token_times.append(now)
                reason = req.check_finish()
                if reason is not None:     # the rest of the accepted tokens are dropped
                    break
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            self.kv.commit(req)  # hashes only tokens that are in the request
            if reason is not None:
                self.finish(req.request_id, reason)
            outputs.append(RequestOutput(request_id=req.request_id, new_token_ids=[t.token_id for t in new],
                                         new_logprobs=[t.logprobs for t in new if t.logprobs],
                                         finished=req.is_finished,
                                         finish_reason=req.finish_reason, request=req))
        return outputs

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (done, aborted, errored): free its blocks at once. None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if request_id in self.runner_knows:       # the runner lets its state go with the next step
            self.runner_knows.discard(request_id)
            self.finished_ids.append(request_id)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finished = time.perf_counter()
        return req
