"""StepMasks: a step's grammar masks, for the sample stage. Rows whose choice needs no filter (greedy,
or temperature alone) are sampled without their mask first, and only those whose token the grammar
refuses get it (`refused`, the `GrammarCheck` contract of sampling/sampler.py: exact, see `sample`);
every other row under a grammar, and every draft row, gets its mask up front. Most tokens stand, so
most steps compute few masks (~0.1 ms a row) and many checks (microseconds)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from phasewise.core.request import Grammar, SequenceView
from phasewise.core.sampling_params import SamplingParams
from phasewise.structured.grammar_matcher import grammar_bitmask, matcher


def unfiltered(params: SamplingParams, vocab_size: int) -> bool:
    """The row's distribution has no top-k, top-p or min-p cut (greedy, or temperature alone)."""
    return params.temperature == 0 or (
        (params.top_k <= 0 or params.top_k >= vocab_size) and params.top_p >= 1 and params.min_p <= 0)


class StepMasks:
    """The masks of a step's sampling rows (`reqs`, one row each) and of its chunks with drafts (a
    grammar and its drafts each, k + 1 rows: the position after drafts 0..i-1); `ms`, the time spent
    on grammars."""

    def __init__(self, reqs: Sequence[SequenceView], drafted: Sequence[tuple[Grammar | None, Sequence[int]]],
                 vocab_size: int) -> None:
        started = time.perf_counter()
        self.reqs, self.vocab_size = reqs, vocab_size
        self.lazy = [matcher(r.grammar) is not None
                     and unfiltered(r.sampling_params, vocab_size) for r in reqs]
        rows: list[tuple[Grammar | None, Sequence[int]]] = [(None if z else r.grammar, ())
                                                           for r, z in zip(reqs, self.lazy)]
        self.up_front = grammar_bitmask(rows + list(drafted), vocab_size)
        self.ms = 0.0 if self.up_front is None else (time.perf_counter() - started) * 1e3

    @property
    def sampling(self) -> np.ndarray | None:
        """The sampling rows' masks taken up front [len(reqs), ceil(V / 32)] (None: no grammar)."""
        return None if self.up_front is None else self.up_front[:len(self.reqs)]

    @property
    def drafts(self) -> np.ndarray | None:
        """The draft rows' masks (None: no grammar)."""
        return None if self.up_front is None else self.up_front[len(self.reqs):]

    @property
    def check(self) -> StepMasks | None:
        """Itself as the sampler's GrammarCheck, when some row is sampled before its mask."""
        return self if any(self.lazy) else None

    def refused(self, token_ids: list[int]) -> tuple[list[int], np.ndarray] | None:
        """The lazy rows whose sampled token their grammar refuses, and those rows' masks; None if none."""
        started = time.perf_counter()
        rows = [i for i, (r, z, t) in enumerate(zip(self.reqs, self.lazy, token_ids))
                if z and r.grammar is not None and not r.grammar.valid_prefix([t])]
        words = grammar_bitmask([(self.reqs[i].grammar, ()) for i in rows], self.vocab_size) if rows else None
        self.ms += (time.perf_counter() - started) * 1e3
        return (rows, words) if rows and words is not None else None
