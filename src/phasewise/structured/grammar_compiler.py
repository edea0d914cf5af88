"""GrammarCompiler: StructuredOutputs → GrammarMatcher for one tokenizer, with compiled grammars cached."""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import llguidance
from llguidance import LLMatcher, LLTokenizer

from phasewise.sampling.params import ConstraintError, StructuredOutputs
from phasewise.structured.grammar_matcher import GrammarMatcher

# JSON as one line with OpenAI's separators: no free whitespace a small model could loop in
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _one_line(message: str) -> str:
    """llguidance's messages span lines (a caret under the spot): the first line and any 'error:' line."""
    lines = [line.strip() for line in message.strip().splitlines()]
    return " ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))]) if lines else message


class GrammarCompiler:
    """Compiles constraints for one tokenizer (a `tokenizers.Tokenizer`) over a vocabulary of
    vocab_size logits; eos_token_ids end an output whose grammar is complete.

    llguidance's view of the tokenizer takes 0.5 s (49k tokens) to 1.6 s (152k) to build: it is built
    on first use, or in the background after `prepare()`. Compiled grammars are kept (the latest
    CACHE_SIZE); each request gets its own copy of the matcher."""

    CACHE_SIZE = 256

    def __init__(self, backend_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._backend = backend_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Future[LLTokenizer] | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], LLMatcher] = OrderedDict()

    def prepare(self) -> None:
        """Start building the tokenizer view on a thread (so a first constrained request does not wait)."""
        self._future(background=True)

    def _future(self, background: bool) -> Future[LLTokenizer]:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = Future()
                run = threading.Thread(target=self._build, daemon=True).start if background else self._build
                run()
            return self._tokenizer

    def _build(self) -> None:
        try:
            backend = copy.copy(self._backend)       # padding and truncation off, as llguidance.hf does
            backend.no_padding()
            backend.no_truncation()
            n = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
            text = _padding_special(backend.to_str())
            self._tokenizer.set_result(LLTokenizer(text, n_vocab=n, eos_token=self._eos or None))
        except Exception as e:   # surfaces in every compile
            self._tokenizer.set_exception(e)

    def compile(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for the constraint; ConstraintError (a ValueError) naming the problem when it is
        invalid."""
        key = (spec.kind, spec.text, spec.strict)
        template = self._cache.get(key)
        if template is None:
            tokenizer = self._future(background=False).result()
            template = LLMatcher(tokenizer, self._grammar(spec), log_level=0)
            if template.is_error():
                raise ConstraintError(f"invalid {_NAMES[spec.kind]}: {_one_line(template.get_error())}")
            self._cache[key] = template
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return GrammarMatcher(template.deep_copy())

    @staticmethod
    def _grammar(spec: StructuredOutputs) -> str:
        """llguidance's grammar text for the constraint."""
        text = spec.text
        try:
            if spec.kind == "json":
                return LLMatcher.grammar_from_json_schema(text, defaults={**JSON_OPTIONS, "lenient": not spec.strict})
            if spec.kind == "grammar":   # Lark as it is; GBNF converted to Lark
                return llguidance.grammar_from("grammar", text)
            if spec.kind == "regex":     # \d and \w mean ASCII digits and word characters, as in JSON schema
                return LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(text, 'dw')}/")
            return llguidance.grammar_from(spec.kind, text)
        except ValueError as e:
            raise ConstraintError(f"invalid {_NAMES[spec.kind]}: {_one_line(str(e))}") from None


def _padding_special(tokenizer_json: str) -> str:
    """GGUF vocabularies pad the embedding with ordinary tokens "[PAD151665]" ... (Qwen2.5): declared
    special here, so no grammar lets the model spell text with them (their logits are untrained)."""
    if "[PAD" not in tokenizer_json:
        return tokenizer_json
    data = json.loads(tokenizer_json)
    known = {t["id"] for t in data.get("added_tokens", [])}
    pads = [(i, piece) for piece, i in data["model"].get("vocab", {}).items()
            if _PAD.fullmatch(piece) and i not in known]
    data.setdefault("added_tokens", []).extend(
        {"id": i, "content": piece, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for i, piece in pads)
    return json.dumps(data)


_PAD = re.compile(r"\[PAD\d+\]")
_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}
