"""Prompt-lookup (n-gram) proposer: plain Python, no model.

If the last n tokens of a request (prompt and output so far) occurred earlier, the
tokens that followed that occurrence are proposed as drafts. Longer n are tried first
(max_n down to min_n); the latest earlier occurrence wins. Each request keeps an index
n-gram -> end of its latest occurrence, updated with only the tokens added since the
last step, so a proposal costs O(max_n - min_n + 1) dictionary lookups.
"""

from __future__ import annotations

from collections.abc import Sequence

from phasewise.core.handoffs import ScheduledChunk
from phasewise.runner.request_state import RequestState


class NgramIndex:
    """One request's n-grams (min_n..max_n), each mapped to the end of its latest occurrence that
    has at least one token after it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 1            # n-grams ending before every position < indexed are in the maps

    def update(self, tokens: list[int]) -> None:
        for end in range(self.indexed, len(tokens)):   # tokens[end] follows the n-gram ending there
            for n, index in self.maps.items():
                if end >= n:
                    index[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        self.update(tokens)
        for n in sorted(self.maps, reverse=True):
            if len(tokens) <= n:
                continue
            end = self.maps[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


class NgramProposer:
    wants_hidden = False

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState]) -> None:
        for c, req in zip(chunks, states):
            index = req.spec
            if not isinstance(index, NgramIndex):
                index = req.spec = NgramIndex(self.min_n, self.max_n)
            c.draft_token_ids = index.propose(req.token_ids, c.max_draft_tokens)
            c.draft_probs = None                # a point mass on each draft
