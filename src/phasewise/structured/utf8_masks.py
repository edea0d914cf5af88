"""Utf8Masks: which tokens keep a text whole UTF-8 within a few tokens, so a thinking block closed at its
budget never cuts a character in two (a byte-level BPE writes a rare character as several tokens: cut after
the first, the text would end in U+FFFD).

A text's state is the count of continuation bytes its last character still needs (0: whole; 1-3). With r
tokens left, a token is allowed when its bytes follow the state as UTF-8 and leave at most r - 1 bytes still
needed (every byte has a token of its own in a byte-level vocabulary, so r - 1 tokens can finish it).
Plain Python and numpy; the vocabulary's table is built once, when first needed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

BROKEN = 4          # not UTF-8 from that state (a lead byte where a continuation was due, or the reverse)
# tokens left at which the masks start to refuse (no character needs more than 3 more bytes)
WINDOW = 3


def utf8_after(state: int, data: bytes) -> int:
    """The continuation bytes still needed after `data`, from `state` (BROKEN: data does not follow it)."""
    for b in data:
        if b & 0xC0 == 0x80:                 # a continuation byte
            if state == 0:
                return BROKEN
            state -= 1
        elif state:
            return BROKEN
        elif b >= 0x80:
            state = 1 if b & 0xE0 == 0xC0 else 2 if b & 0xF0 == 0xE0 else 3 if b & 0xF8 == 0xF0 else BROKEN
            if state == BROKEN:
                return BROKEN
    return state


class Utf8Masks:
    """For one vocabulary (token id → its bytes, `size` ids): the allowed tokens for a state and the tokens
    left, as a bitmask row's words (bit t of word t >> 5)."""

    def __init__(self, token_bytes: Callable[[int], bytes], size: int) -> None:
        self._bytes, self._size = token_bytes, size
        self._finals: np.ndarray | None = None            # [4 states, size]: the state after each token
        self.words = lru_cache(maxsize=64)(self._words)

    def allows(self, state: int, token_bytes: bytes, left: int) -> bool:
        """Whether a token with these bytes may come with `left` tokens left (this one included)."""
        return left > WINDOW or utf8_after(state, token_bytes) <= left - 1

    def _table(self) -> np.ndarray:
        if self._finals is None:
            finals = np.full((4, self._size), BROKEN, dtype=np.uint8)
            for t in range(self._size):
                data = self._bytes(t)
                if data.isascii():                 # most tokens: whole after state 0, broken after the others
                    finals[0, t] = 0
                    if not data:
                        finals[1:, t] = (1, 2, 3)
                    continue
                for state in range(4):
                    finals[state, t] = utf8_after(state, data)
            self._finals = finals
        return self._finals

    def _words(self, state: int, left: int, n_words: int) -> np.ndarray:
        """The allowed tokens as n_words uint32 words (ids past the vocabulary allowed: others refuse
        them)."""
        allowed = np.ones(n_words * 32, dtype=bool)
        n = min(self._size, n_words * 32)
        allowed[:n] = self._table()[state, :n] <= left - 1
        return np.packbits(allowed, bitorder="little").view("<u4").astype(np.uint32)
