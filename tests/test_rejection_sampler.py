"""The rejection rule: exact cases, verification glue, and a chi-square test that the committed tokens
follow the target distribution (and that plausible wrong rules do not)."""

from __future__ import annotations

import math

import pytest
import torch

from phasewise.core.handoffs import ScheduledChunk
from phasewise.core.request import Request
from phasewise.core.sampling_params import SamplingParams
from phasewise.sampling.rejection import greedy_verify, rejection_sample
from phasewise.sampling.verify import verify

V = 8


def test_greedy_verify_accepts_up_to_the_first_mismatch():
    argmax = torch.tensor([5, 6, 7, 1,   2, 3])          # request 0: 3 drafts (+ bonus row); request 1: 1 draft
    drafts = torch.tensor([5, 6, 0,   2])
    counts, final = greedy_verify(argmax, drafts, [3, 1])
    assert counts == [2, 1] and final.tolist() == [7, 3]  # mismatch at draft 2 → argmax 7; all accepted → bonus 3


def test_rejection_sample_exact_cases():
    p = torch.zeros(4, V)
    p[0, 0] = p[0, 1] = 0.5                               # request 0, draft row
    p[1, 2] = 1.0                                         # request 0, bonus row
    p[2, 3] = 1.0                                         # request 1, draft row (p(x) = 1: always accepted)
    p[3, 4] = 1.0                                         # request 1, bonus row
    q = torch.zeros(2, V)
    q[0, 0] = 1.0
    q[1, 3] = 1.0
    drafts = torch.tensor([0, 3])
    noise = torch.ones(2, V)
    counts, final = rejection_sample(p, drafts, q, [1, 1], torch.tensor([0.9, 0.99]), noise)
    assert counts == [0, 1] and final.tolist() == [1, 4]  # residual max(0, p - q) leaves only token 1
    counts, final = rejection_sample(p, drafts, q, [1, 1], torch.tensor([0.1, 0.0]), noise)
    assert counts == [1, 1] and final.tolist() == [2, 4]  # accepted (u < 0.5) → bonus from the next row
    counts, final = rejection_sample(p, drafts, None, [1, 1], torch.tensor([0.7, 0.5]), noise)
    assert counts == [0, 1] and final.tolist() == [1, 4]  # point mass: p without the draft


# ---- the distribution ---------------------------------------------------------------------------

def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile (z = 3.09: the 0.999 quantile)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def markov(gen: torch.Generator) -> torch.Tensor:
    """[V, V]: row a is the next-token distribution after token a; every entry >= 0.025."""
    return 0.8 * torch.softmax(1.5 * torch.randn(V, V, generator=gen), dim=1) + 0.2 / V


def speculate(P: torch.Tensor, Q: torch.Tensor, n: int, k: int, gen: torch.Generator, point_mass: bool = False,
              rule_q: torch.Tensor | None = None):
    """n independent verification rounds after token 0: drafts x_1..x_k drawn from the chain Q, target P;
    the rule is told q = rule_q (default Q), or a point mass. Returns the committed sequences (accepted
    drafts + the final token)."""
    x, prev = [], torch.zeros(n, dtype=torch.long)
    for _ in range(k):
        prev = torch.multinomial(Q[prev], 1, generator=gen).squeeze(1)
        x.append(prev)
    x = torch.stack(x, dim=1)                                            # [n, k]
    ctx = torch.cat([torch.zeros(n, 1, dtype=torch.long), x], dim=1)     # [n, k + 1]: the token before each row
    target = P[ctx].reshape(n * (k + 1), V)
    draft = None if point_mass else (Q if rule_q is None else rule_q)[ctx[:, :k]].reshape(n * k, V)
    uniform = torch.rand(n * k, generator=gen)
    noise = torch.empty(n, V).exponential_(generator=gen)
    counts, final = rejection_sample(target, x.reshape(-1), draft, [k] * n, uniform, noise)
    xs, fs = x.tolist(), final.tolist()
    return [xs[i][:a] + [fs[i]] for i, a in enumerate(counts)]


def first_two_chi2(P: torch.Tensor, seqs: list[list[int]]) -> tuple[float, float]:
    """Chi-square of the first committed token against P[0], and of the second (when a round committed
    two) against P[first], summed over the first token's values."""
    first = torch.bincount(torch.tensor([s[0] for s in seqs]), minlength=V).double()
    c1 = chi2(first, P[0].double())
    pairs = torch.zeros(V, V, dtype=torch.float64)
    for s in seqs:
        if len(s) >= 2:
            pairs[s[0], s[1]] += 1
    c2 = sum(chi2(pairs[a], P[a].double()) for a in range(V))
    return c1, c2


@pytest.fixture(scope="module")
def chains():
    gen = torch.Generator().manual_seed(1234)
    return markov(gen), markov(gen)


