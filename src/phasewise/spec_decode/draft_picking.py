"""How a proposer that runs a model (a draft model, an MTP layer) picks each draft token from its logits.

Greedy requests get the argmax. Sampled requests get a draw from q, the proposer's distribution under
the request's own settings (bans, penalties over the output plus the drafts so far, temperature,
filters, its grammar after the drafts so far: the closer q is to p, the more is accepted; any q keeps
verification exact), and q is kept for the rejection rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from phasewise.core.handoffs import ScheduledChunk
from phasewise.core.request import SequenceView
from phasewise.kernels.kernel_api import Kernels
from phasewise.sampling.metadata import SamplingMetadata
from phasewise.sampling.sampler import distribution, exponential_noise
from phasewise.structured import draft_bitmask


@dataclass(frozen=True)
class DraftPicking:
    """What picking needs of the engine: the vocabulary, its end tokens, the device and the kernels
    (argmax)."""
    vocab_size: int
    eos_token_ids: frozenset[int]
    device: torch.device
    kernels: Kernels | None = None


def draft_generator(seed: int | None, salt: int, device: torch.device) -> torch.Generator | None:
    """A seeded request's own generator for a proposer's draws (None unseeded), apart from the target's:
    its seed mixed with the proposer's `salt`."""
    if seed is None:
        return None
    return torch.Generator(device).manual_seed((seed * 0x9E3779B1 + salt) % 2**63)


def pick_drafts(logits: Tensor, reqs: Sequence[SequenceView], drafts: Sequence[list[int]],
                generators: Sequence[torch.Generator | None],
                how: DraftPicking) -> tuple[list[int], Tensor | None]:
    """One draft token per row of logits [B, V] (request i after its drafts[i]): argmax (greedy requests) or
    a draw from q, with each seeded request's own generator; q [B, V], or None when every row is greedy."""
    meta = SamplingMetadata.build(
        [r.sampling_params for r in reqs], [r.prompt_token_ids for r in reqs],
        [r.output_token_ids + d for r, d in zip(reqs, drafts)], list(generators),
        how.vocab_size, how.eos_token_ids, how.device, how.kernels,
        draft_bitmask([(r.grammar, d) for r, d in zip(reqs, drafts)], how.vocab_size))
    greedy, probs = distribution(logits, meta)
    if probs is None:
        return greedy.tolist(), None
    noise = exponential_noise(list(generators), probs.shape[-1], probs.device)
    sampled = (probs / noise).argmax(dim=1)
    return torch.where(meta.temperature == 0, greedy, sampled).tolist(), probs


# step(kept, active, drafts): the next logits [len(active), V] after feeding each active request its newest
# draft (kept: the active requests' rows in the previous logits; drafts: every request's drafts so far).
NextLogits = Callable[[list[int], list[int], list[list[int]]], Tensor]


def chain_drafts(logits: Tensor, chunks: Sequence[ScheduledChunk], reqs: Sequence[SequenceView],
                 generators: Sequence[torch.Generator | None], how: DraftPicking, step: NextLogits) -> None:
    """Draft one token at a time from logits [B, V] (one row a chunk) until each chunk has its
    max_draft_tokens, running `step` for the next position; sets each chunk's drafts and their q [k, V]."""
    drafts: list[list[int]] = [[] for _ in chunks]
    qs: list[list[Tensor]] = [[] for _ in chunks]
    active = list(range(len(chunks)))
    while True:
        picked, probs = pick_drafts(logits, [reqs[i] for i in active], [drafts[i] for i in active],
                                    [generators[i] for i in active], how)
        for n, i in enumerate(active):
            drafts[i].append(picked[n])
            if probs is not None and reqs[i].sampling_params.temperature > 0:
                qs[i].append(probs[n])
        kept = [n for n, i in enumerate(active) if len(drafts[i]) < chunks[i].max_draft_tokens]
        if not kept:
            break
        active = [active[n] for n in kept]
        logits = step(kept, active, drafts)
    for c, d, q in zip(chunks, drafts, qs):
        c.draft_token_ids = d
        c.draft_probs = torch.stack(q) if q else None          # [k, V]
