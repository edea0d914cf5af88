"""GrammarCompiler: StructuredOutputs → GrammarMatcher for one tokenizer, with compiled grammars cached."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Protocol

import llguidance
import tokenizers
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from phasewise.core.sampling_params import ConstraintError, StructuredOutputs
from phasewise.structured.grammar_matcher import GrammarMatcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions   # a TypedDict of llguidance's stubs only

# JSON as one line with OpenAI's separators: no free whitespace a small model could loop in
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                    "key_separator": ": "}


def _one_line(message: str) -> str:
    """llguidance's messages span lines (a caret under the spot): the first line and any 'error:' line."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines:
        return message
    return " ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))])


class GrammarCompiler:
    """Compiles constraints for one tokenizer over a vocabulary of vocab_size logits; eos_token_ids end
    an output whose grammar is complete.

    llguidance's view of the tokenizer takes 0.5 s (49k tokens) to 1.6 s (152k) to build: it is built
    on first use, or in the background after `prepare()`. Compiled grammars are kept (the latest
    CACHE_SIZE); each request gets its own copy of the matcher."""

    CACHE_SIZE = 256

    def __init__(self, vocab: Vocabulary, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._vocab = vocab
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
                build = partial(self._build, self._tokenizer)
                run = threading.Thread(target=build, daemon=True).start if background else build
                run()
            return self._tokenizer

    def _build(self, future: Future[LLTokenizer]) -> None:
        try:
            vocab = _Vocabulary(self._vocab)
            n = max(self.vocab_size, len(vocab.tokens))
            future.set_result(LLTokenizer(TokenizerWrapper(vocab), n_vocab=n, eos_token=self._eos or None))
        except Exception as e:   # surfaces in every compile
            future.set_exception(e)

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
            if _dead_end(template.deep_copy(), self.vocab_size):
                raise ConstraintError("no output this model's vocabulary can write satisfies the "
                                      f"{_NAMES[spec.kind]} (it needs text no token spells, such as "
                                      "a control character)")
            self._cache[key] = template
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return GrammarMatcher(template.deep_copy())

    @staticmethod
    def _grammar(spec: StructuredOutputs) -> str:
        """llguidance's grammar text for the constraint."""
        text, kind = spec.text, spec.kind
        try:
            if kind == "json":
                options: JsonCompileOptions = {**JSON_OPTIONS, "lenient": not spec.strict}
                return LLMatcher.grammar_from_json_schema(text, defaults=options)
            if kind == "grammar":        # Lark as it is; GBNF converted to Lark
                return llguidance.grammar_from("grammar", text)
            if kind == "regex":          # \d and \w mean ASCII digits and word characters, as in JSON schema
                return LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(text, 'dw')}/")
            return llguidance.grammar_from(kind, text)
        except ValueError as e:
            raise ConstraintError(f"invalid {_NAMES[kind]}: {_one_line(str(e))}") from None


def _dead_end(matcher: LLMatcher, vocab_size: int) -> bool:
    """After the text the grammar forces from its start, no token may follow and the grammar is not
    complete: no output can satisfy it (a regex of a byte the vocabulary lacks). Only the forced start is
    looked at: a dead end after a choice is found while generating."""
    forced = matcher.compute_ff_tokens()
    if forced and not matcher.consume_tokens(forced):
        return True
    fill_next_token_bitmask(matcher, allocate_token_bitmask(1, vocab_size), 0)
    return matcher.is_stopped() and not matcher.is_accepting()


class Vocabulary(Protocol):
    """What the compiler reads of a tokenizer (phasewise.tokenization.tokenizer.Tokenizer has it)."""

    @property
    def backend(self) -> tokenizers.Tokenizer: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class _Vocabulary:
    """A tokenizer as llguidance's TokenizerWrapper reads it: every token's bytes, the special ones
    (by id; llguidance's grammars name them as <|im_end|> or <[id]>), and text → token ids.

    llguidance's own reading of a tokenizer.json takes every added token for special, so a grammar's
    literal "<tool_call>" could never be Qwen's added token of that text (special: false), which the
    model writes: the mask allowed it (the literal's own tokenization) and the matcher then refused it.
    Here an added token is special only when the tokenizer says so, and a non-special one is its text.
    GGUF vocabularies pad the embedding with ordinary tokens "[PAD151665]" ... (Qwen2.5): special
    here, so no grammar lets the model spell text with them (their logits are untrained)."""

    bos_token_id = None

    def __init__(self, vocab: Vocabulary) -> None:
        backend = vocab.backend
        self._encode = backend.encode
        n = backend.get_vocab_size(with_added_tokens=True)
        self.tokens = [vocab.token_bytes(i) for i in range(n)]
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        special |= {i for i, t in enumerate(self.tokens)
                    if t.startswith(b"[PAD") and _PAD.fullmatch(t.decode(errors="replace"))}
        self.special_token_ids = sorted(special)
        # overridden by eos_token
        self.eos_token_id = self.special_token_ids[0] if self.special_token_ids else 0

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):   # llguidance probes with bytes: text only
            raise TypeError("text only")
        return self._encode(text, add_special_tokens=False).ids


_PAD = re.compile(r"\[PAD\d+\]")
_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}
