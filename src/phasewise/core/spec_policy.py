"""Speculation that never loses: how many draft tokens each decode carries, chosen per request and step
from the request's measured acceptance and this machine's measured costs.

The model: each draft is accepted with probability a, independently, until the first rejection. A step
with k drafts then commits E(a, k) = 1 + a + ... + a^k tokens (the target's own included) and costs k
draft steps and a target step over k more rows, T(k) = plain + k * (draft + row), where plain decoding
commits 1 token per `plain`. The expected speed-up is S(k) = E(a, k) * plain / T(k); the policy takes
the k in 0..K (K: --num-speculative-tokens) with the largest S, and 0 (plain decoding) unless that S
passes MARGIN. A request at 0 probes again with PROBE_K drafts after PROBE_FIRST plain steps, then after
twice as many each time the probe says 0 again (at most PROBE_MAX), so a text that turns predictable is
found; not where drafts could not pay even if all were accepted (a draft model as slow as the target). A
probe is dear: a draft model's first catches up on every token since it last ran (a prefill of that
many; 6-7 plain steps' time for 16 tokens at AVX2), so it drafts one token, and comes rarely.

That catch-up is a cost of its own: a request whose draft has not run for B tokens (its whole prompt,
the first time) pays B times `catchup` before its first draft. Drafting (or a probe) starts only when
what it saves over the request's remaining tokens R (at most HORIZON), R * plain * (1 - 1/S) at the
expected speed-up S (a probe: S if every draft were accepted), repays that: on a machine where drafts
pay only at high acceptance (AVX2), a long prompt with a short answer is decoded plain from the start.
One request's view: in a batch, the catch-up holds up the others too.

The costs (`StepCosts`) are the engine's own steps, timed: decode-only steps without drafts give
`plain`, those with drafts give `row` (what each draft row adds to the verify step) and the proposer's
time per draft step gives `draft`, and its time beyond those on a step where drafts caught up gives
`catchup` per token caught up; each the median of its latest samples, so they follow the batch as it
changes and a burst of another program does not sway them (the very first sample, a first call's, is
skipped). Until `plain` is measured every decode goes plain; until `row` and `draft` are, it drafts K; every
CALIBRATE steps with drafts, one step goes plain to measure `plain` again, every CALIBRATE_EARLY until
WINDOW samples are in (a process's first steps are slow: at AVX2 the first request's plain steps took
1.4x the later ones', which made drafts look cheap until later samples displaced them). A request's
acceptance is its drafts accepted against the rejections that ended its steps (the maximum-likelihood a
of the model), counted with a memory of a few drafts, so it turns within a few steps, and starting from
the engine's own over recent requests.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from phasewise.core.handoffs import SchedulerOutput
from phasewise.core.request import Request

MARGIN = 1.10           # the speed-up speculation must promise over plain decoding (the model misses a verify
                        # step's fixed costs: at AVX2 a one-draft step ran 5-10% over its estimate)
PROBE_FIRST = 32        # plain steps before a request at 0 probes again; doubled after each probe that loses
PROBE_K = 1             # a probe's drafts: one tells whether drafts are taken again
PROBE_MAX = 256
CALIBRATE = 128         # steps with drafts between the plain steps that re-measure `plain`
CALIBRATE_EARLY = 16    # ... while fewer than WINDOW samples of it are in
WINDOW = 9              # the costs: medians of their latest samples,
MIN_SAMPLES = 3         # once there are this many
# per draft accepted or rejected: a request's acceptance counts (a memory of ~7 drafts)
TRIAL_DECAY = 0.85
HORIZON = 256           # tokens ahead a catch-up may be repaid over (a request with no max_tokens)
BEHIND_FREE = 3         # tokens a draft catches up on after a step with drafts (accepted aside): free


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step with k drafts commits when each is accepted with probability a: 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


@dataclass(frozen=True)
class Costs:
    """Milliseconds: a decode step without drafts, each draft row a verify step adds, one draft step."""
    plain: float
    row: float
    draft: float

    def speedup(self, a: float, k: int) -> float:
        """Expected tokens per second with k drafts over plain decoding's, at acceptance a."""
        return expected_tokens(a, k) * self.plain / (self.plain + k * (self.draft + self.row))

    def best(self, a: float, max_k: int) -> tuple[int, float]:
        """(k, speed-up) of the fastest k in 0..max_k; 0 unless its speed-up passes MARGIN."""
        k = max(range(max_k + 1), key=lambda k: self.speedup(a, k))
        s = self.speedup(a, k)
        return (k, s) if s >= MARGIN else (0, 1.0)


