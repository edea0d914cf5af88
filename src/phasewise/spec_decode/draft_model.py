"""Draft-model proposer: a cheaper model with the target's tokenizer proposes k tokens per request.

Its KV cache has the target's block layout: a request's draft K/V live at the same
block ids (and slots) as its target K/V, in a second tensor. Each proposal first
catches the draft up on the request's committed tokens it has not seen (the whole
prompt the first time, then the one or two tokens of the last step), then runs k - 1
one-token steps. The state kept per request is how many committed tokens the draft
holds and which draft tokens it fed after them; at the next proposal, only the fed
drafts that were accepted count (rollback = a shorter count; their slots are simply
overwritten). A preempted request lost its blocks, so its draft starts over. Draft
writes stay inside the slots the scheduler reserved for the chunk and its drafts, and
only touch the draft's own cache: whatever the draft computes, the target's outputs
are decided by verification alone.

A hybrid draft's recurrent state cannot be cut back like its K/V: its slot (the request's state
slot) holds the state after the committed tokens only. The drafts run on a second slot (slot +
state_slots), a copy made after the catch-up, so the next proposal catches up from the committed
tokens, re-feeding the drafts that were accepted with the tokens after them.

Draft tokens are picked as spec_decode/draft_picking.py says (argmax, or a draw from q kept for the
rejection rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from phasewise.core.handoffs import ScheduledChunk
from phasewise.layers.attention import AttentionMetadata
from phasewise.runner.kv_cache import KVCache
from phasewise.runner.model_api import CausalLM
from phasewise.runner.request_state import RequestState
from phasewise.spec_decode.draft_picking import DraftPicking, chain_drafts, draft_generator
from phasewise.kernels.kernel_api import Kernels


@dataclass
class DraftState:
    num_committed: int = 0           # committed tokens whose draft K/V are in the cache
    fed: list[int] = field(default_factory=list)   # draft tokens fed after them (positions num_committed..)
    preemptions: int = 0             # the request's preemptions when this was true
    generator: torch.Generator | None = None       # a seeded request's draft draws

    def valid(self, token_ids: list[int]) -> int:
        """Leading tokens of the request whose draft K/V are right: the committed ones, plus the
        fed drafts that turned out to be accepted."""
        n = self.num_committed
        for t in self.fed:
            if n < len(token_ids) and token_ids[n] == t:
                n += 1
            else:
                break
        return n


class DraftModelProposer:
    wants_hidden = False

    def __init__(self, model: CausalLM, kv_cache: KVCache, eos_token_ids: frozenset[int] = frozenset(),
                 device: torch.device | str = "cpu", kernels: Kernels | None = None,
                 state_slots: int = 0) -> None:
        """state_slots: a hybrid draft's, the target's sequences at once (its cache holds twice as many)."""
        self.model, self.kv_cache, self.eos_token_ids = model, kv_cache, eos_token_ids
        self.state_slots = state_slots
        self.device = torch.device(device)
        self.picking = DraftPicking(model.config.vocab_size, eos_token_ids, self.device, kernels)

    @torch.inference_mode()
    def propose(self, chunks: Sequence[ScheduledChunk], reqs: Sequence[RequestState]) -> None:
        states = [self._state(c, r) for c, r in zip(chunks, reqs)]
        # Catch up: feed committed tokens from the first one the draft lacks (at least the last one).
        starts = [self._start(st, r) for st, r in zip(states, reqs)]
        tables = [c.block_tables[0] for c in chunks]
        slots = [self._slot(c) for c in chunks] if self.state_slots else None
        logits = self._forward([r.token_ids[s:] for s, r in zip(starts, reqs)], starts, tables, slots)
        for st, r in zip(states, reqs):
            st.num_committed, st.fed = r.num_tokens, []
        if slots is not None:                 # the drafts run on a copy of the committed tokens' state
            self.kv_cache.copy_states([(s, s + self.state_slots) for s in slots])
            slots = [s + self.state_slots for s in slots]

        def step(kept: list[int], active: list[int], drafts: list[list[int]]) -> Tensor:
            for i in active:                  # each its newest draft, at the position after the previous one
                states[i].fed.append(drafts[i][-1])
            pos = [reqs[i].num_tokens + len(drafts[i]) - 1 for i in active]
            return self._forward([[drafts[i][-1]] for i in active], pos, [tables[i] for i in active],
                                 None if slots is None else [slots[i] for i in active])
        chain_drafts(logits, chunks, reqs, [st.generator for st in states], self.picking, step)

    def _state(self, chunk: ScheduledChunk, req: RequestState) -> DraftState:
        st = req.spec
        # new, or its blocks were lost
        if not isinstance(st, DraftState) or st.preemptions != chunk.preemptions:
            gen = draft_generator(req.sampling_params.seed, 0x5EC, self.device)
            st = req.spec = DraftState(preemptions=chunk.preemptions, generator=gen)
        return st

    @staticmethod
    def _slot(chunk: ScheduledChunk) -> int:
        assert chunk.state_slot is not None, \
            "a hybrid draft runs beside a hybrid target (the request's state slot)"
        return chunk.state_slot

    def _start(self, st: DraftState, req: RequestState) -> int:
        """Where the catch-up starts: the first token whose draft K/V are not right, at most the last
        (a hybrid draft: the first not in its state, or the start where the state is ahead of that)."""
        if not self.state_slots:
            return min(st.valid(req.token_ids), req.num_tokens - 1)
        return st.num_committed if st.num_committed < req.num_tokens else 0

    def _forward(self, token_lists: list[list[int]], starts: list[int], tables: list[list[int]],
                 state_slots: list[int] | None = None) -> Tensor:
        """Run the draft on each request's tokens placed at starts[i].. (its blocks `tables[i]`, a hybrid's
        states in state_slots); logits at each last row [B, V]."""
        ids = [t for ts in token_lists for t in ts]
        positions = [p for ts, s in zip(token_lists, starts) for p in range(s, s + len(ts))]
        lens = [len(ts) for ts in token_lists]
        meta = AttentionMetadata.build(lens, [s + n for s, n in zip(starts, lens)], tables,
                                       self.kv_cache.block_size, self.device)
        meta.state_slots = state_slots
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device),
                            torch.tensor(positions, dtype=torch.long, device=self.device),
                            meta, self.kv_cache.layers, last)                   # [B, hidden]
        logits = self.model.compute_logits(hidden)
        assert logits is not None                      # a draft model runs whole (no tensor parallelism)
        return logits.float()                                                  # [B, V]
