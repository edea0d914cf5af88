"""Sampler tests: exact filter masks and penalties on hand-made logits, seeding, logprobs, distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.core.sampling_params import SamplingParams
from phasewise.sampling.metadata import SamplingMetadata
from phasewise.sampling.sampler import SamplerOutput, sample
from phasewise.sampling.sampler import (
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    compute_logprobs,
    random_sample,
)

EOS = 0


def build(params, vocab, prompt=None, output=None, gens=None, eos=frozenset({EOS})) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params, prompt or [[] for _ in range(n)], output or [[] for _ in range(n)], gens or [None] * n, vocab, eos
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kept(logits: torch.Tensor) -> list[list[int]]:
    """Token ids with finite logits, per row."""
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor(probs).log()


# ---------------------------------------------------------------- SamplingParams / metadata


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.01}, {"max_tokens": -1}, {"temperature": math.nan}]
)
def test_params_validation_rejects(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_boundaries_accepted():
    p = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=1, top_k=-1, logprobs=20)
    assert p.greedy


def test_metadata_leaves_unused_features_none():
    meta = build([SamplingParams(), SamplingParams(top_k=99, temperature=0.0)], vocab=10)
    assert meta.top_k is None  # 99 >= vocab counts as off
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "prompt_mask", "output_counts", "banned_mask", "max_num_logprobs"):
        assert getattr(meta, name) is None, name
    assert not meta.all_greedy
    assert meta.temperature.tolist() == [1.0, 0.0]
    assert build([SamplingParams(temperature=0.0)] * 2, vocab=10).all_greedy


def test_metadata_rejects_mismatched_rows():
    with pytest.raises(ValueError):
        SamplingMetadata.build([SamplingParams()], [[]], [[], []], [None], 10, {EOS})


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_draws_no_random_numbers():
    logits = torch.randn(4, 50, generator=gen(0))
    meta = build([SamplingParams(temperature=0.0)] * 4, vocab=50)
    state = torch.get_rng_state()
    out = sample(logits, meta)
    assert torch.equal(torch.get_rng_state(), state)  # the all-greedy fast path consumed no randomness
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_in_mixed_batch_are_argmax():
    logits = torch.randn(4, 50, generator=gen(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * 2
    meta = build(params, vocab=50, gens=[None, gen(2), None, gen(3)])
    ids = sample(logits, meta).token_ids
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()


def test_greedy_sees_penalties():
    logits = torch.tensor([[0.0, 3.0, 2.5]])
    meta = build([SamplingParams(temperature=0.0, frequency_penalty=1.0)], vocab=3, output=[[1]])
    assert sample(logits, meta).token_ids.tolist() == [2]


# ---------------------------------------------------------------- seeding


def _run_seeded(seed: int, position: int, others: list[SamplingParams], global_seed: int, steps: int = 16) -> list[int]:
    """Tokens drawn for a seeded row sitting at `position` among `others`, over several steps."""
    vocab, g = 64, gen(seed)
    target = SamplingParams(temperature=1.0, seed=seed)
    step_logits = torch.randn(steps, vocab, generator=gen(99)) * 0.5  # shared per-step logits for the target row
    noise = torch.randn(steps, len(others), vocab, generator=gen(7))
    other_gens = [gen(1000 + i) if i % 2 else None for i in range(len(others))]
    tokens = []
    with torch.random.fork_rng():
        torch.manual_seed(global_seed)
        for step in range(steps):
            params, gens = list(others), list(other_gens)
            params.insert(position, target)
            gens.insert(position, g)
            rows = list(noise[step])
            rows.insert(position, step_logits[step])
            out = sample(torch.stack(rows), build(params, vocab, gens=gens))
            tokens.append(int(out.token_ids[position]))
    return tokens


def test_seeded_row_reproducible_across_batches():
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(min_p=0.1)]
    alone = _run_seeded(seed=5, position=0, others=[], global_seed=0)
    assert alone == _run_seeded(seed=5, position=0, others=[], global_seed=1)
    assert alone == _run_seeded(seed=5, position=2, others=others, global_seed=2)
    assert len(set(alone)) > 1  # the row really is random


def test_different_seeds_differ():
    assert _run_seeded(seed=5, position=0, others=[], global_seed=0) != _run_seeded(
        seed=6, position=0, others=[], global_seed=0
    )


# ---------------------------------------------------------------- top-k / top-p / min-p masks


@pytest.mark.parametrize("with_top_p", [False, True])
def test_top_k_exact_mask_keeps_ties(with_top_p):
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0], [3.0, 2.0, 2.0, 1.0, 0.0]])
    top_k = torch.tensor([2, 5, 2])
    top_p = torch.ones(3) if with_top_p else None
    assert kept(apply_top_k_top_p(logits, top_k, top_p)) == [[1, 3], [0, 1, 2, 3, 4], [0, 1, 2]]


def test_top_p_boundary_mass_exactly_top_p():
    logits = log_probs(0.5, 0.25, 0.125, 0.125).expand(5, 4)
    assert logits.softmax(-1)[0].tolist() == [0.5, 0.25, 0.125, 0.125]  # dyadic, so the boundary is exact
    top_p = torch.tensor([0.75, 0.76, 0.5, 0.01, 1.0])
    assert kept(apply_top_k_top_p(logits, None, top_p)) == [[0, 1], [0, 1, 2], [0], [0], [0, 1, 2, 3]]


def test_top_p_ties_keep_lower_id_only():
    logits = log_probs(0.3, 0.4, 0.3)[None]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.5]))) == [[0, 1]]
    flat = torch.zeros(1, 1024)  # 1/1024 is exact; big enough that an unstable sort scrambles ties
    assert kept(apply_top_k_top_p(flat, None, torch.tensor([0.5]))) == [list(range(512))]


def test_top_p_uses_top_k_renormalised_mass():
    logits = log_probs(0.4, 0.3, 0.2, 0.1).expand(2, 4)
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([0.5, 0.5]))
    assert kept(out) == [[0], [0, 1]]  # 0.4 / 0.7 >= 0.5 once top-k has cut the tail


def test_top_p_one_keeps_whole_large_vocab():
    logits = torch.randn(2, 50_000, generator=gen(0)) * 3  # cumsum drifts above 1 in float32 here
    out = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.9]))
    assert torch.isfinite(out[0]).all()
    assert not torch.isfinite(out[1]).all()


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(scale=st.sampled_from([0.01, 0.5, 2.0, 8.0]), decimals=st.sampled_from([None, 0, 1]),
       top_p=st.lists(st.sampled_from([0.01, 0.3, 0.9, 0.999, 1.0]), min_size=4, max_size=4),
       top_k=st.one_of(st.none(), st.lists(st.sampled_from([1, 7, 300, 5000]), min_size=4, max_size=4)),
       seed=st.integers(0, 2**16))
def test_top_p_from_candidates_equals_the_full_sort(scale, decimals, top_p, top_k, seed):
    """The candidate shortcut (vocabularies above TOP_P_CANDIDATES) against the sorted reference:
    flat rows (which fall back), peaked rows, heavy ties (rounded logits), mixed top-k."""
    from phasewise.sampling import sampler

    logits = torch.randn(4, 5000, generator=gen(seed)) * scale
    if decimals is not None:
        logits = logits.round(decimals=decimals)
    k = None if top_k is None else torch.tensor(top_k)
    p = torch.tensor(top_p)
    masked = logits if k is None else sampler._top_k_mask(logits, k)
    expected = sampler._top_p_by_sort(masked, p)
    assert torch.equal(torch.isfinite(apply_top_k_top_p(logits, k, p)), torch.isfinite(expected))


def test_min_p_exact_mask():
    logits = log_probs(0.5, 0.3, 0.15, 0.05).expand(3, 4)
    assert kept(apply_min_p(logits, torch.tensor([0.2, 0.5, 0.0]))) == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]
    ties = torch.tensor([[2.0, 2.0, 1.0]])
    assert kept(apply_min_p(ties, torch.tensor([1.0]))) == [[0, 1]]  # prob == min_p * max is kept


def test_temperature_scales_rows_and_skips_greedy():
    logits = torch.tensor([[2.0, -4.0], [2.0, -4.0], [2.0, -4.0]])
    out = apply_temperature(logits, torch.tensor([0.5, 2.0, 0.0]))
    assert out.tolist() == [[4.0, -8.0], [1.0, -2.0], [2.0, -4.0]]


# ---------------------------------------------------------------- penalties and bans


def test_each_penalty_exact():
    raw = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(presence_penalty=0.5),
              SamplingParams(frequency_penalty=0.5), SamplingParams(),
              SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.5)]
    meta = build(params, vocab=6, prompt=[[0, 1]] * 5, output=[[2, 2, 3]] * 5)
    assert meta.output_counts[0].tolist() == [0, 0, 2, 1, 0, 0]
    assert meta.prompt_mask[1].sum() == 0  # only repetition-penalty rows need the prompt
    out = apply_penalties(torch.tensor([raw] * 5), meta)
    assert out.tolist() == [
        [1.0, -2.0, 0.25, -1.0, 1.0, 0.0],   # repetition: prompt and output tokens, / if > 0 else *
        [2.0, -1.0, 0.0, -1.0, 1.0, 0.0],    # presence: output tokens once
        [2.0, -1.0, -0.5, -1.0, 1.0, 0.0],   # frequency: per occurrence
        raw,
        [1.0, -2.0, -1.25, -2.0, 1.0, 0.0],  # repetition first, then frequency and presence
    ]


def test_min_tokens_bans_eos_and_stop_ids():
    params = [SamplingParams(min_tokens=3, stop_token_ids=[4]), SamplingParams(min_tokens=3, stop_token_ids=[4]),
              SamplingParams(min_tokens=3, stop_token_ids=[4], ignore_eos=True), SamplingParams(stop_token_ids=[4])]
    meta = build(params, vocab=6, output=[[1, 2], [1, 2, 3], [], []])
    assert kept(torch.where(meta.banned_mask, float("-inf"), 0.0)) == [[1, 2, 3, 5], list(range(6)),
                                                                       [0, 1, 2, 3, 5], list(range(6))]
    assert build(params[1:2], vocab=6, output=[[1, 2, 3]]).banned_mask is None

    logits = torch.tensor([[9.0, 1.0, 2.0, 0.0, 8.0, 0.5]]).expand(4, 6)
    greedy = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])] * 4
    assert sample(logits, build(greedy, 6, output=[[1, 2]] * 4)).token_ids.tolist() == [2] * 4
    hot = [SamplingParams(temperature=2.0, min_tokens=1, stop_token_ids=[4])] * 500
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = sample(logits[:1].expand(500, 6), build(hot, 6)).token_ids
    assert not ((ids == 0) | (ids == 4)).any()


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_logits():
    raw = torch.randn(3, 10, generator=gen(3))
    params = [SamplingParams(logprobs=2, temperature=0.5, repetition_penalty=2.0, top_k=3),
              SamplingParams(temperature=0.0, frequency_penalty=2.0),
              SamplingParams(logprobs=0, min_p=0.3)]
    meta = build(params, vocab=10, prompt=[list(range(5))] * 3, output=[[5, 5, 6]] * 3, gens=[gen(1), None, gen(2)])
    out = sample(raw, meta)
    expected = raw.log_softmax(-1)
    assert out.logprobs.dtype == torch.float32 and out.top_ids.shape == (3, 2)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None]).squeeze(1))
    values, ids = expected.sort(-1, descending=True)
    assert torch.equal(out.top_ids, ids[:, :2])
    torch.testing.assert_close(out.top_logprobs, values[:, :2])
    assert (out.top_logprobs[:, 0] >= out.top_logprobs[:, 1]).all()
    half = sample(raw.to(torch.bfloat16), meta)  # low-precision model logits are upcast
    assert half.token_ids.dtype == torch.int64 and half.logprobs.dtype == torch.float32


def test_logprobs_absent_or_zero_columns():
    logits = torch.randn(2, 8, generator=gen(4))
    none = sample(logits, build([SamplingParams(), SamplingParams()], 8))
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None
    zero = sample(logits, build([SamplingParams(logprobs=0), SamplingParams()], 8))
    assert zero.top_ids.shape == (2, 0) and zero.top_logprobs.shape == (2, 0) and zero.logprobs.shape == (2,)
    chosen, top_ids, top_lp = compute_logprobs(logits, torch.tensor([3, 4]), 8)
    assert torch.equal(top_ids.sort(-1).values, torch.arange(8).expand(2, 8))


# ---------------------------------------------------------------- distribution


def test_temperature_sampling_matches_softmax():
    n, temperature = 20_000, 0.5
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    meta = build([SamplingParams(temperature=temperature)] * n, vocab=5)
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        ids = sample(logits.expand(n, 5), meta).token_ids
    observed = torch.bincount(ids, minlength=5).double()
    expected = (logits.double() / temperature).softmax(-1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 40.0, (chi2, observed.tolist(), expected.tolist())  # df=4: P(chi2 > 40) ~ 4e-8


def test_random_sample_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 3.0, 0.0, 1.0]]).expand(2000, 4)  # unnormalised is fine
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = random_sample(probs, [None] * 1999 + [gen(0)])
    counts = torch.bincount(ids, minlength=4).tolist()
    assert counts[0] == counts[2] == 0 and 1300 < counts[1] < 1700


# ---------------------------------------------------------------- property: samples survive the filters

TOL = 1e-3
_logit = st.one_of(st.integers(-3, 3).map(float), st.floats(-20, 20, allow_nan=False, width=32))


def _loose_survivors(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Float64 reference of top-k -> top-p -> min-p, loosened by TOL so float32 rounding cannot trip it."""
    z = [v / temperature for v in logits]
    k = top_k if 0 < top_k < len(z) else len(z)
    kth = sorted(z, reverse=True)[k - 1]
    in_k = [zi >= kth - TOL for zi in z]
    top = max(z)
    w = [math.exp(zi - top) if ok else 0.0 for zi, ok in zip(z, in_k)]
    total = sum(w)
    out = set()
    for i, zi in enumerate(z):
        mass_above = sum(wj for wj, zj in zip(w, z) if zj > zi + TOL) / total
        in_p = top_p >= 1 or mass_above < top_p + TOL
        in_min = min_p == 0 or zi - top >= math.log(min_p) - TOL
        if in_k[i] and in_p and in_min:
            out.add(i)
    return out


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    logits=st.lists(_logit, min_size=2, max_size=12),
    temperature=st.floats(0.1, 3.0),
    top_k=st.integers(-1, 14),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_samples_lie_in_surviving_set(logits, temperature, top_k, top_p, min_p, seed):
    rows, vocab = 8, len(logits)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    meta = build([params] * rows, vocab, gens=[gen(seed + i) for i in range(rows)])
    x = torch.tensor([logits] * rows)
    allowed = _loose_survivors(logits, temperature, top_k, top_p, min_p)
    filtered = apply_min_p(apply_top_k_top_p(apply_temperature(x, meta.temperature), meta.top_k, meta.top_p),
                           meta.min_p)
    assert set(kept(filtered)[0]) <= allowed
    assert len(kept(filtered)[0]) >= 1
    out: SamplerOutput = sample(x, meta)
    assert set(out.token_ids.tolist()) <= allowed
