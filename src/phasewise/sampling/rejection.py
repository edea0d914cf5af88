"""The acceptance rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023), as pure functions.

Given k draft tokens x_1..x_k drawn from q, and the target's p at each of the k + 1
positions: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order; at the
first rejection draw from normalize(max(0, p_i - q_i)); when all k are accepted, draw a
bonus token from p_{k+1}. The committed tokens are then distributed exactly as if they
had been sampled from p one at a time. A deterministic proposer (n-gram lookup) is q = a
point mass on x_i: accept with probability p_i(x_i), else draw from p_i without x_i.
Greedy verification accepts while x_i is the target's argmax, then takes the argmax.

Layout for R requests with k_r >= 1 drafts each (N = sum k_r): the target rows are
request-major, k_r + 1 rows per request (one per draft, then the bonus position); the
draft rows are k_r per request. Randomness comes in as arguments (uniforms, exponential
noise), so the functions are deterministic and the caller owns the generators.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _offsets(num_drafts: list[int]) -> tuple[list[int], list[int]]:
    """First target row and first draft row of each request."""
    t_off, d_off, t, d = [], [], 0, 0
    for k in num_drafts:
        t_off.append(t)
        d_off.append(d)
        t += k + 1
        d += k
    return t_off, d_off


def _draft_target_rows(num_drafts: list[int], device: torch.device) -> Tensor:
    """[N] the target row of each draft row (request r's draft j sits at t_off[r] + j)."""
    t_off, _ = _offsets(num_drafts)
    return torch.tensor([o + j for o, k in zip(t_off, num_drafts) for j in range(k)], dtype=torch.long,
                        device=device)


def _leading(accept: list[bool], num_drafts: list[int]) -> list[int]:
    """Per request: how many drafts are accepted before the first rejection."""
    counts, d = [], 0
    for k in num_drafts:
        a = 0
        while a < k and accept[d + a]:
            a += 1
        counts.append(a)
        d += k
    return counts


def greedy_verify(target_argmax: Tensor, draft_ids: Tensor,
                  num_drafts: list[int]) -> tuple[list[int], Tensor]:
    """target_argmax [N + R] (the target's greedy choice per row), draft_ids [N] → (accepted counts,
    final token [R]): the argmax at the first mismatch, or at the bonus position."""
    rows = _draft_target_rows(num_drafts, draft_ids.device)
    accept = (target_argmax[rows] == draft_ids).tolist()
    counts = _leading(accept, num_drafts)
    t_off, _ = _offsets(num_drafts)
    final_rows = torch.tensor([o + a for o, a in zip(t_off, counts)], dtype=torch.long,
                              device=draft_ids.device)
    return counts, target_argmax[final_rows]


def rejection_sample(target_probs: Tensor, draft_ids: Tensor, draft_probs: Tensor | None,
                     num_drafts: list[int], uniform: Tensor, noise: Tensor) -> tuple[list[int], Tensor]:
    """The rejection rule for a batch of requests.

    target_probs [N + R, V] (p per row, rows summing to 1); draft_ids [N] int64;
    draft_probs [N, V] (q per draft row, the distribution each draft was drawn from) or
    None (every draft a point mass); uniform [N] in [0, 1); noise [R, V] ~ Exp(1).
    Returns (accepted counts per request, final token per request [R]).
    """
    device = draft_ids.device
    rows = _draft_target_rows(num_drafts, device)
    p_x = target_probs[rows].gather(1, draft_ids[:, None]).squeeze(1)              # [N]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(1, draft_ids[:, None]).squeeze(1)                   # [N]
    accept = (uniform * q_x < p_x).tolist()     # u < p/q without dividing; q = 0 cannot be drawn
    counts = _leading(accept, num_drafts)
    t_off, d_off = _offsets(num_drafts)
    final_rows = torch.tensor([o + a for o, a in zip(t_off, counts)], dtype=torch.long, device=device)
    dist = target_probs[final_rows].clone()                                          # [R, V]
    rejected = [r for r, (a, k) in enumerate(zip(counts, num_drafts)) if a < k]
    if rejected:
        rej = torch.tensor(rejected, dtype=torch.long, device=device)
        d_rows = torch.tensor([d_off[r] + counts[r] for r in rejected], dtype=torch.long, device=device)
        if draft_probs is None:                  # max(0, p - onehot(x)) = p without x
            dist[rej, draft_ids[d_rows]] = 0.0
        else:
            dist[rej] = (dist[rej] - draft_probs[d_rows]).clamp_min(0.0)
        empty = dist[rej].sum(dim=1) <= 0       # p == q up to rounding: then rejection never happens
        if bool(empty.any()):
            dist[rej[empty]] = target_probs[final_rows[rej[empty]]]
    final = (dist / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=1)   # exponential race
    return counts, final
