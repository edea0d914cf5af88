"""ThinkingGate: one reply's thinking block (SamplingParams.thinking), tracked token by token and kept in
its budget; the structured output, if any, holds after the block.

It stands where a request's grammar stands (`Request.grammar`), so the engine's one path for masks
serves it: continuous batching (a row's mask), speculation (drafts cut at the first refused token,
masks after drafts: `valid_prefix`, `fill`), preemption (only committed tokens advance it). Phases:

  lead      the output's start, when the prompt left no block open (nor closed one just before the
            reply, as a template that turns thinking off does): the reply may open one with the
            start tag (with a grammar: its tokens as the tokenizer writes them, or the grammar's first
            token); anything else makes it all answer
  thinking  counted; the end tag (found in the text, however it is split) ends it; no end of sequence
            while a budget or a grammar holds; at the budget the closing tokens are forced (its last few
            tokens may not leave a character unfinished: utf8_masks.py)
  closing   forced: the end tag and what the template writes after it (after a natural end, with a
            grammar: only what follows the tag, so the grammar starts where the answer does)
  answer    the grammar's (or free)

A grammar whose own text opens with the start tag spells the block itself: it holds from the first
token, the gate only counts (and the budget gives way). Plain Python and numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal, Protocol

import numpy as np

from phasewise.core.request import RequestMetrics
from phasewise.core.sampling_params import ThinkingBlock
from phasewise.structured.grammar_matcher import GrammarMatcher
from phasewise.structured.utf8_masks import BROKEN, WINDOW, Utf8Masks, utf8_after

Phase = Literal["lead", "thinking", "closing", "answer"]


@dataclass(frozen=True)
class Tags:
    """A ThinkingBlock's tags for one tokenizer: as text (bytes) and as the tokenizer writes them."""
    start: bytes
    end: bytes
    start_ids: tuple[int, ...]
    close_ids: tuple[int, ...]       # end + after_end
    after_ids: tuple[int, ...]       # after_end alone


@dataclass(frozen=True)
class _State:
    phase: Phase
    n_out: int = 0                   # output tokens taken
    lead: bytes = b""                # lead: the output's text so far
    lead_ids: tuple[int, ...] = ()   # lead, with a grammar: start-tag tokens taken so far
    thought: int = 0                 # thinking tokens (not the one completing the end tag)
    tail: bytes = b""                # thinking: the latest bytes, to find the end tag across tokens
    pending: int = 0                 # thinking: continuation bytes its last character still needs
    forced: tuple[int, ...] = ()     # closing: the tokens still to force
    inner_taken: int = 0             # tokens the grammar has consumed
    answer_start: int | None = None  # output index of the answer's first token


