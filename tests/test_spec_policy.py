"""Adaptive speculation (core/spec_policy.py) with costs handed to it: the expected speed-up model against
a simulation of its own assumptions, 0 drafts at a low acceptance or a dear draft, the most at a high one,
and the policy learning both from the steps the engine reports."""

from __future__ import annotations

import random

import pytest

from phasewise.core import spec_policy
from phasewise.core.handoffs import ScheduledChunk, SchedulerOutput
from phasewise.core.request import Request
from phasewise.core.sampling_params import SamplingParams
from phasewise.core.spec_policy import Costs, SpecPolicy, StepCosts, expected_tokens

CHEAP = Costs(plain=20.0, row=0.5, draft=2.0)      # a small draft and a target whose extra rows cost little


def simulate(costs: Costs, a: float, k: int, steps: int = 40_000, seed: int = 0) -> float:
    """Tokens per ms of speculative decoding, drafts accepted with probability a each until one is not,
    over plain decoding's (1 token per costs.plain)."""
    rng = random.Random(seed)
    tokens = 0
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        tokens += accepted + 1
    return tokens / (steps * (costs.plain + k * (costs.draft + costs.row))) * costs.plain


@pytest.mark.parametrize("a,k", [(0.3, 1), (0.6, 3), (0.8, 4), (0.95, 6), (1.0, 2)])
def test_the_expected_speedup_is_what_a_simulation_gives(a, k):
    assert expected_tokens(a, 0) == 1 and expected_tokens(a, 1) == pytest.approx(1 + a)
    assert CHEAP.speedup(a, k) == pytest.approx(simulate(CHEAP, a, k), rel=0.02)


def test_low_acceptance_or_a_dear_draft_chooses_0_a_high_one_the_most():
    assert CHEAP.best(0.05, 4) == (0, 1.0)
    k, s = CHEAP.best(0.97, 4)
    assert k == 4 and s == pytest.approx(CHEAP.speedup(0.97, 4)) and s > 3
    middle = CHEAP.best(0.6, 8)[0]
    assert 0 < middle < 8                                       # past some k, a draft costs more than it brings
    dear = Costs(plain=20.0, row=0.5, draft=6.0)                # a draft at 30% of the target's step
    assert dear.best(0.3, 4)[0] == 0 and dear.best(0.95, 4)[0] == 4
    assert CHEAP.best(0.3, 4)[0] > 0                            # where a cheap draft still pays
    as_slow = Costs(plain=20.0, row=0.5, draft=19.5)            # a draft as slow as the target never pays
    assert as_slow.best(0.99, 4)[0] == 0
    assert CHEAP.best(0.0, 4) == (0, 1.0) and Costs(20.0, 20.0, 20.0).best(1.0, 4) == (0, 1.0)


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(temperature=0, max_tokens=10_000))


def _step(policy: SpecPolicy, reqs: list[Request], hit: float, rng: random.Random, plain_ms: float = 20.0,
          row_ms: float = 1.0, draft_ms: float = 3.0) -> list[int]:
    """One decode step as the engine runs it: each request's k chosen, drafts accepted with probability
    `hit`, the step timed by the given costs. The ks chosen."""
    ks = [policy.choose(r) for r in reqs]
    chunks = [ScheduledChunk.of(r, 1, k, [7] * k)
              for r, k in zip(reqs, ks)]
    accepted = {}
    for r, k in zip(reqs, ks):
        n = 0
        while n < k and rng.random() < hit:
            n += 1
        accepted[r.request_id] = n
    sched = SchedulerOutput(chunks, num_decode_tokens=len(reqs), num_draft_tokens=sum(ks))
    policy.observe(sched, {r.request_id: r for r in reqs}, accepted, plain_ms + row_ms * sum(ks), draft_ms * max(ks))
    return ks


def test_the_policy_measures_then_follows_the_acceptance_and_probes_again():
    policy, rng = SpecPolicy(4), random.Random(1)
    req = _request("a")
    # plain decoding measured first (3 samples, a first one skipped), then verify steps, the draft's time
    # once it has not just caught up on plain steps
    assert [_step(policy, [req], 1.0, rng)[0] for _ in range(9)] == [0] * 4 + [4] * 5
    costs = policy.costs.measured()
    assert costs is not None and (costs.plain, costs.row, costs.draft) == pytest.approx((20.0, 1.0, 3.0))
    assert [_step(policy, [req], 1.0, rng)[0] for _ in range(5)] == [4] * 5
    ks = [_step(policy, [req], 0.0, rng)[0] for _ in range(40)]  # the text turns unpredictable
    first = ks.index(0)
    assert ks[-1] == 0 and first < 15 and ks[:first] == sorted(ks[:first], reverse=True)   # fewer, then none
    ks += [_step(policy, [req], 0.0, rng)[0] for _ in range(spec_policy.PROBE_FIRST)]
    assert spec_policy.PROBE_K in ks[ks.index(0):]             # a probe after a stretch of plain decoding
    later = [_step(policy, [req], 1.0, rng)[0] for _ in range(300)]   # predictable again: found by a probe
    assert later.index(4) <= 4 * spec_policy.PROBE_FIRST and later[-20:].count(4) >= 19   # (one may calibrate)
    assert req.metrics.spec_k_chosen[0] >= 10 and req.metrics.spec_k_chosen[4] > 100
    assert req.metrics.spec_costs == pytest.approx((20.0, 1.0, 3.0), rel=0.05)


