"""ModelRunner: SchedulerOutput → one forward pass → sampled tokens, in four stages around one typed
plan of the step's rows (`StepPlan`): propose (speculative decoding's drafts), prepare (flat inputs,
and which rows sample, verify drafts or score the prompt), forward, then sample and verify.

The runner reads only the plain data the scheduler hands it; what it keeps of each request (tokens,
generator, proposer state) lives in its own `RequestStates`, keyed by request id.

With tensor parallelism the runner on rank 0 is the driver: it broadcasts each step's inputs
(`StepInputs`, plain lists) and each logits request to the other ranks' runners
(runner/tp_worker.py), which run the same forward on their part of the model; logits arrive
whole on rank 0, which samples.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch

from phasewise.core.handoffs import RunnerOutput, SampledToken, ScheduledChunk, SchedulerOutput
from phasewise.core.request import TokenLogprobs
from phasewise.distributed import TensorParallel
from phasewise.kernels.kernel_api import Kernels
from phasewise.layers.attention import AttentionMetadata
from phasewise.runner.kv_cache import KVCache
from phasewise.runner.model_api import CausalLM
from phasewise.runner.request_state import RequestState, RequestStates
from phasewise.runner.step_extras import StepExtras
from phasewise.sampling.metadata import SamplingMetadata
from phasewise.sampling.sampler import GrammarCheck, sample
from phasewise.sampling.verify import verify
from phasewise.structured import StepMasks


@dataclass
class StepInputs:
    """What every rank needs to run one step's forward: flat token ids and positions, and per
    sequence its new tokens, its context and its block table of each KV group."""
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[list[int]]]          # [group][sequence] → block ids
    keep: list[int] | None = None          # the rows whose hidden states are wanted, ascending (None: all)
    state_slots: list[int] = field(default_factory=list)   # a hybrid's: each sequence's recurrent-state slot
    # a hybrid's, per sequence: the slots its state is copied to after each of its rows but the last (the
    # states a verify step may roll back to; [] for a sequence without drafts)
    state_snapshots: list[list[int]] = field(default_factory=list)
    # an int8 KV cache's: each sequence's tail slot (core/kv_cache_manager.py)
    tail_slots: list[int] | None = None


# What rank 0 broadcasts to the other ranks after the setup: a step's forward, the logits of some of its rows
# (their part of the vocabulary), or the end (runner/tp_worker.py's `serve_steps` runs them).
RankStep = (tuple[Literal["forward"], StepInputs] | tuple[Literal["logits"], list[int]]
            | tuple[Literal["stop"], None])


@dataclass
class ScoredRows:
    """A chunk's prompt_logprobs: its rows from `row` score the prompt tokens `targets`, the first at
    prompt position `position`, with the `top` most likely tokens each."""
    request_id: str
    row: int
    position: int
    targets: list[int]
    top: int


@dataclass
class StepPlan:
    """One step's rows. Row indices are among the forward's kept rows (`inputs.keep`)."""
    inputs: StepInputs
    sample_rows: list[int] = field(default_factory=list)        # a sampling request's last token
    sample_reqs: list[RequestState] = field(default_factory=list)
    draft_rows: list[int] = field(default_factory=list)         # k + 1 rows per chunk with drafts
    drafted: list[ScheduledChunk] = field(default_factory=list)
    drafted_reqs: list[RequestState] = field(default_factory=list)
    scored: list[ScoredRows] = field(default_factory=list)
    # (request, state slot, snapshots)
    snapshotted: list[tuple[str, int, list[int]]] = field(default_factory=list)


class Proposer(Protocol):
    wants_hidden: bool      # it reads the model's hidden states of committed rows (RequestState.take_hidden)

    def propose(self, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState]) -> None:
        """Fill each chunk's draft_token_ids (at most max_draft_tokens) and, for sampled requests
        whose drafts were drawn from a distribution q, draft_probs (q at each draft); `states` are
        the chunks' requests, its own state in each one's `spec`."""


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, eos_token_ids: frozenset[int],
                 device: torch.device | str = "cpu", kernels: Kernels | None = None,
                 tp: TensorParallel | None = None, snapshot_slots: range = range(0),
                 proposer: Proposer | None = None) -> None:
        """snapshot_slots: a hybrid's state slots for the states of draft rows, k for each running sequence.
        proposer: speculative decoding's, filling the draft room the scheduler reserves."""
        self.model, self.tp, self.proposer = model, tp, proposer
        self.snapshot_slots = snapshot_slots
        self.kv_cache = kv_cache
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(device)
        self.vocab_size = model.config.vocab_size
        self.kernels = kernels            # the engine's compiled CPU kernels (the sampler's argmax), or None
        self.requests = RequestStates(self.device)
        self.last_extras = StepExtras()   # what the latest step measured for observers

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step: propose, prepare, forward (every rank), sample and verify; with what a mixture of
        experts' routers chose in it."""
        self.requests.update(sched.new_requests, sched.finished_ids, sched.chunks)
        started = time.perf_counter()
        self._propose(sched)
        propose_ms = (time.perf_counter() - started) * 1e3 if self.proposer is not None else 0.0
        plan = self.prepare(sched)
        self.kv_cache.copy_states(sched.state_copies)     # a hybrid's state checkpoints, saved then restored
        if self.tp is not None:
            step: RankStep = ("forward", plan.inputs)
            self.tp.broadcast(step)
        hidden = self.forward(plan.inputs)
        out, grammar_ms = self.sample(plan, hidden)
        out.propose_ms = propose_ms
        if self.proposer is not None and self.proposer.wants_hidden:
            self._keep_hidden(sched, hidden, out)
        self._roll_back(plan, out)
        self.requests.commit(out)
        choices = self.model.expert_choices()
        self.last_extras = StepExtras(grammar_ms=grammar_ms, threads=torch.get_num_threads(),
                                      expert_choices=None if choices is None else choices.tolist())
        return out

    def _propose(self, sched: SchedulerOutput) -> None:
        """Let the proposer fill the draft room the scheduler reserved; unused room stays unused. Drafts
        from the first one a request's grammar refuses on would be rejected (the target gives them no
        mass): they are not computed at all."""
        wanted = [c for c in sched.chunks if c.max_draft_tokens]
        if self.proposer is None or not wanted:
            return
        states = [self.requests[c.request_id] for c in wanted]
        self.proposer.propose(wanted, states)
        for c, st in zip(wanted, states):
            if len(c.draft_token_ids) > c.max_draft_tokens:
                raise RuntimeError(f"the proposer gave {len(c.draft_token_ids)} drafts for "
                                   f"{c.request_id}, above the {c.max_draft_tokens} reserved")
            if st.grammar is not None and c.draft_token_ids:
                n = st.grammar.valid_prefix(c.draft_token_ids)
                if n < len(c.draft_token_ids):
                    c.draft_token_ids = c.draft_token_ids[:n]
                    c.draft_probs = None if c.draft_probs is None or n == 0 else c.draft_probs[:n]
        sched.num_draft_tokens = sum(len(c.draft_token_ids) for c in wanted)

    def prepare(self, sched: SchedulerOutput) -> StepPlan:
        """The step's flat inputs and what each row is for; only the rows that sample, verify or score
        are kept past the last layer's keys and values."""
        inputs = StepInputs([], [], [], [], [], tail_slots=[] if self.kv_cache.num_tail_slots else None)
        plan, tables = StepPlan(inputs), []
        for chunk in sched.chunks:
            req, start, n = self.requests[chunk.request_id], chunk.start, chunk.num_scheduled_tokens
            top = req.sampling_params.prompt_logprobs              # None: the prompt is not scored
            if top is not None and start + 1 < chunk.num_prompt_tokens:
                # rows of positions p = start.. score prompt token p + 1 (the last prompt token's row samples)
                targets = req.prompt_token_ids[start + 1:min(start + n, chunk.num_prompt_tokens - 1) + 1]
                plan.scored.append(ScoredRows(req.request_id, len(inputs.input_ids), start + 1, targets, top))
            inputs.input_ids.extend(chunk.input_token_ids)
            inputs.positions.extend(range(start, start + n))
            inputs.query_lens.append(n)
            inputs.context_lens.append(start + n)
            tables.append(chunk.block_tables)
            if inputs.tail_slots is not None:
                assert chunk.tail_slot is not None, "an int8 KV cache's chunk without its tail slot"
                inputs.tail_slots.append(chunk.tail_slot)
            if chunk.state_slot is not None:
                inputs.state_slots.append(chunk.state_slot)
                inputs.state_snapshots.append(self._snapshots(inputs.state_snapshots,
                                                              len(chunk.draft_token_ids)
                                                              if chunk.samples else 0))
                if inputs.state_snapshots[-1]:
                    plan.snapshotted.append((req.request_id, chunk.state_slot, inputs.state_snapshots[-1]))
            end = len(inputs.input_ids)
            if chunk.samples and chunk.draft_token_ids:   # rows: the last own token, then each draft
                plan.draft_rows.extend(range(end - len(chunk.draft_token_ids) - 1, end))
                plan.drafted.append(chunk)
                plan.drafted_reqs.append(req)
            elif chunk.samples:
                plan.sample_rows.append(end - 1)
                plan.sample_reqs.append(req)
        inputs.tables = [list(t) for t in zip(*tables)]
        scored_rows = (r for s in plan.scored for r in range(s.row, s.row + len(s.targets)))
        wanted = sorted({*plan.sample_rows, *plan.draft_rows, *scored_rows})
        keep_all = self.proposer is not None and self.proposer.wants_hidden      # every committed row's
        # from here on a row is its index among the kept
        if len(wanted) < len(inputs.input_ids) and not keep_all:
            inputs.keep, index = wanted, {r: i for i, r in enumerate(wanted)}
            plan.sample_rows = [index[r] for r in plan.sample_rows]
            plan.draft_rows = [index[r] for r in plan.draft_rows]
            for s in plan.scored:
                s.row = index[s.row]
        return plan

    def _keep_hidden(self, sched: SchedulerOutput, hidden: torch.Tensor, out: RunnerOutput) -> None:
        """Each request's hidden states of the rows it committed this step (its own tokens, then its
        accepted drafts), kept for the proposer; hidden: every row of the step."""
        row = 0
        for c in sched.chunks:
            n = c.num_tokens + len(out.accepted.get(c.request_id, ()))
            self.requests[c.request_id].add_hidden(c.start, hidden[row:row + n].clone())
            row += c.num_scheduled_tokens

    def _snapshots(self, taken: list[list[int]], drafts: int) -> list[int]:
        """The next `drafts` snapshot slots after those `taken` by earlier sequences of the step."""
        start = self.snapshot_slots.start + sum(len(t) for t in taken)
        assert start + drafts <= self.snapshot_slots.stop, "more drafts than snapshot slots"
        return list(range(start, start + drafts))

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """One forward pass over the step's tokens → hidden states of its rows inputs.keep [R, hidden]
        (all: [T, hidden]); every rank runs it."""
        meta = AttentionMetadata.build_groups(inputs.query_lens, inputs.context_lens, inputs.tables,
                                              self.kv_cache.block_size, self.device, inputs.tail_slots)
        meta.state_slots = inputs.state_slots
        meta.state_snapshots = inputs.state_snapshots
        ids = torch.tensor(inputs.input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(inputs.positions, dtype=torch.int64, device=self.device)
        keep = None if inputs.keep is None else torch.tensor(inputs.keep,
                                                             dtype=torch.int64, device=self.device)
        return self.model(ids, pos, meta, self.kv_cache.layers, keep)

    def sample(self, plan: StepPlan, hidden: torch.Tensor) -> tuple[RunnerOutput, float]:
        """The plan's prompt logprobs, sampled tokens (under their grammars' masks) and verified drafts,
        and the milliseconds its grammar masks took."""
        prompt_lps = {s.request_id: (s.position, self._score(hidden, s.row, s.targets, s.top))
                      for s in plan.scored}
        if not plan.sample_reqs and not plan.drafted:
            return RunnerOutput({}, prompt_logprobs=prompt_lps), 0.0
        logits = self.logits(hidden, plan.sample_rows + plan.draft_rows)        # [B + sum(k + 1), V] fp32
        drafts = [(r.grammar, c.draft_token_ids) for r, c in zip(plan.drafted_reqs, plan.drafted)]
        masks, b = StepMasks(plan.sample_reqs, drafts, self.vocab_size), len(plan.sample_rows)
        sampled = self._sample(logits[:b], plan.sample_reqs, masks.sampling, masks.check) \
            if plan.sample_reqs else {}
        out = RunnerOutput(sampled, prompt_logprobs=prompt_lps)
        if plan.drafted:
            verified = verify(logits[b:], plan.drafted, plan.drafted_reqs,
                              [r.generator for r in plan.drafted_reqs],
                              self.vocab_size, self.eos_token_ids, self.device, self.kernels, masks.drafts)
            for rid, (accepted, final) in verified.items():
                out.sampled[rid] = final
                out.accepted[rid] = accepted
        return out, masks.ms

    def _roll_back(self, plan: StepPlan, out: RunnerOutput) -> None:
        """A hybrid's states back to where each sequence's accepted drafts end: the snapshot after its
        row of the last accepted draft (all accepted: the state is already there)."""
        copies = []
        for request_id, slot, snapshots in plan.snapshotted:
            accepted = len(out.accepted.get(request_id, ()))
            if accepted < len(snapshots):
                copies.append((snapshots[accepted], slot))
        self.kv_cache.copy_states(copies)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(rows), V] of these rows of the step's (kept) hidden states (the driver asks
        the other ranks for their part of the vocabulary first)."""
        if self.tp is not None:
            step: RankStep = ("logits", rows)
            self.tp.broadcast(step)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)])
        assert logits is not None                     # rank 0 (the driver) gets the whole logits
        return logits

    def _score(self, hidden: torch.Tensor, first: int, targets: list[int], top: int,
               rows: int = 128) -> list[TokenLogprobs]:
        """The logprob of each target token (and the top `top`) at rows first.. of hidden, from the raw
        distribution; `rows` at a time, so a long prompt never holds [T, vocab] logits at once."""
        out: list[TokenLogprobs] = []
        target = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
        for i in range(0, len(targets), rows):
            chunk = list(range(first + i, first + min(i + rows, len(targets))))
            lp = torch.log_softmax(self.logits(hidden, chunk), dim=-1)   # [r, V] fp32
            chosen = lp.gather(1, target[i:i + rows, None]).squeeze(1).tolist()
            if top:
                values, ids = lp.topk(top, dim=-1)
                pairs = [list(zip(a, b)) for a, b in zip(ids.tolist(), values.tolist())]
            else:
                pairs = [[] for _ in chosen]
            out.extend(TokenLogprobs(c, p) for c, p in zip(chosen, pairs))
        return out

    def _sample(self, logits: torch.Tensor, reqs: list[RequestState], masks: np.ndarray | None = None,
                check: GrammarCheck | None = None) -> dict[str, SampledToken]:
        params = [r.sampling_params for r in reqs]
        meta = SamplingMetadata.build(
            params, [r.prompt_token_ids for r in reqs], [r.output_token_ids for r in reqs],
            [r.generator for r in reqs], self.vocab_size, self.eos_token_ids, self.device, self.kernels,
            masks)
        out = sample(logits, meta, check)
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return {r.request_id: SampledToken(t) for r, t in zip(reqs, token_ids)}
        assert out.top_ids is not None and out.top_logprobs is not None      # set with logprobs
        chosen = out.logprobs.tolist()
        top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        result = {}
        for i, (r, t) in enumerate(zip(reqs, token_ids)):
            n = r.sampling_params.logprobs
            lp = None if n is None else TokenLogprobs(chosen[i], list(zip(top_ids[i][:n], top_lps[i][:n])))
            result[r.request_id] = SampledToken(t, lp)
        return result
