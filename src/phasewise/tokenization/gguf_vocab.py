"""A `tokenizers.Tokenizer` built straight from a GGUF's tokenizer metadata (llama.cpp's keys), in about
a second for any vocabulary, where transformers' converter takes 12-28 s for Qwen's 151,936 tokens.

- `tokenizer.ggml.model` "gpt2": byte-level BPE of `tokens` and `merges`; text is split first by the
  pattern its `tokenizer.ggml.pre` names (`_SPLITS`; GPT-2's own for the rest), then spelled in the
  byte alphabet (`byte_alphabet`).
- "llama": SentencePiece's BPE with byte fallback. The merges are the file's, or every split of a
  token into two tokens ranked by the result's score (SentencePiece merges the best-scoring pair);
  Gemma's by file order. A space is "▁", prepended (Llama, Phi-3) or not (Gemma) as the file says.
- `token_type` control tokens become special added tokens, user-defined ones plain added tokens (both
  matched whole in text); the BOS / EOS / UNK / PAD texts are special; BOS and EOS are added to an
  encoding as `add_bos_token` / `add_eos_token` say (a SentencePiece vocabulary adds BOS unless told not).

Each choice gives what transformers' GGUF converter gives (tests/test_gguf_vocab.py holds the two equal
on every GGUF at hand), except where the converter loses what llama.cpp and the model's own
tokenizer.json have: the "smollm" (StarCoder) family splits every digit apart; Llama 3's and Tekken's
take a piece that is a token whole before any merge, and add BOS where the file does not say. Another
`tokenizer.ggml.model` (t5, bert, ...) is an UnsupportedVocab.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from phasewise.loading.gguf_header import GGUFValue, read_header

if TYPE_CHECKING:
    from phasewise.json_types import JsonValue

TOKENS, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4          # llama.cpp's token types (5: unused, 6: byte)
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
               "pad_token": "padding_token_id"}
SPACE = "\u2581"                                             # SentencePiece's "▁"
GEMMA = ("gemma", "gemma2", "gemma3")                        # architectures whose merges follow file order


def _pattern(words: Sequence[str], digits: str, punctuation: str) -> str:
    """A split pattern of the GPT-4 family: contractions or words, digits, punctuation runs, spaces."""
    return "|".join([*words, digits, punctuation, r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LEAD = r"[^\r\n\p{L}\p{N}]?"
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CASED = [f"{_LEAD}{_UPPER}*{_LOWER}+", f"{_LEAD}{_UPPER}+{_LOWER}*"]      # Tekken / GPT-4o: camelCase apart
_LLAMA3 = _pattern([_CONTRACTION, _LEAD + r"\p{L}+"], r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*")
_QWEN2 = _pattern([_CONTRACTION, _LEAD + r"\p{L}+"], r"\p{N}", r" ?[^\s\p{L}\p{N}]+[\r\n]*")
_QWEN35 = _pattern([_CONTRACTION, _LEAD + r"[\p{L}\p{M}]+"], r"\p{N}", r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*")
_TEKKEN = _pattern(_CASED, r"\p{N}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*")
_GPT4O = _pattern([w + _CONTRACTION + "?" for w in _CASED], r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*")
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35, "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
# GPT-2's split after every digit on its own (llama.cpp's StarCoder family).
_DIGITS_APART = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
# A piece that is a token is taken whole, before any merge (tiktoken's rule); BOS unless the file says not.
_WHOLE_PIECES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                 "jina-v5-nano", "tekken")


class UnsupportedVocab(ValueError):
    """A GGUF tokenizer this module does not build (another `tokenizer.ggml.model`)."""


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer a GGUF describes."""
    backend: RustTokenizer
    # tokenizer_config.json's fields: the special tokens' texts, add_bos/eos_token
    config: dict[str, JsonValue]
    chat_template: str | None


