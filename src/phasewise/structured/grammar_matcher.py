"""GrammarMatcher: one request's place in its grammar; the token masks of a step's rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import fill_next_token_bitmask

from phasewise.core.request import Grammar


class GrammarMatcher:
    """Wraps an llguidance matcher. The engine advances it with each committed output token
    (`accept`); the runner reads the masks of the next position and of positions after draft tokens
    (`fill`), which leaves it where it was."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._m = matcher

    constrains = True          # every token goes through the grammar (TokenMatcher)

    def accept(self, token_id: int) -> bool:
        """Advance past a committed token; False (and `error` set) if the grammar refuses it."""
        return self._m.consume_token(token_id)

    def rollback(self, n: int) -> None:
        """Undo the last n tokens accepted."""
        self._m.rollback(n)

    @property
    def finished(self) -> bool:
        """Nothing may follow but an end-of-sequence token (or the matcher failed): the output is done."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of these tokens, in order, the grammar allows from here (draft tokens)."""
        return self._m.validate_tokens(list(token_ids)) if token_ids else 0

    def fill(self, bitmask: np.ndarray, row: int, drafts: Sequence[int] = ()) -> None:
        """Write the allowed tokens of the next position into bitmask[row] (int32, bit t % 32 of word
        t // 32), and for each draft token (all allowed: `valid_prefix`) the position after it into the
        following rows."""
        fill_next_token_bitmask(self._m, bitmask, row)
        consumed = 0
        for i, t in enumerate(drafts):
            if self._m.is_stopped():
                # the grammar is complete: the output ends at the draft before (an end-of-sequence draft
                # is not a token llguidance can roll back); the rows after it are never read
                break
            if not self._m.consume_token(t):
                raise ValueError(f"draft token {t} is not allowed by the grammar: {self._m.get_error()}")
            consumed += 1
            fill_next_token_bitmask(self._m, bitmask, row + i + 1)
        if consumed:
            self._m.rollback(consumed)

    def fill_after(self, bitmask: np.ndarray, row: int, drafts: Sequence[int]) -> None:
        """bitmask[row]: the allowed tokens after these drafts (left as it is if the grammar refuses one,
        or is complete before the last); the matcher stays where it was."""
        consumed = 0
        for t in drafts:
            if self._m.is_stopped() or not self._m.try_consume_tokens([t]):
                break
            consumed += 1
        if consumed == len(drafts):
            fill_next_token_bitmask(self._m, bitmask, row)
        if consumed:
            self._m.rollback(consumed)


class TokenMatcher(Grammar, Protocol):
    """A request's grammar with its masks: a GrammarMatcher, or a ThinkingGate (thinking_gate.py), which
    refuses nothing in some phases (`constrains` false: the step needs no mask for it)."""

    @property
    def constrains(self) -> bool: ...
    def fill(self, bitmask: np.ndarray, row: int, drafts: Sequence[int] = ()) -> None: ...
    def fill_after(self, bitmask: np.ndarray, row: int, drafts: Sequence[int]) -> None: ...


def matcher(grammar: Grammar | None) -> TokenMatcher | None:
    """A request's grammar as the engine made it (the core holds it by its Grammar protocol, which leaves
    out the masks: numpy is not the core's); None when it has none or refuses nothing now."""
    m = cast("TokenMatcher | None", grammar)
    return m if m is not None and m.constrains else None


def draft_bitmask(rows: Sequence[tuple[Grammar | None, Sequence[int]]], vocab_size: int) -> np.ndarray | None:
    """For a draft model: per (matcher or None, drafts so far) entry, one row, the tokens its grammar
    allows after those drafts (every bit set without a grammar, or when a draft was refused: the
    engine cuts such drafts anyway). None when no entry has a grammar."""
    if all(m is None for m, _ in rows):
        return None
    bitmask = np.full((len(rows), (vocab_size + 31) // 32), -1, dtype=np.int32)
    for i, (grammar, drafts) in enumerate(rows):
        if (m := matcher(grammar)) is not None:
            m.fill_after(bitmask, i, drafts)
    return bitmask


def grammar_bitmask(rows: Sequence[tuple[Grammar | None, Sequence[int]]],
                    vocab_size: int) -> np.ndarray | None:
    """The masks of a step's sampling rows: per (matcher or None, draft tokens) entry, 1 + len(drafts)
    rows; [R, ceil(V / 32)] int32 with every bit set in rows without a grammar. None when no entry has one."""
    if all(m is None for m, _ in rows):
        return None
    bitmask = np.full((sum(1 + len(d) for _, d in rows), (vocab_size + 31) // 32), -1, dtype=np.int32)
    row = 0
    for grammar, drafts in rows:
        if (m := matcher(grammar)) is not None:
            m.fill(bitmask, row, drafts)
        row += 1 + len(drafts)
    return bitmask