class ThinkingGate:
    """tags: the block's (Tags); budget: thinking tokens at most (None: unlimited); inner: the grammar of
    the answer (None: free); start: where the prompt leaves the reply (`ThinkingGates.start`); metrics:
    stamped with the thinking tokens and the answer's start as tokens are committed; utf8: the vocabulary's
    masks that keep the thinking whole UTF-8 at the budget (None: not kept)."""

    def __init__(self, tags: Tags, budget: int | None, inner: GrammarMatcher | None,
                 token_bytes: Callable[[int], bytes], eos_token_ids: frozenset[int], start: Phase,
                 metrics: RequestMetrics, utf8: Utf8Masks | None = None) -> None:
        self.tags, self.budget, self._inner, self._bytes, self._utf8 = tags, budget, inner, token_bytes, utf8
        self._eos, self._metrics = sorted(eos_token_ids), metrics
        metrics.thinking_tracked = True
        self._error: str | None = None
        # the grammar writes the start tag itself: it spells the block, and holds from the first token
        self.whole = start == "lead" and inner is not None and \
            inner.valid_prefix(tags.start_ids) == len(tags.start_ids)
        self._s = self._enter_thinking(_State("lead")) if start == "thinking" else \
            _State("answer", answer_start=0) if start == "answer" else _State("lead")
        if start == "answer":
            metrics.answer_start = 0

    # ---- the Grammar protocol (core/request.py) and the masks (structured/grammar_matcher.py) ----------

    @property
    def constrains(self) -> bool:
        """Some token is refused here (the step needs this row's mask)."""
        phase = self._s.phase
        if self._inner_holds:
            return self._inner is not None
        return phase == "closing" or self.budget is not None or self._inner is not None

    @property
    def finished(self) -> bool:
        inner = self._inner
        return self._error is not None or (inner is not None and self._inner_holds and inner.finished)

    @property
    def error(self) -> str | None:
        return self._error or (self._inner.error if self._inner is not None else None)

    @property
    def phase(self) -> Phase:
        return self._s.phase

    def accept(self, token_id: int) -> bool:
        """Advance past a committed token; False (and `error` set) if it is refused here."""
        if not self._allows(token_id):
            if self._inner is not None and self._inner_holds:
                self._inner.accept(token_id)          # the grammar records why
            else:
                self._error = f"the thinking block allows no token {token_id} in its {self._s.phase} phase"
            return False
        self._advance(token_id)
        m, s = self._metrics, self._s
        m.thinking_tokens = s.thought
        if m.answer_start is None and s.answer_start is not None:
            m.answer_start = s.answer_start
        return True

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of these tokens, in order, are allowed from here (draft tokens)."""
        saved, n = self._s, 0
        for i, t in enumerate(token_ids):
            if self._inner is not None and self._inner_holds:     # the grammar's own check, which consumes
                # nothing (an end of sequence cannot roll back)
                n += self._inner.valid_prefix(token_ids[i:])
                break
            if self.finished or not self._allows(t):
                break
            self._advance(t)
            n += 1
        self._restore(saved)
        return n

    def fill(self, bitmask: np.ndarray, row: int, drafts: Sequence[int] = ()) -> None:
        """bitmask[row]: the tokens allowed next; bitmask[row + i + 1]: after drafts 0..i (all allowed)."""
        saved = self._s
        try:
            for i in range(len(drafts) + 1):
                if self._inner is not None and self._inner_holds:
                    self._inner.fill(bitmask, row + i, drafts[i:])
                    break
                self._fill_row(bitmask, row + i)
                if i == len(drafts) or self.finished:
                    break
                if not self._allows(drafts[i]):
                    raise ValueError(f"draft token {drafts[i]} is not allowed in the thinking block's "
                                     f"{self._s.phase} phase")
                self._advance(drafts[i])
        finally:
            self._restore(saved)

    def fill_after(self, bitmask: np.ndarray, row: int, drafts: Sequence[int]) -> None:
        """bitmask[row]: the tokens allowed after these drafts (left as it is if one is refused)."""
        saved = self._s
        for i, t in enumerate(drafts):
            if self._inner is not None and self._inner_holds:
                self._inner.fill_after(bitmask, row, drafts[i:])
                break
            if self.finished or not self._allows(t):
                break
            self._advance(t)
        else:
            self._fill_row(bitmask, row)
        self._restore(saved)

    # ---- the phases ------------------------------------------------------------------------------------

    @property
    def _inner_holds(self) -> bool:
        return self.whole or self._s.phase == "answer"

    def _allows(self, t: int) -> bool:
        s, inner = self._s, self._inner
        if self._inner_holds:
            return inner is None or inner.valid_prefix([t]) == 1
        if s.phase == "closing":
            return t == s.forced[0]
        if s.phase == "thinking":
            if self.constrains and t in self._eos:
                return False
            left = self._left(s)
            return left is None or self._utf8 is None or self._utf8.allows(s.pending, self._bytes(t), left)
        if inner is None:                              # lead, free
            return True
        ids = (*s.lead_ids, t)
        return self.tags.start_ids[:len(ids)] == ids or inner.valid_prefix(ids) == len(ids)

    def _advance(self, t: int) -> None:
        s = replace(self._s, n_out=self._s.n_out + 1)
        if self._inner_holds and self._inner is not None:
            self._inner.accept(t)
            s = replace(s, inner_taken=s.inner_taken + 1)
        if t in self._eos:                             # an end of sequence is no text of any phase
            pass
        elif s.phase == "lead":
            s = self._lead_ids(s, t) if self._inner is not None and not self.whole else self._lead_text(s, t)
        elif s.phase == "thinking":
            s = self._think(s, self._bytes(t))
        elif s.phase == "closing":
            s = replace(s, forced=s.forced[1:]) if len(s.forced) > 1 else self._answer(s)
        self._s = s

    def _lead_text(self, s: _State, t: int) -> _State:
        """The output's start as text: the start tag (after whitespace) opens the block."""
        text = s.lead + self._bytes(t)
        start = text.lstrip()
        if start.startswith(self.tags.start):
            s = self._enter_thinking(replace(s, lead=b""))
            return self._think(s, start[len(self.tags.start):], count=False) if s.phase == "thinking" else s
        if self.tags.start.startswith(start):
            return replace(s, lead=text)
        return replace(s, phase="answer", lead=b"", answer_start=0)

    def _lead_ids(self, s: _State, t: int) -> _State:
        """With a grammar: the start tag's own tokens open the block; any other token is the grammar's
        (with the tag's tokens taken so far)."""
        ids = (*s.lead_ids, t)
        if self.tags.start_ids[:len(ids)] == ids:
            return self._enter_thinking(replace(s, lead_ids=())) if ids == self.tags.start_ids \
                else replace(s, lead_ids=ids)
        assert self._inner is not None
        for held in ids:
            self._inner.accept(held)
        return replace(s, phase="answer", lead_ids=(), inner_taken=s.inner_taken + len(ids), answer_start=0)

    def _left(self, s: _State) -> int | None:
        """Thinking tokens the budget leaves (this one included; None: no budget holds)."""
        return None if self.budget is None or self.whole else self.budget - s.thought

    def _enter_thinking(self, s: _State) -> _State:
        s = replace(s, phase="thinking", tail=b"", pending=0)
        return self._close(s) if self.budget == 0 and not self.whole else s

    def _think(self, s: _State, data: bytes, count: bool = True) -> _State:
        """Thinking text; the end tag ends the block, the budget closes it."""
        end = self.tags.end
        tail = s.tail + data
        if end in tail:
            if self.whole or self._inner is None or not self.tags.after_ids:
                return self._answer(s)
            return replace(s, phase="closing", forced=self.tags.after_ids, tail=b"")
        pending = utf8_after(s.pending, data)
        s = replace(s, thought=s.thought + count, tail=tail[-(len(end) - 1):] if len(end) > 1 else b"",
                    pending=0 if pending == BROKEN else pending)
        if self.budget is not None and s.thought >= self.budget and not self.whole:
            return self._close(s)
        return s

    def _close(self, s: _State) -> _State:
        return replace(s, phase="closing", forced=self.tags.close_ids, tail=b"")

    @staticmethod
    def _answer(s: _State) -> _State:
        return replace(s, phase="answer", forced=(), tail=b"", answer_start=s.n_out)

    def _restore(self, saved: _State) -> None:
        n = self._s.inner_taken - saved.inner_taken
        if n and self._inner is not None:
            self._inner.rollback(n)
        self._s = saved

    def _fill_row(self, bitmask: np.ndarray, row: int) -> None:
        """The allowed tokens of the next position into bitmask[row] (which starts with every bit set)."""
        s, inner, words = self._s, self._inner, bitmask[row].view(np.uint32)
        if self._inner_holds:
            if inner is not None:
                inner.fill(bitmask, row)
        elif s.phase == "closing":
            words[:] = 0
            _set(words, s.forced[0])
        elif s.phase == "thinking":
            if self.constrains:
                for t in self._eos:
                    if t >> 5 < len(words):
                        words[t >> 5] &= ~np.uint32(1 << (t & 31))
            left = self._left(s)
            if left is not None and left <= WINDOW and self._utf8 is not None:
                words &= self._utf8.words(s.pending, left, len(words))
        elif inner is not None:                        # lead: the grammar's tokens, or the start tag's next
            if inner.valid_prefix(s.lead_ids) == len(s.lead_ids):
                inner.fill_after(bitmask, row, s.lead_ids)
            else:
                words[:] = 0
            if len(s.lead_ids) < len(self.tags.start_ids):
                _set(words, self.tags.start_ids[len(s.lead_ids)])