class _Recent:
    """A cost (ms): the median of its latest WINDOW samples, once it has MIN_SAMPLES, the very first skipped
    (a first call's costs). A median, as another program's burst on the machine makes a step slow at times."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.skipped = False

    def add(self, ms: float) -> None:
        if self.skipped:
            self.samples.append(ms)
        self.skipped = True

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if len(self.samples) >= MIN_SAMPLES else None


class StepCosts:
    """The costs measured from the engine's steps (exponential averages, in ms; None until measured)."""

    def __init__(self) -> None:
        self._plain, self._row, self._draft, self._catchup = _Recent(), _Recent(), _Recent(), _Recent()
        self.since_plain = 0                  # steps with drafts since `plain` was last measured

    @property
    def plain(self) -> float | None:
        return self._plain.value

    @property
    def calibrate_every(self) -> int:
        """Steps with drafts between plain ones that measure `plain` again."""
        return CALIBRATE if len(self._plain.samples) >= WINDOW else CALIBRATE_EARLY

    @property
    def catchup(self) -> float | None:
        """ms per token a draft catches up on (None until measured)."""
        return self._catchup.value

    def observe_catchup(self, propose_ms: float, draft_steps: int, behind: int) -> None:
        """A step whose drafts first caught up on `behind` tokens in all: what the proposer took beyond its
        draft steps, per token."""
        draft = self._draft.value
        if draft is not None and behind > 0:
            self._catchup.add(max(0.0, propose_ms - draft_steps * draft) / behind)

    def observe(self, execute_ms: float, num_drafts: int, propose_ms: float | None, draft_steps: int) -> None:
        """A decode-only step that ran `execute_ms` with `num_drafts` drafts in all, proposed in `propose_ms`
        over `draft_steps` draft steps (None: not a fair sample, e.g. a draft catching up on many tokens)."""
        if num_drafts == 0:
            self._plain.add(execute_ms)
            self.since_plain = 0
            return
        self.since_plain += 1
        if self.plain is not None:
            self._row.add(max(0.0, execute_ms - self.plain) / num_drafts)
        if propose_ms is not None and draft_steps:
            self._draft.add(propose_ms / draft_steps)

    def measured(self) -> Costs | None:
        plain, row, draft = self._plain.value, self._row.value, self._draft.value
        if plain is None or row is None or draft is None:
            return None
        return Costs(plain, row, draft)


@dataclass
class RequestSpec:
    """A request's side of the policy (kept in `Request.spec_choice`)."""
    accepted: float = 0.0             # decayed counts: drafts accepted,
    rejected: float = 0.0             # and the rejections that ended a step
    last_k: int = 0                   # the draft room of its previous decode
    drafted_at: int = 0               # its tokens when its draft last ran (0: never: behind by them all)
    plain_run: int = 0                # plain steps since speculation last ran or probed
    probe_after: int = PROBE_FIRST


