"""How a proposer that runs a model (a draft model, an MTP layer) picks each draft token from its logits.

Greedy requests get the argmax. Sampled requests get a draw from q, the proposer's distribution under
the request's own settings (bans, penalties over the output plus the drafts so far, temperature,
filters, its grammar after the drafts so far: the closer q is to p, the more is accepted; any q keeps
verification exact), and q is kept for the rejection rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from phasewise.core.request import SequenceView
from phasewise.kernels.kernel_api import Kernels
from phasewise.sampling.sampler import SamplingMetadata, distribution, exponential_noise
from phasewise.structured import draft_bitmask


@dataclass(frozen=True)
class DraftPicking:
    """What picking needs of the engine: the vocabulary, its end tokens, the device and the kernels (argmax)."""
    vocab_size: int
    eos_token_ids: frozenset[int]
    device: torch.device
    kernels: Kernels | None = None


def pick_drafts(logits: Tensor, reqs: Sequence[SequenceView], drafts: Sequence[list[int]],
                generators: Sequence[torch.Generator | None], how: DraftPicking) -> tuple[list[int], Tensor | None]:
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