def test_each_request_has_its_own_acceptance_and_plain_is_measured_again():
    policy, rng = SpecPolicy(4), random.Random(2)
    good, bad = _request("good"), _request("bad")
    for _ in range(9):
        _step(policy, [good, bad], 1.0, rng)                    # calibration
    seen = []
    for _ in range(spec_policy.CALIBRATE + 20):
        ks = [policy.choose(r) for r in (good, bad)]
        seen.append(ks)
        chunks = [ScheduledChunk.of(r, 1, k, [7] * k)
                  for r, k in zip((good, bad), ks)]
        sched = SchedulerOutput(chunks, num_decode_tokens=2, num_draft_tokens=sum(ks))
        policy.observe(sched, {"good": good, "bad": bad}, {"good": ks[0], "bad": 0}, 20.0 + sum(ks), 3.0 * max(ks + [1]))
    assert seen[-1] == [4, 0]
    assert [0, 0] in seen[20:]                                  # one plain step re-measures `plain`
    costs = StepCosts()
    for ms in (90.0, 20.0, 21.0, 95.0, 19.0, 22.0):             # a first call, and a burst of another program
        costs.observe(ms, 0, None, 0)
    assert costs.plain == 21.0 and costs.measured() is None     # no verify or draft step measured yet


def test_no_probe_where_drafts_could_not_pay_even_if_all_were_accepted():
    """A draft as slow as the target: after calibrating, every decode goes plain, with no probe (a draft
    model's probe would first catch up on every token since it last ran)."""
    policy, rng = SpecPolicy(4), random.Random(3)
    req = _request("a")
    ks = [_step(policy, [req], 1.0, rng, plain_ms=20.0, row_ms=0.5, draft_ms=19.0)[0] for _ in range(100)]
    assert ks[:9] == [0] * 4 + [4] * 5 and set(ks[9:]) == {0}


def test_a_draft_that_must_first_catch_up_on_a_long_prompt_starts_only_where_that_is_repaid():
    """The draft's catch-up (a prefill of every token it has not seen: a whole prompt, the first time) is
    measured per token, and a request whose remaining tokens cannot repay its own decodes plain from the
    start, while a short prompt with a long answer drafts (drafts worth 1.56x here, a catch-up at 2 ms a token:
    600 tokens cost 1.2 s; 30 answer tokens save about 0.2 s, the horizon's 256 about 1.8 s at 20 ms a step)."""
    policy, rng = SpecPolicy(4), random.Random(4)

    def step(reqs: list[Request], catchup_ms: float = 2.0) -> list[int]:
        ks = [policy.choose(r) for r in reqs]
        behind = sum(r.num_tokens - r.spec_choice.drafted_at for r, k in zip(reqs, ks)
                     if k and r.spec_choice.last_k == 0)
        chunks = [ScheduledChunk.of(r, 1, k, [7] * k) for r, k in zip(reqs, ks)]
        accepted = {r.request_id: sum(1 for _ in range(k) if rng.random() < 0.75) for r, k in zip(reqs, ks)}
        sched = SchedulerOutput(chunks, num_decode_tokens=len(reqs), num_draft_tokens=sum(ks))
        policy.observe(sched, {r.request_id: r for r in reqs}, accepted, 20.0 + 1.0 * sum(ks),
                       4.0 * max(ks + [0]) + catchup_ms * behind)
        for r in reqs:
            r.append_output(5)
        return ks

    for i in range(5):                                     # each new request's draft catches up on its prompt
        earlier = Request(f"earlier-{i}", list(range(200)), SamplingParams(temperature=0, max_tokens=10_000))
        for _ in range(12):
            step([earlier])
    assert policy.costs.catchup == pytest.approx(2.0, rel=0.05)
    long_prompt = Request("long", list(range(600)), SamplingParams(temperature=0, max_tokens=30))
    short_prompt = Request("short", list(range(10)), SamplingParams(temperature=0, max_tokens=2_000))
    assert all(k == 0 for _ in range(25) for k in step([long_prompt]))
    ks = [step([short_prompt])[0] for _ in range(10)]
    assert sum(ks) > 20                                    # drafting from its first decode steps


def test_plain_steps_measured_slow_at_the_start_are_displaced_within_a_few_calibrations():
    """A process's first plain steps are slow (30 ms here, 20 after): plain is measured again every
    CALIBRATE_EARLY drafting steps until the window is full, so its median is the later figure within about
    a hundred steps, not a thousand."""
    policy, rng = SpecPolicy(4), random.Random(5)
    req = _request("a")
    for _ in range(9):
        _step(policy, [req], 0.9, rng, plain_ms=30.0)
    assert policy.costs.plain == pytest.approx(30.0)
    ks = [_step(policy, [req], 0.9, rng)[0] for _ in range(102)]      # 6 x (CALIBRATE_EARLY + its plain step)
    assert policy.costs.plain == pytest.approx(20.0) and ks.count(0) >= 5
    ks = [_step(policy, [req], 0.9, rng)[0] for _ in range(spec_policy.CALIBRATE)]
    assert ks.count(0) <= 2                                # a full window: calibrating rarely again
