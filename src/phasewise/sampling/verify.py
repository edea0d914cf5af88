"""Verification of draft tokens: target logits at the k + 1 rows of each chunk → accepted drafts + one token.

The target distribution at draft position i is exactly what `sample` would draw from there: the
grammar's mask after drafts 0..i-1, bans (min_tokens), penalties with the output so far *including
drafts 0..i-1*, temperature, top-k/top-p/min-p. Greedy requests are verified by argmax, sampled ones
by the rejection rule with randomness from the request's own generator when it is seeded (so seeded
requests stay reproducible) and the default one otherwise. Logprobs of the committed tokens come
from the raw logits, as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from torch import Tensor

from phasewise.core.handoffs import SampledToken, ScheduledChunk
from phasewise.core.request import SequenceView, TokenLogprobs
from phasewise.sampling.metadata import SamplingMetadata
from phasewise.sampling.sampler import compute_logprobs, distribution, exponential_noise
from phasewise.sampling.rejection import greedy_verify, rejection_sample
from phasewise.kernels.kernel_api import Kernels

Verified = tuple[list[SampledToken], SampledToken]   # accepted drafts, then the target's own token


def verify(logits: Tensor, chunks: list[ScheduledChunk], seqs: Sequence[SequenceView],
           generators: list[torch.Generator | None], vocab_size: int, eos_token_ids: frozenset[int],
           device: torch.device, kernels: Kernels | None = None,
           grammar_bitmask: np.ndarray | Tensor | None = None) -> dict[str, Verified]:
    """logits [sum(k_c + 1), V]: chunk c's rows are its last own token, then each draft (`seqs`: the
    chunks' requests). grammar_bitmask (None: no grammar) has the same rows: the tokens each row's
    grammar allows after drafts 0..i-1."""
    params, prompts, outputs = [], [], []
    for c, req in zip(chunks, seqs):
        for i in range(len(c.draft_token_ids) + 1):   # row i sees drafts 0..i-1 as output
            params.append(req.sampling_params)
            prompts.append(req.prompt_token_ids)
            outputs.append(req.output_token_ids + c.draft_token_ids[:i])
    meta = SamplingMetadata.build(params, prompts, outputs, [None] * len(params), vocab_size, eos_token_ids,
                                  device, kernels, grammar_bitmask)
    raw = logits.float()
    greedy_ids, probs = distribution(raw, meta)                      # [T], [T, V] or None

    starts, row = [], 0
    for c in chunks:
        starts.append(row)
        row += len(c.draft_token_ids) + 1
    chosen: dict[int, tuple[int, list[int]]] = {}                    # chunk index → (accepted, final token)
    groups: dict[str, list[int]] = {"greedy": [], "point": [], "q": []}
    for j, (c, req) in enumerate(zip(chunks, seqs)):
        kind = "greedy" if req.sampling_params.temperature == 0 else \
            "point" if c.draft_probs is None else "q"
        groups[kind].append(j)
    for kind, idx in groups.items():
        if not idx:
            continue
        ks = [len(chunks[j].draft_token_ids) for j in idx]
        rows = torch.tensor([starts[j] + i for j, k in zip(idx, ks) for i in range(k + 1)],
                            dtype=torch.long, device=device)
        drafts = torch.tensor([t for j in idx for t in chunks[j].draft_token_ids],
                              dtype=torch.long, device=device)
        if kind == "greedy":
            counts, final = greedy_verify(greedy_ids[rows], drafts, ks)
        else:
            assert probs is not None                                 # some row samples: not all greedy
            # a "q" chunk's draft_probs: the draft-model proposer's [k, V] Tensor (core types it
            # without torch)
            q = None if kind == "point" else \
                torch.cat([cast(Tensor, chunks[j].draft_probs) for j in idx]).to(device)
            uniform, noise = _draws([generators[j] for j in idx], ks, vocab_size, device)
            counts, final = rejection_sample(probs[rows], drafts, q, ks, uniform, noise)
        for j, a, t in zip(idx, counts, final.tolist()):
            chosen[j] = (a, chunks[j].draft_token_ids[:a] + [t])
    return {c.request_id: _with_logprobs(req.sampling_params.logprobs,
                                         raw[starts[j]:starts[j] + len(chosen[j][1])],
                                         chosen[j][1])
            for j, (c, req) in enumerate(zip(chunks, seqs))}


def _draws(generators: list[torch.Generator | None], ks: list[int], vocab_size: int,
           device: torch.device) -> tuple[Tensor, Tensor]:
    """Uniforms [N] and exponential noise [R, V]: a seeded request draws its own (k uniforms, then V
    exponentials, every step, whatever is accepted); the others share one draw from the default."""
    uniform = torch.rand(sum(ks), device=device)
    start = 0
    for g, k in zip(generators, ks):
        if g is not None:
            uniform[start:start + k] = torch.rand(k, generator=g, device=device)
        start += k
    return uniform, exponential_noise(generators, vocab_size, device)


def _with_logprobs(n: int | None, raw: Tensor, tokens: list[int]) -> Verified:
    """raw [len(tokens), V]: the rows that produced the committed tokens (with the top `n` logprobs)."""
    if n is None:
        made = [SampledToken(t) for t in tokens]
    else:
        ids = torch.tensor(tokens, dtype=torch.long, device=raw.device)
        lp, top_ids, top_lps = compute_logprobs(raw, ids, n)
        made = [SampledToken(t, TokenLogprobs(c, list(zip(i, v))))
                for t, c, i, v in zip(tokens, lp.tolist(), top_ids.tolist(), top_lps.tolist())]
    return made[:-1], made[-1]