class SpecPolicy:
    """Chooses each decode's draft count (0..max_k) and learns from each step (see the module's text)."""

    def __init__(self, max_k: int, costs: StepCosts | None = None, prior: float = 0.6) -> None:
        self.max_k = max_k
        self.costs = costs if costs is not None else StepCosts()
        self.accepted, self.rejected = 2 * prior, 2 * (1 - prior)    # the engine's acceptance, decayed slowly

    def acceptance(self, st: RequestSpec) -> float:
        engine = self.accepted / (self.accepted + self.rejected)
        return (st.accepted + engine) / (st.accepted + st.rejected + 1)

    def choose(self, req: Request) -> int:
        """The number of drafts `req`'s next decode carries (counted in its metrics)."""
        st = req.spec_choice if isinstance(req.spec_choice, RequestSpec) else RequestSpec()
        req.spec_choice = st
        k = self.decide(req, st)
        req.metrics.spec_k_chosen[k] = req.metrics.spec_k_chosen.get(k, 0) + 1
        return k

    def decide(self, req: Request, st: RequestSpec) -> int:
        costs = self.costs.measured()
        if self.costs.plain is None or self.costs.since_plain >= self.costs.calibrate_every:
            return 0                                        # measure plain decoding
        if costs is None:
            return self.max_k                               # measure a verify and a draft step
        k, speedup = costs.best(self.acceptance(st), self.max_k)
        req.metrics.spec_costs = (costs.plain, costs.row, costs.draft)
        if k and self._repaid(req, st, costs.plain, speedup):
            st.plain_run, st.probe_after = 0, PROBE_FIRST
            return k
        perfect = costs.best(1.0, self.max_k)                     # could drafts pay at all?
        if st.plain_run >= st.probe_after and perfect[0] and self._repaid(req, st, costs.plain, perfect[1]):
            k, st.plain_run, st.probe_after = PROBE_K, 0, min(2 * st.probe_after, PROBE_MAX)
            return k
        st.plain_run += 1
        return 0

    def _repaid(self, req: Request, st: RequestSpec, plain: float, speedup: float) -> bool:
        """Whether drafting at `speedup` over the request's remaining tokens saves more than its draft's
        catch-up costs (True while that cost is not measured: drafting measures it)."""
        behind = req.num_tokens - st.drafted_at
        catchup = self.costs.catchup
        if behind <= BEHIND_FREE or catchup is None:
            return True
        limit = req.sampling_params.max_tokens
        remaining = HORIZON if limit is None else min(HORIZON, limit - len(req.output_token_ids))
        return remaining * plain * (1 - 1 / speedup) > behind * catchup

    def observe(self, sched: SchedulerOutput, requests: Mapping[str, Request], accepted: dict[str, int],
                execute_ms: float, propose_ms: float) -> None:
        """Learn from a step that ran (its chunks' `requests`): each request's drafts accepted, and the
        costs if it only decoded."""
        fair = True                                         # no draft caught up on a stretch of plain steps
        behind = 0                                  # the tokens drafts caught up on beyond a step's few
        for c in sched.chunks:
            req = requests.get(c.request_id)
            st = req.spec_choice if req is not None else None
            if req is None or not isinstance(st, RequestSpec):
                continue
            if c.draft_token_ids:
                fair = fair and st.last_k > 0
                if st.last_k == 0 and req.num_tokens - st.drafted_at > BEHIND_FREE:
                    behind += req.num_tokens - st.drafted_at
                st.drafted_at = req.num_tokens
                n, got = len(c.draft_token_ids), accepted.get(c.request_id, 0)
                miss = 1.0 if got < n else 0.0
                fade = TRIAL_DECAY ** (got + miss)             # each trial (a draft's fate) ages the counts
                st.accepted, st.rejected = fade * st.accepted + got, fade * st.rejected + miss
                self.accepted, self.rejected = 0.99 * self.accepted + got, 0.99 * self.rejected + miss
            st.last_k = c.max_draft_tokens                  # the draft ran (and caught up) when this was > 0
        if sched.num_prefill_tokens == 0 and sched.chunks:
            steps = max(c.max_draft_tokens for c in sched.chunks)
            self.costs.observe(execute_ms, sched.num_draft_tokens, propose_ms if fair else None, steps)
            if behind:
                self.costs.observe_catchup(propose_ms, steps, behind)
