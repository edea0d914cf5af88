"""Batched token sampling: bans, penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Every function is pure (returns new tensors, never mutates its inputs) and runs on
whatever device the logits live on. `sample` composes them in vLLM's order:
grammar mask and banned tokens -> penalties -> greedy argmax | temperature -> top-k -> top-p -> min-p
-> exponential-race draw. Logprobs are always taken from the raw model logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from phasewise.kernels.kernel_api import Kernels
from phasewise.sampling.metadata import SamplingMetadata

_NEG_INF = float("-inf")


def unpack_bitmask(bitmask: np.ndarray | Tensor, vocab_size: int, device: torch.device) -> Tensor:
    """[B, W] int32 words (numpy or torch) → [B, vocab_size] bool: bit t % 32 of word t // 32."""
    words = torch.as_tensor(bitmask).to(device)                      # [B, W]
    bits = torch.arange(32, dtype=torch.int32, device=device)
    return ((words[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_grammar(logits: Tensor, words: Tensor | None, kernels: Kernels | None = None) -> Tensor:
    """-inf where the rows' grammars refuse the token; logits [B, V], words [B, ceil(V / 32)] int32. The
    engine's compiled kernels do it in one pass (torch's masked_fill over unpacked bools: ~10x slower)."""
    if words is None:
        return logits
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return kernels.mask_rows(logits.contiguous(), words.contiguous())
    return torch.where(unpack_bitmask(words, logits.shape[-1], logits.device), logits, _NEG_INF)


@dataclass
class SamplerOutput:
    token_ids: Tensor              # [B] int64
    logprobs: Tensor | None        # [B] float32, raw logprob of the chosen token
    top_ids: Tensor | None         # [B, N] int64, N = max_num_logprobs (may be 0 columns)
    top_logprobs: Tensor | None    # [B, N] float32, descending


def apply_penalties(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Repetition (HF/vLLM: prompt or output tokens), then frequency and presence (output only)."""
    counts = meta.output_counts                                      # [B, V]
    if counts is None:                                               # no penalty (build counts with any)
        return logits
    if meta.repetition_penalty is not None:
        seen = counts > 0                                            # [B, V]
        if meta.prompt_mask is not None:
            seen = seen | meta.prompt_mask
        p = meta.repetition_penalty[:, None]                         # [B, 1]
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty[:, None] * counts.to(logits.dtype)
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Divide row b by temperature[b]; greedy rows (0) are left unscaled."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t[:, None].to(logits.dtype)


TOP_P_CANDIDATES = (256, 4096)   # top-p tries each row's best tokens in these tiers, then a full sort


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Set filtered-out logits to -inf. logits [B, V]; top_k [B] (V = off); top_p [B] (1 = off).

    top-k keeps every token tied with the k-th largest logit (as HF and vLLM do). top-p then
    works on the top-k survivors, renormalised: it keeps the smallest prefix of the
    descending order whose mass is >= top_p, ties broken towards the lower token id, and
    always the most likely token.

    A full sort of the vocabulary costs ~2 ms a row on a CPU, so top-p first looks only at
    the 256 best tokens (their mass against the whole row's normaliser); a row whose kept
    prefix ends inside them, clear of ties at the cut, is exact from them alone. Undecided
    rows try the 4,096 best, and only rows still undecided (very flat ones) are sorted in full.
    On the default model's logits (512 prompt positions) the 256 decide 99% of rows at
    temperature 0.7 and top_p 0.9, and 59% at 1.0 and 0.95.
    """
    if top_k is None and top_p is None:
        return logits
    if top_k is not None:
        logits = _top_k_mask(logits, top_k)
    if top_p is None:
        return logits
    out = torch.where((top_p >= 1)[:, None], logits, torch.full_like(logits, _NEG_INF))
    rows = (top_p < 1).nonzero().squeeze(1)                          # the rows top-p filters
    for c in TOP_P_CANDIDATES:
        if rows.numel() == 0 or c >= logits.shape[-1]:
            break
        sub, done = _top_p_from_candidates(logits[rows], top_p[rows], c)
        out[rows[done]] = sub[done]
        rows = rows[~done]
    if rows.numel():
        out[rows] = _top_p_by_sort(logits[rows], top_p[rows])
    return out


def _top_p_from_candidates(logits: Tensor, top_p: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """top-p from each row's c best tokens: (the filtered rows [B, V], which rows that decided [B])."""
    vals, ids = logits.topk(c, dim=-1)                               # [B, c] descending, ties in any order
    by_id = ids.argsort(dim=-1)                                      # ties: lower id first
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    probs = (vals - logits.logsumexp(dim=-1, keepdim=True)).exp()   # [B, c], normalised over the row
    mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    p = top_p[:, None].to(probs.dtype)
    keep = mass_before < p
    last = vals.gather(1, (keep.sum(-1, keepdim=True) - 1).clamp_min(0))   # the last kept value [B, 1]
    done = (mass_before[:, -1:] + probs[:, -1:] >= p) & (last > vals[:, -1:])
    out = torch.full_like(logits, _NEG_INF).scatter_(1, ids, vals.masked_fill(~keep, _NEG_INF))
    return out, done.squeeze(1)


def _top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    """-inf below each row's k-th largest logit (a partial topk, no full sort)."""
    k_max = int(top_k.max())
    values = logits.topk(k_max, dim=-1).values                       # [B, k_max] descending
    kth = values.gather(1, (top_k - 1)[:, None])                     # [B, 1]
    return logits.masked_fill(logits < kth, _NEG_INF)


def _top_p_by_sort(logits: Tensor, top_p: Tensor) -> Tensor:
    """top-p over the whole sorted row (the reference; -inf entries have no mass)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))        # [B, V] mass of higher-ranked tokens
    p = top_p[:, None].to(probs.dtype)
    drop = (mass_before >= p) & (p < 1)  # p < 1: float drift in the cumsum must not cut top_p=1 rows
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor | None) -> Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p). min_p [B]."""
    if min_p is None:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None].to(logits.dtype)  # [B, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def exponential_noise(generators: list[torch.Generator | None], V: int, device: torch.device) -> Tensor:
    """[len(generators), V] draws of Exp(1), as -log(U) with U uniform in [0, 1) (torch's own
    exponential_ takes 5x as long on a CPU: 37 ms for 32 rows of 49k). A row with its own generator
    draws from it, so its draws do not depend on the rest of the batch; the other rows share one
    batched draw from the default generator. Every draw is > 0 (U = 0 gives +inf: that token loses)."""
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return torch.rand(len(generators), V, device=device).log_().neg_()
    noise = torch.empty(len(generators), V, device=device)
    if unseeded:
        noise[unseeded] = torch.rand(len(unseeded), V, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = torch.rand(V, generator=g, device=device)
    return noise.log_().neg_()


def race_scores(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """probs / E, E ~ Exp(1) (`exponential_noise`): each row's argmax is token i with prob probs[i] / sum
    (the exponential race; probs [B, V] need not be normalised)."""
    return probs / exponential_noise(generators, probs.shape[-1], probs.device).to(probs.dtype)


def random_sample(probs: Tensor, generators: list[torch.Generator | None],
                  kernels: Kernels | None = None) -> Tensor:
    """One draw per row of probs [B, V] by the exponential race. Returns [B] int64."""
    return argmax(race_scores(probs, generators), kernels)


def compute_logprobs(raw_logits: Tensor, token_ids: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor]:
    """From raw logits [B, V]: chosen-token logprobs [B], top ids [B, N] and logprobs [B, N], descending."""
    logprobs = raw_logits.float().log_softmax(dim=-1)                # [B, V]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)       # [B]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)           # [B, N]
    return chosen, top_ids, top_logprobs


def argmax(logits: Tensor, kernels: Kernels | None = None) -> Tensor:
    """Each row's argmax [B] (the first on ties). With the engine's compiled CPU kernels, their
    argmax: torch's CPU argmax reads 49k logits in ~85 µs, a millisecond a step at batch 32."""
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and \
            logits.dim() == 2:
        return kernels.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def _distribution(raw: Tensor, meta: SamplingMetadata) -> tuple[Tensor, Tensor, Tensor | None]:
    """(the logits after the grammar, bans and penalties [B, V], their argmax [B], the probabilities
    after temperature and the filters [B, V] or None when every row is greedy)."""
    logits = apply_grammar(raw, meta.grammar_words, meta.kernels)
    logits = logits if meta.banned_mask is None else logits.masked_fill(meta.banned_mask, _NEG_INF)
    logits = apply_penalties(logits, meta)
    greedy_ids = argmax(logits, meta.kernels)                        # [B]
    if meta.all_greedy:  # fast path: no softmax, no sort
        return logits, greedy_ids, None
    filtered = apply_temperature(logits, meta.temperature)
    filtered = apply_top_k_top_p(filtered, meta.top_k, meta.top_p)
    filtered = apply_min_p(filtered, meta.min_p)
    return logits, greedy_ids, filtered.softmax(dim=-1)


def distribution(raw: Tensor, meta: SamplingMetadata) -> tuple[Tensor, Tensor | None]:
    """What `sample` draws from, for raw fp32 logits [B, V]: the greedy choice [B] (argmax after
    bans and penalties) and the probabilities [B, V] after temperature and the filters (None when
    every row is greedy). Speculative verification uses it as the target distribution p."""
    _, greedy_ids, probs = _distribution(raw, meta)
    return greedy_ids, probs


class GrammarCheck(Protocol):
    """What `sample` asks of the grammars of rows it samples before their mask (structured.StepMasks)."""

    def refused(self, token_ids: list[int]) -> tuple[list[int], np.ndarray] | None:
        """The rows whose token their grammar refuses and those rows' masks [len(rows), ceil(V / 32)]
        int32, or None when every token stands."""


def sample(logits: Tensor, meta: SamplingMetadata, check: GrammarCheck | None = None) -> SamplerOutput:
    """Pick one token per row of logits [B, V] (any float dtype) according to meta.

    check: the grammars of the rows sampled without their mask (`check.refused`). The rows whose
    token the grammar refuses take the argmax of the same scores (greedy:
    the logits; sampled: probs / noise, the same draws) over the allowed tokens only. Exact: the race
    restricted to a set A with the same exponential draws is a draw from p restricted to A, and the
    unrestricted winner, when in A, wins it too. For rows without top-k, top-p or min-p (those filter
    the masked distribution, so their rows take the mask up front)."""
    raw = logits.float()
    penalized, greedy_ids, probs = _distribution(raw, meta)
    race = None
    if probs is None:
        token_ids = greedy_ids
    else:
        race = race_scores(probs, meta.generators)
        token_ids = torch.where(meta.temperature == 0, greedy_ids, argmax(race, meta.kernels))
    refused = check.refused(token_ids.tolist()) if check else None
    if refused:
        rows, words = refused
        at = torch.tensor(rows, dtype=torch.int64, device=token_ids.device)
        scores = penalized[at] if race is None else \
            torch.where((meta.temperature[at] == 0)[:, None], penalized[at], race[at])
        allowed = torch.as_tensor(words).to(token_ids.device)
        token_ids = token_ids.clone()
        token_ids[at] = argmax(apply_grammar(scores.contiguous(), allowed, meta.kernels), meta.kernels)
    if meta.max_num_logprobs is None:
        return SamplerOutput(token_ids=token_ids, logprobs=None, top_ids=None, top_logprobs=None)
    chosen, top_ids, top_logprobs = compute_logprobs(raw, token_ids, meta.max_num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)
