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

The costs (`StepCosts`) are the engine's own steps, timed: decode-only steps without drafts give
`plain`, those with drafts give `row` (what each draft row adds to the verify step) and the proposer's
time per draft step gives `draft`; each the median of its latest samples, so they follow the batch as it
changes and a burst of another program does not sway them (the very first sample, a first call's, is
skipped). Until `plain` is measured every decode goes plain; until `row` and `draft` are, it drafts K; every
CALIBRATE steps with drafts, one step goes plain to measure `plain` again. A request's acceptance is its
drafts accepted against the rejections that ended its steps (the maximum-likelihood a of the model),
counted with a memory of a few drafts, so it turns within a few steps, and starting from the engine's
own over recent requests.
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
WINDOW = 9              # the costs: medians of their latest samples,
MIN_SAMPLES = 3         # once there are this many
# per draft accepted or rejected: a request's acceptance counts (a memory of ~7 drafts)
TRIAL_DECAY = 0.85


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
        self._plain, self._row, self._draft = _Recent(), _Recent(), _Recent()
        self.since_plain = 0                  # steps with drafts since `plain` was last measured

    @property
    def plain(self) -> float | None:
        return self._plain.value

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
        if self.costs.plain is None or self.costs.since_plain >= CALIBRATE:
            return 0                                        # measure plain decoding
        if costs is None:
            return self.max_k                               # measure a verify and a draft step
        k = costs.best(self.acceptance(st), self.max_k)[0]
        req.metrics.spec_costs = (costs.plain, costs.row, costs.draft)
        if k:
            st.plain_run, st.probe_after = 0, PROBE_FIRST
        elif st.plain_run >= st.probe_after and costs.best(1.0, self.max_k)[0]:   # could drafts pay at all?
            k, st.plain_run, st.probe_after = PROBE_K, 0, min(2 * st.probe_after, PROBE_MAX)
        else:
            st.plain_run += 1
        return k

    def observe(self, sched: SchedulerOutput, requests: Mapping[str, Request], accepted: dict[str, int],
                execute_ms: float, propose_ms: float) -> None:
        """Learn from a step that ran (its chunks' `requests`): each request's drafts accepted, and the
        costs if it only decoded."""
        fair = True                                         # no draft caught up on a stretch of plain steps
        for c in sched.chunks:
            req = requests.get(c.request_id)
            st = req.spec_choice if req is not None else None
            if not isinstance(st, RequestSpec):
                continue
            if c.draft_token_ids:
                fair = fair and st.last_k > 0
                n, got = len(c.draft_token_ids), accepted.get(c.request_id, 0)
                miss = 1.0 if got < n else 0.0
                fade = TRIAL_DECAY ** (got + miss)             # each trial (a draft's fate) ages the counts
                st.accepted, st.rejected = fade * st.accepted + got, fade * st.rejected + miss
                self.accepted, self.rejected = 0.99 * self.accepted + got, 0.99 * self.rejected + miss
            st.last_k = c.max_draft_tokens                  # the draft ran (and caught up) when this was > 0
        if sched.num_prefill_tokens == 0 and sched.chunks:
            steps = max(c.max_draft_tokens for c in sched.chunks)
            self.costs.observe(execute_ms, sched.num_draft_tokens, propose_ms if fair else None, steps)
