"""The tokenizer built from a GGUF's own metadata (tokenization/gguf_vocab.py) against transformers' GGUF
converter, the reference: the same tokens for a varied corpus (code, several languages and scripts,
emoji, whitespace runs, digits, special tokens, the chat template's output), the same text and bytes
back from ids across the vocabulary, the same special ids, added tokens and chat renderings. On every
GGUF at hand (the default model; Gemma 3 270M and Qwen2.5-Coder-0.5B where `make test` installed
them) and on small files of each kind it builds (every pre-tokenizer family, SentencePiece as Llama,
Phi-3 and Gemma have it, added and re-spelled tokens); and merges derived from scores in the
converter's order, ties and repeated tokens included.

The reference is adjusted where the converter loses what llama.cpp and the model's own tokenizer.json
have: a "smollm"-family file's digits are split one by one (Digits, then GPT-2's byte-level split;
`test_smollm_splits_digits_as_its_own_tokenizer`), and Llama 3's family takes a piece that is a token
whole (ignore_merges)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from phasewise.loading.gguf import ModelLoadError
from phasewise.loading.loader import resolve_model_path
from phasewise.tokenization.gguf_vocab import MERGES, TOKENS, _merges_by_score
from phasewise.tokenization.tokenizer import Tokenizer, _with_fallback_template

transformers = pytest.importorskip("transformers")

CORPUS = [
    "Hello, world! How're you? I'LL be there; they've gone, we'd said, it's 'quoted'.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # O(2**n)\n",
    "const xs = [1, 2, 3].map((x) => x * 2);\nconsole.log(`${xs}`); // camelCaseName, snake_case, HTTPServer",
    "int main(void) {\r\n    printf(\"%d\\n\", 42);\r\n    return 0;\r\n}\r\n",
    "Numbers: 0 7 42 123 1234 12345 3.14159 1,000,000 2024-01-31 10:45pm +49 (0)30 1234567 x  42 a 1 ½ ²",
    "Grüße aus Köln: Straße, Äpfel, ẞ, naïve café, Ærøskøbing, Łódź, Ñandú, œuvre.",
    "Привет, как дела? Ελληνικά γράμματα. مرحبا بالعالم. नमस्ते दुनिया. สวัสดีชาวโลก",
    "日本語のテキストと中文字符，还有한국어。東京都渋谷区１２３。",
    "Emoji 😀🎉 family 👩‍👩‍👧‍👦 flags 🇯🇵🇩🇪 skin 👍🏽 keycap 1️⃣ and 🦙🌸.",
    "   leading spaces, trailing spaces   \n\n\n\ttabs\t\tand\u00a0nbsp\u2003em space\r\n\r\n  \n ",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n<bos><eos><pad><unk></s><s><|endoftext|><think>",
    '{"name": "Al", "age": 3, "tags": ["a", "b"], "nested": {"k": null, "t": true}}',
    "https://example.com/path?q=1&r=two#frag — “curly” ‘single’ … · ©®™ ∑∫√∞ ≠ ≤ ⟶ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 e\u0301 ﬁ Ⅻ",
    "", " ", "\n", "a", "  ", "ab  cd", "x\n\ny", "!!!???...", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! the_quick-brown.fox",
]
MESSAGES = [{"role": "system", "content": "You are terse. Ünïcode: 🌸"}, {"role": "user", "content": "Name 2 trees."},
            {"role": "assistant", "content": "Oak, 1 ash."}, {"role": "user", "content": "  And a 3rd?\n"}]
DIGITS_APART = ("smollm",)            # files whose reference splits digits (the module's docstring)
WHOLE_PIECES = ("llama-bpe", "tekken")  # and whose reference takes a piece that is a token whole


def _transformers(path: Path, keep: bool) -> object:
    """transformers' tokenizer of a GGUF. `keep`: its conversion (12-28 s for 150k tokens) is kept in
    phasewise's cache, keyed by the file's size and first MiB and transformers' version, and read back
    by transformers as it was saved."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from phasewise.config import default_cache_dir

    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    kept = default_cache_dir() / "transformers" / f"{path.stem}-{path.stat().st_size}-{head}-gguf-tokenizer-" \
        f"{transformers.__version__}"
    if keep and kept.is_dir():
        return AutoTokenizer.from_pretrained(str(kept))
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception:       # no config transformers builds for this architecture: the tokenizer fields alone
        hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    if keep:
        partial = kept.with_name(kept.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        hf.save_pretrained(str(partial))
        config = json.loads((partial / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = "TokenizersBackend"     # read back as saved (Qwen2Tokenizer would add NFC)
        (partial / "tokenizer_config.json").write_text(json.dumps(config))
        shutil.rmtree(kept, ignore_errors=True)
        partial.rename(kept)
    return hf


def _reference(path: Path, pre: str | None, keep: bool = False) -> Tokenizer:
    hf = _transformers(path, keep)
    if pre in DIGITS_APART:
        from tokenizers import pre_tokenizers

        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    if pre in WHOLE_PIECES:
        hf.backend_tokenizer.model.ignore_merges = True
    return Tokenizer(_with_fallback_template(hf))     # a file without a template: phasewise's, on both


def _assert_same(ours: Tokenizer, ref: Tokenizer) -> None:
    """Tokens of the corpus and of the chat template's renderings, text and bytes of ids across the
    vocabulary, special ids and added tokens: ours as the reference's."""
    assert ours.has_chat_template() == ref.has_chat_template()
    chats = [ref.render_chat(MESSAGES[:n], gen) for n in (2, 4) for gen in (True, False)] \
        if ref.has_chat_template() else []
    assert [ours.render_chat(MESSAGES[:n], gen) for n in (2, 4) for gen in (True, False)] == chats if chats else True
    for text in CORPUS + chats:
        for special in (True, False):
            assert ours.encode(text, special) == ref.encode(text, special), (text, special)
    n = ref.vocab_size
    ids = sorted({*range(0, n, max(1, n // 3000)), *range(min(n, 400)), *range(max(0, n - 300), n)})
    for skip in (True, False):
        assert ours.decode(ids, skip) == ref.decode(ids, skip)
    for text in CORPUS:
        got = ref.encode(text, add_special_tokens=False)
        assert ours.decode(got, skip_special_tokens=False) == ref.decode(got, skip_special_tokens=False)
    assert [ours.token_bytes(i) for i in ids] == [ref.token_bytes(i) for i in ids]
    assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_ids) == (ref.vocab_size, ref.bos_token_id,
                                                                        ref.eos_token_ids)
    assert ours.hf.get_added_vocab() == ref.hf.get_added_vocab()
    assert {i: t.special for i, t in ours.hf.added_tokens_decoder.items()} == \
        {i: getattr(t, "special") for i, t in ref.hf.added_tokens_decoder.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default", "gemma-3-270m", "qwen2.5-coder-0.5b"])
def test_every_gguf_at_hand_tokenizes_as_transformers(name):
    from phasewise.loading.gguf_header import read_header

    try:
        path = resolve_model_path(None if name == "default" else name)
    except ModelLoadError as e:
        pytest.skip(str(e))
    pre = read_header(path)[0].get("tokenizer.ggml.pre")
    _assert_same(Tokenizer.from_gguf(path), _reference(path, str(pre), keep=True))


def _write(path: Path, arch: str, fields: dict[str, object]) -> Path:
    """A GGUF of tokenizer metadata alone (gguf-py's writer; values in its types)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, list):                  # the type of its first element
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, str(value))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    return path


@pytest.fixture(scope="module")
def byte_level_fields(default_model_path) -> dict[str, object]:
    """The default model's first 6,000 tokens and the merges among them, with a token the byte alphabet
    does not spell (" zzq") and a user-defined one ("<think>")."""
    from phasewise.loading.gguf_header import read_header

    fields = read_header(default_model_path, strings=(TOKENS, MERGES))[0]
    tokens = fields[TOKENS][:6000]
    known = set(tokens)
    merges = [m for m in fields[MERGES] if (pair := m.split(" ", 1)) and pair[0] in known and pair[1] in known and
              "".join(pair) in known]
    return {TOKENS: tokens + [" zzq", "<think>"], "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"][:6000]
            + [1, 4], MERGES: merges, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": fields["tokenizer.chat_template"]}


@pytest.mark.parametrize("pre, add_bos", [("llama-bpe", True), ("qwen2", False), ("qwen35", False),
                                          ("tekken", True), ("gpt-4o", False), ("gpt-2", False), ("smollm", False)])
def test_byte_level_files_tokenize_as_transformers(byte_level_fields, tmp_path, pre, add_bos):
    path = _write(tmp_path / f"{pre}.gguf", "llama", {**byte_level_fields, "tokenizer.ggml.pre": pre,
                                                       "tokenizer.ggml.add_bos_token": add_bos})
    ours = Tokenizer.from_gguf(path)
    _assert_same(ours, _reference(path, pre))
    assert ours.hf.convert_ids_to_tokens(6000) == "Ġzzq"                 # re-spelled in the byte alphabet
    assert ours.encode("hi <think>", add_special_tokens=False)[-1] == 6001
    assert (ours.encode("hi zzq", add_special_tokens=False)[-1] == 6000) == (pre in WHOLE_PIECES)  # no merge makes it
    assert (ours.encode("hi")[:1] == [1]) == add_bos


GEMMA_SPECIALS = {"<pad>": 3, "<eos>": 3, "<bos>": 3, "<unk>": 2, "<mask>": 3}   # text: token type
LLAMA_SPECIALS = {"<unk>": 2, "<s>": 3, "</s>": 3}


@pytest.mark.parametrize("pre", ["llama-bpe", "tekken", "qwen2", "gpt-2"])
def test_bos_where_the_file_does_not_say_follows_llama_cpp(byte_level_fields, tmp_path, pre):
    """Llama 3's and Tekken's families add BOS unless the file says not, as llama.cpp does; the others not."""
    ours = Tokenizer.from_gguf(_write(tmp_path / "m.gguf", "llama", {**byte_level_fields, "tokenizer.ggml.pre": pre}))
    assert (ours.encode("hi")[0] == 1) == (pre in WHOLE_PIECES)


def _sentencepiece_fields(specials: dict[str, int]) -> dict[str, object]:
    """A SentencePiece vocabulary learned from the corpus (spaces as "▁"): the special tokens, the 256
    byte tokens, two control and a user-defined token, a run of spaces, then the pieces scored in threes
    (ties: the converter's order decides)."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import models, pre_tokenizers, trainers

    raw = Raw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=700, show_progress=False))
    pieces = [t for t, _ in sorted(raw.get_vocab().items(), key=lambda kv: kv[1])]
    head = [*specials, *[f"<0x{b:02X}>" for b in range(256)], "<start_of_turn>", "<end_of_turn>", "<think>", "  "]
    ids = {name: list(specials).index(text) for name, text in (("bos", "<s>"), ("bos", "<bos>"), ("eos", "</s>"),
                                                                 ("eos", "<eos>"), ("unknown", "<unk>")) if text in specials}
    return {TOKENS: head + pieces, "tokenizer.ggml.scores": [0.0] * len(head) + [-float(i // 3) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": [*specials.values(), *[6] * 256, 3, 3, 4, 1] + [1] * len(pieces),
            "tokenizer.ggml.model": "llama", **{f"tokenizer.ggml.{name}_token_id": i for name, i in ids.items()}}


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3"])
def test_sentencepiece_files_tokenize_as_transformers(tmp_path, arch):
    """Each with its family's special tokens (transformers' classes add their own defaults to the vocabulary)."""
    specials = GEMMA_SPECIALS if arch == "gemma3" else LLAMA_SPECIALS
    path = _write(tmp_path / f"{arch}.gguf", arch, _sentencepiece_fields(specials))
    ours = Tokenizer.from_gguf(path)
    _assert_same(ours, _reference(path, None))
    think = len(specials) + 256 + 2
    assert ours.encode("<think>x")[:2] == [ours.bos_token_id, think]     # BOS unless told not; <think> whole


def test_a_sentencepiece_file_without_a_space_prefix_adds_none(tmp_path):
    """add_space_prefix false (llama.cpp honours it; transformers' converter does not): no "▁" before
    the first word, and the text comes back as it was."""
    fields = {**_sentencepiece_fields(LLAMA_SPECIALS), "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False}
    ours = Tokenizer.from_gguf(_write(tmp_path / "bare.gguf", "llama", fields))
    prefixed = Tokenizer.from_gguf(_write(tmp_path / "prefixed.gguf", "llama", {**fields, "tokenizer.ggml.add_space_prefix": True}))
    for text in CORPUS:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    first = ours.hf.convert_ids_to_tokens(ours.encode("Hello")[0])
    assert not first.startswith("\u2581") and prefixed.hf.convert_ids_to_tokens(prefixed.encode("Hello")[0]).startswith("\u2581")


def test_merges_by_score_are_the_converters():
    """Every split of a token into two, ordered by score, longer left piece, then file order: the list
    transformers derives, with tied scores, a repeated token (its first place, its last score) and
    Gemma's scores by file order."""
    from transformers.tokenization_utils_base import generate_merges

    fields = _sentencepiece_fields(LLAMA_SPECIALS)
    tokens, scores = list(fields[TOKENS]), list(fields["tokenizer.ggml.scores"])
    tokens.insert(300, tokens[400])
    scores.insert(300, 5.0)
    vocab = {t: i for i, t in enumerate(tokens)}
    assert _merges_by_score(tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores)))
    positions = [-float(i) for i in range(len(tokens))]
    assert _merges_by_score(tokens, positions) == generate_merges(vocab, dict(zip(tokens, positions)))


def test_smollm_splits_digits_as_its_own_tokenizer(default_model_path):
    """The default model's file says "smollm": every digit apart, so a run of spaces before one stays
    whole ("x", "  ", "4", "2") where GPT-2's split alone (transformers' converter) cuts it."""
    ours = Tokenizer.from_gguf(default_model_path)
    pieces = [ours.hf.convert_ids_to_tokens(i) for i in ours.encode("x  42")]
    assert pieces == ["x", "ĠĠ", "4", "2"]
    assert [ours.hf.convert_ids_to_tokens(i) for i in ours.encode(" 123")] == ["Ġ", "1", "2", "3"]


def test_an_unsupported_tokenizer_is_converted_by_transformers_and_kept(tmp_path, capsys):
    """A tokenizer.ggml.model not built here (T5's unigram) goes through transformers' converter with a
    warning, and its conversion is kept by the file's content: a copy under another name reads it back."""
    fields = {TOKENS: ["<pad>", "</s>", "<unk>", "▁", "a", "b", "▁ab", "ab", "▁a"], "tokenizer.ggml.model": "t5",
              "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -1.5, -1.8, -1.2],
              "tokenizer.ggml.token_type": [3, 3, 2, 1, 1, 1, 1, 1, 1], "tokenizer.ggml.eos_token_id": 1,
              "tokenizer.ggml.unknown_token_id": 2}
    path = _write(tmp_path / "t5.gguf", "t5", fields)
    first = Tokenizer.from_gguf(path, cache_dir=tmp_path)
    assert "converting the tokenizer of t5.gguf with transformers" in capsys.readouterr().err
    (tmp_path / "moved").mkdir()
    copy = shutil.copy(path, tmp_path / "moved" / "renamed.gguf")
    again = Tokenizer.from_gguf(copy, cache_dir=tmp_path)
    assert not first.from_cache and again.from_cache
    assert again.encode("ab a") == first.encode("ab a") == [6, 8, 1]