def read_vocab(path: Path) -> GGUFVocab:
    """The tokenizer of the GGUF at `path` (UnsupportedVocab; ValueError for a malformed file or none)."""
    with paused_gc():
        fields, _ = read_header(path, strings=(TOKENS, MERGES))
        return build_vocab(fields)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector paused: a vocabulary makes a million objects (strings, merge pairs, added
    tokens), none in a cycle, and the collections their allocation sets off cost ~0.2 s."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_vocab(fields: Mapping[str, GGUFValue]) -> GGUFVocab:
    """The tokenizer described by a GGUF's metadata."""
    kind, tokens = fields.get("tokenizer.ggml.model"), _strings(fields, TOKENS)
    if not tokens:
        raise ValueError("the file holds no vocabulary (tokenizer.ggml.tokens)")
    types = _numbers(fields, "tokenizer.ggml.token_type", len(tokens), NORMAL)
    if kind == "gpt2":
        spelled, alphabet = _spelled_in_bytes(tokens), set(byte_alphabet())
        backend = _byte_level(fields, spelled)
    elif kind == "llama":
        gemma = fields.get("general.architecture") in GEMMA
        spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens] if gemma else tokens
        backend, alphabet = _sentencepiece(fields, spelled, gemma), None
    else:
        raise UnsupportedVocab(f"no builder for tokenizer.ggml.model {str(kind)[:40]!r}")
    names = {name: tokens[i] for name, key in SPECIAL_IDS.items()
             if isinstance(i := fields.get(f"tokenizer.ggml.{key}"), int) and 0 <= i < len(tokens)}
    _add_tokens(backend, tokens, types, set(spelled), alphabet, names.values())
    bos_default = kind == "llama" or fields.get("tokenizer.ggml.pre") in _WHOLE_PIECES
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", bos_default)) and "bos_token" in names
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in names
    backend.post_processor = _post_processor(backend, names.get("bos_token") if add_bos else None,
                                             names.get("eos_token") if add_eos else None)
    config: dict[str, JsonValue] = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", **names,
                                    "add_bos_token": add_bos, "add_eos_token": add_eos}
    template = fields.get("tokenizer.chat_template")
    return GGUFVocab(backend, config, template if isinstance(template, str) and template else None)


def _strings(fields: Mapping[str, GGUFValue], key: str) -> list[str]:
    value = fields.get(key)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return cast("list[str]", value)
    return []


def _numbers(fields: Mapping[str, GGUFValue], key: str, n: int, default: float) -> list[float]:
    """A numeric array of n entries (the default where the file has none or another length)."""
    value = fields.get(key)
    if isinstance(value, list) and len(value) == n and all(isinstance(v, (int, float)) for v in value[:1]):
        return cast("list[float]", value)         # numpy's tolist of a numeric array: all numbers
    return [default] * n


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet, the character of each byte: printable bytes stand for themselves,
    the others for the code points from 256 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def _spelled_in_bytes(tokens: list[str]) -> list[str]:
    """The tokens in the byte alphabet (a file's tokens mostly are; one that is not is re-spelled from its
    UTF-8 bytes)."""
    alphabet = byte_alphabet()
    foreign = re.compile("[^" + re.escape("".join(alphabet)) + "]")
    if not foreign.search("\u0100".join(tokens)):           # U+0100 is in the alphabet: one scan for all
        return tokens
    return [t if not foreign.search(t) else "".join(alphabet[b] for b in t.encode()) for t in tokens]


def _byte_level(fields: Mapping[str, GGUFValue], spelled: list[str]) -> RustTokenizer:
    """Byte-level BPE over `spelled` (the tokens in the byte alphabet)."""
    merges = _strings(fields, MERGES)
    if not merges:
        raise UnsupportedVocab("a byte-level vocabulary without tokenizer.ggml.merges")
    pre = str(fields.get("tokenizer.ggml.pre", "default"))
    model = models.BPE(dict(zip(spelled, range(len(spelled)))), [_pair(m) for m in merges], dropout=None,
                       continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                       byte_fallback=False, ignore_merges=pre in _WHOLE_PIECES)
    tok = RustTokenizer(model)
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]) \
            if pre in _DIGITS_APART else gpt2
    tok.decoder = decoders.ByteLevel()            # (its defaults: add_prefix_space, trim_offsets, use_regex)
    return tok


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _sentencepiece(fields: Mapping[str, GGUFValue], spelled: list[str], gemma: bool) -> RustTokenizer:
    """SentencePiece's BPE over `spelled` (the tokens, Gemma's runs of spaces as "▁"s)."""
    merges = [_pair(m) for m in _strings(fields, MERGES)]
    if not merges:
        scores = [-float(i) for i in range(len(spelled))] if gemma else \
            _numbers(fields, "tokenizer.ggml.scores", len(spelled), 0.0)
        merges = _merges_by_score(spelled, scores)
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    unk_text = spelled[unk] if isinstance(unk, int) and 0 <= unk < len(spelled) else None
    tok = RustTokenizer(models.BPE(dict(zip(spelled, range(len(spelled)))), merges, dropout=None,
                                   fuse_unk=True, byte_fallback=True, unk_token=unk_text))
    cleanup = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:                                       # spaces as "▁", nothing prepended
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(cleanup)
        return tok
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    if fields.get("general.architecture") == "phi3":  # "▁" prepended by the normalizer: "  hi" → "▁▁▁hi"
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, split=False,
                                                     prepend_scheme="first" if prefix else "never")
    tok.decoder = decoders.Sequence(cleanup + [decoders.Strip(" ", 1, 0)] * prefix)
    return tok


