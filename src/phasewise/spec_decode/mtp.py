"""MTP proposer: the model's own multi-token-prediction layer (models/mtp.py) drafts k tokens per request.

At position p the layer reads the model's hidden state h[p] and token p + 1. Each proposal first catches
the layer up on the request's committed rows it has not seen, with the hidden states the runner kept
of them (`RequestState.take_hidden`: every committed row's, a verify step's accepted drafts included):
positions from where it stopped to T - 2 (T: the request's tokens; row T - 2 made token T - 1). Its
last row gives the first draft (position T); then k - 1 steps each feed the layer its own output and
the newest draft, one position on. The layer's K/V live in its own cache at the same block ids as the
model's (one attention layer; the scheduler reserved the slots); the chained steps' K/V (positions
from T - 1) are overwritten by the next catch-up, which writes them from the model's own states.

A request admitted on a prefix-cache hit, or recomputed after preemption, has no hidden states of the
rows it did not compute: the layer attends over what its cache holds there (an earlier request's K/V
of the same blocks, or nothing useful). That can cost acceptance, never output: verification decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from phasewise.core.handoffs import ScheduledChunk
from phasewise.kernels.kernel_api import Kernels
from phasewise.layers.attention import AttentionMetadata
from phasewise.runner.kv_cache import KVCache
from phasewise.runner.request_state import RequestState
from phasewise.spec_decode.draft_picking import DraftPicking, chain_drafts, draft_generator

if TYPE_CHECKING:
    from phasewise.models.qwen3_5 import Qwen3_5ForCausalLM


@dataclass
class MTPState:
    done: int = 0                    # positions whose K/V in the layer's cache come from the model's states
    # the request's preemptions when this was true (its blocks went with them)
    preemptions: int = 0
    generator: torch.Generator | None = None       # a seeded request's draft draws


class MTPProposer:
    wants_hidden = True

    def __init__(self, model: Qwen3_5ForCausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 eos_token_ids: frozenset[int] = frozenset(), device: torch.device | str = "cpu",
                 kernels: Kernels | None = None, num_tail_slots: int = 16) -> None:
        """model: the target, loaded with its MTP layer, whose KV cache has num_blocks of block_size (an int8
        one num_tail_slots tail slots: the requests' own, ScheduledChunk.tail_slot)."""
        if model.mtp is None:
            raise ValueError("the model was loaded without its MTP layer")
        self.model, self.mtp = model, model.mtp
        self.kv_cache = KVCache(model.mtp.config, num_blocks, block_size, kv_dtype, device,
                                num_tail_slots=num_tail_slots)
        self.device = torch.device(device)
        self.picking = DraftPicking(model.config.vocab_size, eos_token_ids, self.device, kernels)

    @torch.inference_mode()
    def propose(self, chunks: Sequence[ScheduledChunk], reqs: Sequence[RequestState]) -> None:
        states = [self._state(c, r) for c, r in zip(chunks, reqs)]
        rows = [self._catch_up(st, r) for st, r in zip(states, reqs)]
        tables = [c.block_tables[0] for c in chunks]
        tails = [c.tail_slot or 0 for c in chunks]
        out = self._forward([r.token_ids[first + 1:] for (first, _), r in zip(rows, reqs)],
                            torch.cat([h for _, h in rows]), [first for first, _ in rows],
                            tables, tails)   # [B, H]
        for st, r in zip(states, reqs):
            st.done = r.num_tokens - 1

        def step(kept: list[int], active: list[int], drafts: list[list[int]]) -> Tensor:
            # the layer's own output and the newest draft, one position on (draft d's row at T - 2 + d)
            nonlocal out
            starts = [reqs[i].num_tokens - 2 + len(drafts[i]) for i in active]
            out = self._forward([[drafts[i][-1]] for i in active], out[kept], starts,
                                [tables[i] for i in active], [tails[i] for i in active])
            return self._logits(out)
        chain_drafts(self._logits(out), chunks, reqs, [st.generator for st in states], self.picking, step)

    def _logits(self, hidden: Tensor) -> Tensor:
        logits = self.model.compute_logits(hidden)
        assert logits is not None                    # no tensor parallelism with MTP
        return logits

    def _state(self, chunk: ScheduledChunk, req: RequestState) -> MTPState:
        st = req.spec
        # new, or its blocks were lost
        if not isinstance(st, MTPState) or st.preemptions != chunk.preemptions:
            gen = draft_generator(req.sampling_params.seed, 0x3A7, self.device)
            st = req.spec = MTPState(preemptions=chunk.preemptions, generator=gen)
        return st

    @staticmethod
    def _catch_up(st: MTPState, req: RequestState) -> tuple[int, Tensor]:
        """(the first position, the hidden states [n, H]) of the rows to feed: the kept ones from where the
        layer stopped (or from the first kept) to T - 2, the row that made the newest token."""
        start, hidden = req.take_hidden()
        last = req.num_tokens - 2
        if hidden is None or start + len(hidden) <= last:      # the runner keeps every committed row
            raise RuntimeError(f"{req.request_id}: no hidden state of position {last} for the MTP layer")
        first = max(start, min(st.done, last))
        return first, hidden[first - start:last - start + 1]

    def _forward(self, tokens: list[list[int]], hidden: Tensor, starts: list[int], tables: list[list[int]],
                 tails: list[int] | None = None) -> Tensor:
        """The layer over each request's rows at positions starts[i].. (tokens[i]: the tokens after them,
        hidden: their hidden states, all requests' rows [R, H]; tails: an int8 cache's tail slots, default
        0, 1, ...) → each request's last output [B, H]."""
        lens = [len(t) for t in tokens]
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=self.device)
        positions = torch.tensor([p for s, n in zip(starts, lens) for p in range(s, s + n)], dtype=torch.long,
                                 device=self.device)
        meta = AttentionMetadata.build(lens, [s + n for s, n in zip(starts, lens)], tables,
                                       self.kv_cache.block_size, self.device, tails)
        embeds = self.model.model.embed_tokens(ids)
        out = self.mtp(embeds.to(hidden.dtype), hidden, positions, meta, self.kv_cache.layers[0])
        return out[torch.tensor(lens, device=self.device).cumsum(0) - 1]
