"""ModelRunner: SchedulerOutput → flat tensors → one forward pass → sampled tokens.

With tensor parallelism the runner on rank 0 is the driver: it broadcasts each step's plan
(`StepInputs`, plain lists) and each logits request to the other ranks' runners
(runner/tp_worker.py), which run the same forward on their part of the model; logits arrive
whole on rank 0, which samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from phasewise.distributed import TensorParallel
from phasewise.core.handoffs import RunnerOutput, SampledToken, SchedulerOutput, TokenLogprobs
from phasewise.layers.attention import AttentionMetadata
from phasewise.runner.kv_cache import KVCache
from phasewise.sampling.sampler import SamplingMetadata, sample
from phasewise.sampling.verify import verify
from phasewise.structured import grammar_bitmask
from phasewise.kernels.kernel_api import Kernels


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


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, eos_token_ids: frozenset[int],
                 device: torch.device | str = "cpu", kernels: Kernels | None = None,
                 tp: TensorParallel | None = None) -> None:
        self.model, self.tp = model, tp
        self.kv_cache = kv_cache
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(device)
        self.vocab_size = model.config.vocab_size
        self.kernels = kernels            # the engine's compiled CPU kernels (the sampler's argmax), or None

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """The step (`_run`), with what a mixture of experts' routers chose in it."""
        out = self._run(sched)
        choices = self.model.expert_choices()
        if choices is not None:
            out.expert_choices = choices.tolist()
        return out

    @torch.inference_mode()
    def _run(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables = [], [], []
        sample_rows, sample_reqs = [], []
        spec_rows, spec_chunks = [], []
        scored: list[tuple[str, int, int, list[int], int]] = []   # prompt_logprobs: (id, first row, first pos, targets, top)
        for chunk in sched.chunks:
            req, start, n = chunk.request, chunk.request.num_computed_tokens, chunk.num_scheduled_tokens
            if req.prompt_logprobs is not None and start + 1 < req.num_prompt_tokens:
                # rows of positions p = start.. score prompt token p + 1 (the last prompt token's row samples)
                targets = req.prompt_token_ids[start + 1:min(start + n, req.num_prompt_tokens - 1) + 1]
                scored.append((req.request_id, len(input_ids), start + 1, targets, req.sampling_params.prompt_logprobs))
            input_ids.extend(chunk.input_token_ids)
            positions.extend(range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(req.block_tables)
            if chunk.samples and chunk.draft_token_ids:   # rows: the last own token, then each draft
                end = len(input_ids)
                spec_rows.extend(range(end - len(chunk.draft_token_ids) - 1, end))
                spec_chunks.append(chunk)
            elif chunk.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(req)
        # only the rows that sample or score are computed past the last layer's keys and values;
        # from here on a row is its index among them
        scored_rows = (r for _, first, _, t, _ in scored for r in range(first, first + len(t)))
        wanted = sorted({*sample_rows, *spec_rows, *scored_rows})
        keep = None if len(wanted) == len(input_ids) else wanted
        if keep is not None:
            index = {r: i for i, r in enumerate(keep)}
            sample_rows, spec_rows = [index[r] for r in sample_rows], [index[r] for r in spec_rows]
            scored = [(rid, index[row], first, t, top) for rid, row, first, t, top in scored]
        inputs = StepInputs(input_ids, positions, query_lens, context_lens, [list(t) for t in zip(*tables)], keep)
        if self.tp is not None:
            self.tp.broadcast(("forward", inputs))
        hidden = self.forward(inputs)                                  # [len(wanted), hidden]
        prompt_lps = {rid: (first, self._score(hidden, row, t, top)) for rid, row, first, t, top in scored}
        if not sample_reqs and not spec_chunks:
            return RunnerOutput({}, prompt_logprobs=prompt_lps, threads=torch.get_num_threads())
        logits = self.logits(hidden, sample_rows + spec_rows)        # [B + sum(k + 1), V] fp32
        # grammar masks: the sampling rows that need one up front (see _Recheck), then each draft row's
        # (the position after drafts 0..i-1)
        started = time.perf_counter()
        lazy = [r.grammar is not None and _unfiltered(r.sampling_params, self.vocab_size) for r in sample_reqs]
        masks = grammar_bitmask([(None if z else r.grammar, ()) for r, z in zip(sample_reqs, lazy)]
                                + [(c.request.grammar, c.draft_token_ids) for c in spec_chunks], self.vocab_size)
        grammar_ms = 0.0 if masks is None else (time.perf_counter() - started) * 1e3
        b = len(sample_rows)
        recheck = _Recheck(sample_reqs, lazy, self.vocab_size) if any(lazy) else None
        sampled = self._sample(logits[:b], sample_reqs, None if masks is None else masks[:b], recheck) \
            if sample_reqs else {}
        grammar_ms += recheck.ms if recheck else 0.0
        out = RunnerOutput(sampled, prompt_logprobs=prompt_lps, grammar_ms=grammar_ms, threads=torch.get_num_threads())
        if spec_chunks:
            generators = [self._generator(c.request) for c in spec_chunks]
            verified = verify(logits[b:], spec_chunks, generators, self.vocab_size,
                              self.eos_token_ids, self.device, self.kernels, None if masks is None else masks[b:])
            for rid, (accepted, final) in verified.items():
                out.sampled[rid] = final
                out.accepted[rid] = accepted
        return out

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """One forward pass over the step's tokens → hidden states of its rows inputs.keep [R, hidden]
        (all: [T, hidden]); every rank runs it."""
        meta = AttentionMetadata.build_groups(inputs.query_lens, inputs.context_lens, inputs.tables,
                                              self.kv_cache.block_size, self.device)
        ids = torch.tensor(inputs.input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(inputs.positions, dtype=torch.int64, device=self.device)
        keep = None if inputs.keep is None else torch.tensor(inputs.keep, dtype=torch.int64, device=self.device)
        return self.model(ids, pos, meta, self.kv_cache.layers, keep)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(rows), V] of these rows of the step's (kept) hidden states (the driver asks
        the other ranks for their part of the vocabulary first)."""
        if self.tp is not None:
            self.tp.broadcast(("logits", rows))
        return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)])

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

    def _generator(self, req) -> torch.Generator | None:
        """A seeded request's generator, created on first use and kept on the request."""
        if req.sampler_state is None and req.sampling_params.seed is not None:
            req.sampler_state = torch.Generator(self.device).manual_seed(req.sampling_params.seed)
        return req.sampler_state

    def _sample(self, logits: torch.Tensor, reqs: list, masks=None, recheck=None) -> dict[str, SampledToken]:
        params = [r.sampling_params for r in reqs]
        meta = SamplingMetadata.build(
            params, [r.prompt_token_ids for r in reqs], [r.output_token_ids for r in reqs],
            [self._generator(r) for r in reqs], self.vocab_size, self.eos_token_ids, self.device, self.kernels,
            masks)
        out = sample(logits, meta, recheck)
        token_ids = out.token_ids.tolist()
        result = {}
        if out.logprobs is None:
            for r, t in zip(reqs, token_ids):
                result[r.request_id] = SampledToken(t)
            return result
        chosen = out.logprobs.tolist()
        top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        for i, (r, t) in enumerate(zip(reqs, token_ids)):
            n = r.sampling_params.logprobs
            lp = None if n is None else TokenLogprobs(chosen[i], list(zip(top_ids[i][:n], top_lps[i][:n])))
            result[r.request_id] = SampledToken(t, lp)
        return result


def _unfiltered(params, vocab_size: int) -> bool:
    """The row's distribution has no top-k, top-p or min-p cut (greedy, or temperature alone)."""
    return params.temperature == 0 or (
        (params.top_k <= 0 or params.top_k >= vocab_size) and params.top_p >= 1 and params.min_p <= 0)


class _Recheck:
    """Rows under a grammar whose choice needs no filter (greedy, or temperature alone) are sampled without
    its mask; a token the grammar allows stands, and only the rows whose token it refuses get their mask
    (`sample` then picks from the same draws over the allowed tokens: exact). Most tokens stand, so most
    steps compute few masks (~0.1 ms a row) and many checks (microseconds)."""

    def __init__(self, reqs: list, lazy: list[bool], vocab_size: int) -> None:
        self.reqs, self.lazy, self.vocab_size, self.ms = reqs, lazy, vocab_size, 0.0

    def __call__(self, token_ids: list[int]):
        started = time.perf_counter()
        rows = [i for i, (r, z, t) in enumerate(zip(self.reqs, self.lazy, token_ids))
                if z and not r.grammar.valid_prefix([t])]
        words = grammar_bitmask([(self.reqs[i].grammar, ()) for i in rows], self.vocab_size) if rows else None
        self.ms = (time.perf_counter() - started) * 1e3
        return (rows, words) if rows else None
