"""EngineCore: add, abort, step. Drives the scheduler and a runner; knows nothing of torch."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Protocol

from phasewise.core.disk_tier import DiskTier
from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.core.handoffs import EngineStats, RequestOutput, RunnerOutput, SchedulerOutput, StepRecord
from phasewise.core.request import FinishReason, Request
from phasewise.core.scheduler import Scheduler
from phasewise.core.spec_policy import SpecPolicy
from phasewise.config import SchedulerConfig


class Runner(Protocol):
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step: its proposer fills the chunks' draft room first (speculative decoding), with
        `sched.num_draft_tokens` the drafts it made."""


@dataclass
class SpecStats:
    """Speculative decoding since the engine started, over all requests."""
    num_steps: int = 0                 # request-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens committed per verification: accepted drafts + the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0


class EngineCore:
    def __init__(self, runner: Runner, scheduler_config: SchedulerConfig, num_blocks: int,
                 block_size: int, max_model_len: int, enable_prefix_caching: bool = True,
                 num_speculative_tokens: int = 0,
                 kv_windows: tuple[int | None, ...] = (None,), num_state_slots: int = 0,
                 num_state_checkpoints: int = 0, disk: DiskTier | None = None,
                 spec_policy: SpecPolicy | None = None, num_tail_slots: int = 0) -> None:
        """kv_windows: the sliding window of each KV group (None: full attention); one group by default.
        num_state_slots: a hybrid model's recurrent-state slots, one per running request, then its
        num_state_checkpoints slots of checkpoints for prefix hits. disk: the prefix cache's disk tier
        (with prefix caching, no sliding windows). spec_policy: chooses each decode's drafts up to
        num_speculative_tokens from the measured steps (None: always that many); the runner's proposer
        fills the room the scheduler reserves for them. num_tail_slots: an int8 KV cache's, one per
        running request."""
        self.runner = runner
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, kv_windows, num_state_slots,
                                 num_state_checkpoints, num_tail_slots=num_tail_slots)
        self.disk = disk
        if disk is not None:
            if len(kv_windows) != 1 or kv_windows[0] is not None or not self.kv.enable_prefix_caching:
                raise ValueError("the prompt cache's disk tier needs prefix caching (with state checkpoints, "
                                 "for a hybrid) and no sliding windows")
            self.kv.new_cached = []
        k = num_speculative_tokens
        self.spec_policy = spec_policy if k else None
        self.scheduler = Scheduler(scheduler_config, self.kv, k, self.spec_policy)
        self.max_model_len = max_model_len
        self.last_step: StepRecord | None = None     # the latest step's record
        self.num_steps = 0                           # all steps ever run
        self.spec = SpecStats()

    def use_spec_policy(self, policy: SpecPolicy | None) -> None:
        """Choose drafts by `policy` from now on (None: always num_speculative_tokens, nothing measured)."""
        self.spec_policy = self.scheduler.spec_policy = policy if self.scheduler.num_spec_tokens else None

    def add_request(self, request: Request) -> None:
        """Queue an admitted request (engine/admission.py: it fits the context and, at its longest,
        the KV pool, as `blocks_needed` counts)."""
        request.max_model_len = self.max_model_len
        self.scheduler.add(request)

    def blocks_needed(self, num_tokens: int) -> int:
        """The most KV blocks one request of num_tokens holds at once (its context in full-attention
        groups, a window and a chunk in windowed ones)."""
        return self.kv.max_blocks(num_tokens, self.scheduler.config.max_num_batched_tokens)

    def abort(self, request_id: str) -> bool:
        """Stop a request at any point and free everything it holds; False if it is not live."""
        return self.scheduler.finish(request_id, FinishReason.ABORT) is not None

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """End a request for a reason found outside the core (a stop string)."""
        return self.scheduler.finish(request_id, reason) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """A snapshot of what runs and waits, the KV pool and the counters."""
        sched, pool, spec = self.scheduler, self.kv.pool, self.spec
        checkpoints = len(self.kv.checkpoints.entries) if self.kv.checkpoints else 0
        return EngineStats(num_waiting=len(sched.waiting), num_running=len(sched.running),
                           num_blocks=pool.num_blocks, num_free_blocks=pool.num_free,
                           num_cached_blocks=pool.num_cached, kv_usage=pool.usage,
                           num_state_slots=self.kv.num_state_slots,
                           num_free_state_slots=len(self.kv.free_state_slots),
                           num_state_checkpoints=checkpoints, num_steps=self.num_steps,
                           spec_num_drafts=spec.num_steps,
                           spec_num_draft_tokens=spec.num_draft_tokens,
                           spec_num_accepted_tokens=spec.num_accepted_tokens,
                           ram=dataclasses.replace(pool.stats),
                           disk=self.disk.stats if self.disk is not None else None)

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, update: the outputs of this step."""
        started = time.perf_counter()
        if self.disk is not None:      # what the next admissions would miss in RAM, from disk
            free = self.scheduler.config.max_num_seqs - len(self.scheduler.running)
            self.disk.prefetch(self.kv, itertools.islice(self.scheduler.waiting, max(free, 0)))
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("no request can be scheduled although some are waiting "
                                   "(KV pool too small)")
            return []
        try:
            scheduled = time.perf_counter()
            result = self.runner.execute(sched)
        except Exception:
            for chunk in sched.chunks:   # a failed step fails its requests: nothing stays held
                self.scheduler.finish(chunk.request_id, FinishReason.ERROR)
            raise
        executed = time.perf_counter()
        # before update: the chunks' requests are as they were scheduled
        if self.spec_policy is not None:
            self.spec_policy.observe(sched, self.scheduler.requests,
                                     {r: len(a) for r, a in result.accepted.items()},
                                     (executed - scheduled) * 1e3 - result.propose_ms, result.propose_ms)
        outputs = self.scheduler.update(sched, result, started)
        # the blocks this step filled, copied out before any forward reuses them
        if self.disk is not None:
            self.disk.save(self.kv)
        accepted = sum(len(a) for a in result.accepted.values())
        if sched.num_draft_tokens:
            self.spec.num_steps += sum(1 for c in sched.chunks if c.draft_token_ids)
            self.spec.num_draft_tokens += sched.num_draft_tokens
            self.spec.num_accepted_tokens += accepted
        self.num_steps += 1
        self.last_step = StepRecord(start=started, duration_ms=(time.perf_counter() - started) * 1e3,
                                    num_prefill_tokens=sched.num_prefill_tokens,
                                    num_decode_tokens=sched.num_decode_tokens, batch_size=len(sched.chunks),
                                    num_draft_tokens=sched.num_draft_tokens, num_accepted_tokens=accepted)
        return outputs
