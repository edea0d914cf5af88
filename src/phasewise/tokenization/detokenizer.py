"""IncrementalDetokenizer: a request's generated ids as text deltas, stop strings held back."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phasewise.tokenization.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated ids into text deltas as they arrive: never emits half a UTF-8 character,
    and holds back text that might be the start of a stop string; the final text never contains the stop
    string.

    Decoding follows vLLM/TGI: decode the window ids[prefix:] and emit what it adds to the text of
    ids[prefix:read], waiting while it ends with U+FFFD (an incomplete character). The window starts
    with a few prompt tokens as context. When several stop strings match, the one that completes
    first wins (ties: the longer), so the result does not depend on how ids are chunked.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: Iterable[str] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        stop = [stop] if isinstance(stop, str) else stop
        self._stops = list(dict.fromkeys(s for s in stop if s))
        self._ids = [int(i) for i in list(prompt_ids)[-self.CONTEXT_TOKENS :]]
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith("\ufffd"):  # prompt ends mid-character: no clean context
            self._ids, self._prefix_text = [], ""
        self._read = len(self._ids)  # window = self._ids (starts at the prefix offset); read offset within it
        self._pending = ""  # decoded but held back: a suffix that could start a stop string
        self._finished = False
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stops)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: list[int]) -> str:
        """Feed new ids; return the newly released text (possibly "")."""
        if self.stopped or self._finished or not token_ids:
            return ""
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._release(delta, final=False)

    def finish(self) -> str:
        """Release everything still held back (incomplete bytes, possible stop-string starts)."""
        if self.stopped or self._finished:
            return ""
        self._finished = True
        delta = self._decode(self._ids)[len(self._prefix_text) :]
        return self._release(delta, final=True)

    def _release(self, delta: str, final: bool) -> str:
        buf = self._pending + delta  # a stop match cannot start in already released text
        hits = [(i + len(s), -len(s), i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            _, _, idx, self.stop_reason = min(hits)
            out, self._pending, self.stopped = buf[:idx], "", True
        else:
            keep = 0 if final else self._held_back(buf)
            out, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out

    def _held_back(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = min(len(buf), max((len(s) - 1 for s in self._stops), default=0))
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stops):
                return k
        return 0