def _set(words: np.ndarray, t: int) -> None:
    if t >> 5 < len(words):
        words[t >> 5] |= np.uint32(1 << (t & 31))


class TagTokenizer(Protocol):
    """What the gates read of a tokenizer (phasewise.tokenization.tokenizer.Tokenizer has it)."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


class ThinkingGates:
    """Makes the gates of one engine's requests: the tags of each ThinkingBlock encoded once, token bytes
    cached, the prompt read for an open block."""

    TAIL = 64          # prompt tokens decoded first to find the block's tags (then the whole prompt)

    def __init__(self, tokenizer: TagTokenizer, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer, self._eos = tokenizer, eos_token_ids
        self._bytes = lru_cache(maxsize=1 << 17)(tokenizer.token_bytes)
        self._tags = lru_cache(maxsize=16)(self._encode)
        self._utf8 = Utf8Masks(self._bytes, tokenizer.vocab_size)

    def _encode(self, block: ThinkingBlock) -> Tags:
        def ids(text: str) -> tuple[int, ...]:
            return tuple(self._tokenizer.encode(text, add_special_tokens=False)) if text else ()
        return Tags(block.start.encode(), block.end.encode(), ids(block.start),
                    ids(block.end + block.after_end), ids(block.after_end))

    def start(self, block: ThinkingBlock, prompt_ids: Sequence[int]) -> Phase:
        """Where the prompt leaves the reply: inside a block it opened ("thinking"), just after one it
        closed ("answer": a template that turns thinking off writes an empty block), or neither ("lead")."""
        text = self._tokenizer.decode(list(prompt_ids[-self.TAIL:]), skip_special_tokens=False)
        if block.start not in text and block.end not in text and len(prompt_ids) > self.TAIL:
            text = self._tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        if text.rfind(block.start) > text.rfind(block.end):
            return "thinking"
        return "answer" if text.rstrip().endswith(block.end) else "lead"

    def gate(self, block: ThinkingBlock, prompt_ids: Sequence[int], inner: GrammarMatcher | None,
             metrics: RequestMetrics) -> ThinkingGate:
        return ThinkingGate(self._tags(block), block.budget, inner, self._bytes, self._eos,
                            self.start(block, prompt_ids), metrics, self._utf8)