def test_committed_tokens_follow_the_target_distribution(chains):
    P, Q = chains
    seqs = speculate(P, Q, 40_000, 3, torch.Generator().manual_seed(0))
    c1, c2 = first_two_chi2(P, seqs)
    assert c1 < chi2_critical(V - 1) and c2 < chi2_critical(V * (V - 1)), (c1, c2)
    rate = sum(len(s) - 1 for s in seqs) / (3 * len(seqs))
    assert 0.3 < rate < 0.95                      # q differs enough from p for rejections to matter


def test_point_mass_rule_is_exact_whatever_proposes(chains):
    """The n-gram rule (accept with p(x), else p without x) needs no q: any proposal is fine."""
    P, Q = chains
    c1, c2 = first_two_chi2(P, speculate(P, Q, 40_000, 3, torch.Generator().manual_seed(1), point_mass=True))
    assert c1 < chi2_critical(V - 1) and c2 < chi2_critical(V * (V - 1)), (c1, c2)


def test_wrong_rules_fail_the_same_test(chains):
    P, Q = chains
    gen = torch.Generator().manual_seed(0)
    # The rule told a q that is not what the drafts were drawn from (e.g. q before temperature): biased.
    flat = torch.softmax(Q.log() / 2, dim=1)
    c1, c2 = first_two_chi2(P, speculate(P, Q, 40_000, 3, gen, rule_q=flat))
    assert c1 > 10 * chi2_critical(V - 1) or c2 > 10 * chi2_critical(V * (V - 1)), (c1, c2)
    # Accept with min(1, p/q) but resample from p itself on rejection: biased.
    n = 40_000
    x = torch.multinomial(Q[0], n, replacement=True, generator=gen)
    accept = torch.rand(n, generator=gen) < (P[0, x] / Q[0, x])
    redraw = torch.multinomial(P[0], n, replacement=True, generator=gen)
    first = torch.bincount(torch.where(accept, x, redraw), minlength=V).double()
    assert chi2(first, P[0].double()) > 10 * chi2_critical(V - 1)


# ---- verification glue: penalties see earlier drafts, seeds reproduce ----------------------------------

def chunk_with(drafts: list[int], **params) -> tuple[list[ScheduledChunk], list[Request]]:
    """A decode chunk carrying `drafts`, and its request (one output so far)."""
    req = Request("r", [1, 2], SamplingParams(max_tokens=10, **params), frozenset({0}))
    req.append_output(7)
    req.num_computed_tokens = 2
    return [ScheduledChunk.of(req, 1, len(drafts), drafts)], [req]


def test_penalties_at_a_draft_position_count_the_drafts_before_it():
    logits = torch.zeros(3, V)
    logits[:, 3], logits[:, 4] = 5.0, 4.5                 # token 3 leads on every row
    plain = verify(logits, *chunk_with([3, 3], temperature=0), [None], V, frozenset({0}), torch.device("cpu"))
    assert [t.token_id for t in plain["r"][0]] == [3, 3] and plain["r"][1].token_id == 3
    penalised = verify(logits, *chunk_with([3, 3], temperature=0, presence_penalty=1.0), [None], V,
                       frozenset({0}), torch.device("cpu"))
    accepted, final = penalised["r"]
    assert [t.token_id for t in accepted] == [3] and final.token_id == 4   # row 1 sees draft 0 = 3


def test_min_tokens_bans_apply_per_draft_position():
    logits = torch.zeros(3, V)
    logits[:, 0] = 9.0                                    # eos leads everywhere
    logits[:, 5] = 1.0
    c = chunk_with([5, 0], temperature=0, min_tokens=3)   # 1 output so far: eos banned at rows 0 and 1
    accepted, final = verify(logits, *c, [None], V, frozenset({0}), torch.device("cpu"))["r"]
    assert [t.token_id for t in accepted] == [5] and final.token_id == 5


def test_seeded_verification_reproduces_and_logprobs_follow_the_rows():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    runs = []
    for _ in range(2):
        c = chunk_with([1, 2, 3], temperature=1.0, seed=42, logprobs=2)
        g = torch.Generator().manual_seed(42)
        runs.append(verify(logits, *c, [g], V, frozenset({0}), torch.device("cpu"))["r"])
    (acc_a, fin_a), (acc_b, fin_b) = runs
    assert [t.token_id for t in acc_a] == [t.token_id for t in acc_b] and fin_a.token_id == fin_b.token_id
    lps = torch.log_softmax(logits, dim=1)
    for row, tok in enumerate([*acc_a, fin_a]):
        assert tok.logprobs.logprob == pytest.approx(float(lps[row, tok.token_id]), abs=1e-5)
        assert len(tok.logprobs.top) == 2