def _merges_by_score(tokens: list[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, as the merge making it, best first: by the token's score
    (higher first), then the longer left piece, then the file's order (transformers' converter's order).
    The splits are found by hashing every prefix and suffix of every token against the tokens' hashes,
    in numpy: Gemma's 262,144 tokens split 1.2 million ways, 0.7 s with the sort where a Python loop over
    them takes 1.5-2 s. (Two strings sharing a 64-bit hash would make a merge of no token: BPE refuses it.)"""
    prefix_hash = _prefix_hashes("".join(tokens))
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    whole = _hash(prefix_hash, starts, ends)
    by_hash = np.argsort(whole, kind="stable")   # a repeated token: its first place (below), its last score
    known = whole[by_hash]
    first = np.ones(len(tokens), dtype=bool)
    first[by_hash[1:][known[1:] == known[:-1]]] = False
    last = by_hash[np.searchsorted(known, whole, side="right") - 1]
    pieces = np.where(first, np.maximum(lengths - 1, 0), 0)     # a token of n characters splits n - 1 ways
    owner = np.repeat(np.arange(len(tokens)), pieces)
    cut = np.arange(len(owner)) - np.repeat(np.cumsum(pieces) - pieces, pieces) + 1
    mid = starts[owner] + cut
    left = _find(known, _hash(prefix_hash, starts[owner], mid))
    owner, cut, mid, left = owner[left >= 0], cut[left >= 0], mid[left >= 0], left[left >= 0]
    right = _find(known, _hash(prefix_hash, mid, ends[owner]))
    owner, cut, left, right = owner[right >= 0], cut[right >= 0], left[right >= 0], right[right >= 0]
    score = np.asarray(scores, dtype=np.float64)[last[owner]]
    order = np.lexsort((cut - lengths[owner], -cut, -score))      # the last key first; stable
    pick = tokens.__getitem__
    return list(zip(map(pick, by_hash[left[order]].tolist()), map(pick, by_hash[right[order]].tolist())))


def _find(known_sorted: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Where each value is in known_sorted (its first place), -1 where it is not."""
    at = np.minimum(np.searchsorted(known_sorted, values), len(known_sorted) - 1)
    return np.where(known_sorted[at] == values, at, -1)


_BASE = 0x100000001B3                            # odd, so invertible modulo 2**64
_INVERSE = pow(_BASE, -1, 1 << 64)


def _prefix_hashes(text: str) -> tuple[np.ndarray, np.ndarray]:
    """(H, inverse powers) of `text`: H[j] = sum of (code point i + 1) * BASE**i over i < j, modulo 2**64
    (numpy's uint64 arithmetic wraps), so that a substring's hash is independent of where it starts."""
    code = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) + np.uint64(1)
    powers = np.full(len(code) + 1, _BASE, dtype=np.uint64)
    powers[0] = 1
    inverse = np.full(len(code) + 1, _INVERSE, dtype=np.uint64)
    inverse[0] = 1
    return np.concatenate([[np.uint64(0)], np.cumsum(code * np.cumprod(powers)[:-1])]), np.cumprod(inverse)


def _hash(prefix_hash: tuple[np.ndarray, np.ndarray], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The hashes of text[a:b] (element-wise)."""
    h, inverse = prefix_hash
    return (h[b] - h[a]) * inverse[a]


def _add_tokens(backend: RustTokenizer, tokens: list[str], types: Sequence[float], spelled: set[str],
                alphabet: set[str] | None, named: Iterable[str]) -> None:
    """Control tokens (and the named special tokens) as special added tokens, user-defined ones as plain
    added tokens: each matched whole in text. A byte-level vocabulary's control token outside its
    alphabet is a mislabelled one and left out (it would grow the vocabulary). One call: each call
    rebuilds the matcher of every added token (0.3 s for Qwen3.5's padding of 96k)."""
    special = [t for t, kind in zip(tokens, types)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    seen = set(special)
    special += [t for t in dict.fromkeys(named) if t not in seen and t in spelled]
    plain = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in spelled]
    backend.add_tokens([AddedToken(t, normalized=False, special=True) for t in special] +
                       [AddedToken(t, normalized=False, special=False) for t in plain])


def _post_processor(backend: RustTokenizer, bos: str | None,
                    eos: str | None) -> processors.TemplateProcessing:
    """BOS and EOS around a sequence, where the file adds them (a pair: around each sequence)."""
    def one(seq: str, type_id: int) -> str:
        return " ".join([*([f"{bos}:{type_id}"] if bos else []), f"${seq}:{type_id}",
                         *([f"{eos}:{type_id}"] if eos else [])])

    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=one("A", 0), pair=f"{one('A', 0)} {one('B', 1)}",
                                         special_tokens=specials)
