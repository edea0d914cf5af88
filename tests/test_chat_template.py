"""A tokenizer read back from a saved folder without transformers (tokenization/saved_tokenizer.py,
chat_template.py) gives what transformers gives reading the same folder: the same chat renderings
(with and without tools), encodings, decodings, token bytes and special ids, on every model at hand.
(tests/test_gguf_vocab.py holds the tokenizer built from a GGUF to transformers' conversion.)"""

from __future__ import annotations

import jinja2
import pytest

from phasewise.tokenization.chat_template import ChatTemplate
from phasewise.loading.gguf import ModelLoadError
from phasewise.loading.loader import resolve_model_path
from phasewise.tokenization.saved_tokenizer import SavedTokenizer
from phasewise.tokenization.tokenizer import Tokenizer

CONVERSATION = [{"role": "system", "content": "You are terse. Ünïcode ok: 🌸"},
                {"role": "user", "content": "Name a flower."}, {"role": "assistant", "content": "A rose."},
                {"role": "user", "content": "  And a tree?\n"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Stadt, e.g. Köln"},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}]
TEXTS = ["Hello, world!", "  two  spaces\tand\ttabs\n\n", "日本語 and 😀 emoji", "<|im_start|>user\nhi<|im_end|>",
         "<start_of_turn>model\n<end_of_turn>", "def f(x):\n    return x ** 2  # ẞ"]


@pytest.fixture(scope="module", params=["default", "gemma-3-270m", "qwen2.5-coder-0.5b"])
def pair(request, tmp_path_factory) -> tuple[Tokenizer, Tokenizer]:
    """(transformers reading a model's tokenizer saved in a folder, the same folder read without it)."""
    from transformers import AutoTokenizer

    try:
        path = resolve_model_path(None if request.param == "default" else request.param)
    except ModelLoadError as e:
        pytest.skip(str(e))
    folder = tmp_path_factory.mktemp(request.param)
    Tokenizer.from_gguf(path).hf.save_pretrained(str(folder))
    return Tokenizer(AutoTokenizer.from_pretrained(str(folder))), Tokenizer(SavedTokenizer.read(folder))


def test_chat_renderings_are_transformers(pair):
    converted, saved = pair
    for messages in (CONVERSATION, CONVERSATION[1:2], CONVERSATION[:3]):
        for gen in (True, False):
            assert saved.render_chat(messages, gen) == converted.render_chat(messages, gen)
    want = converted.hf.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert saved.hf.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True) == want


def test_encodings_decodings_and_ids_are_transformers(pair):
    converted, saved = pair
    for text in TEXTS:
        for special in (True, False):
            assert saved.encode(text, special) == converted.encode(text, special)
    n = converted.vocab_size
    ids = list(range(0, n, max(1, n // 997))) + list(range(min(n, 300)))
    for skip in (True, False):
        assert saved.decode(ids, skip) == converted.decode(ids, skip)
    assert [saved.token_bytes(i) for i in ids] == [converted.token_bytes(i) for i in ids]
    assert (saved.vocab_size, saved.bos_token_id, saved.eos_token_ids) == \
        (converted.vocab_size, converted.bos_token_id, converted.eos_token_ids)
    assert saved.hf.get_added_vocab() == converted.hf.get_added_vocab()


def test_the_sandbox_and_the_helpers_templates_use():
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
                     "{% generation %}!{% endgeneration %}", {"bos_token": "<s>"})
    assert t.render([{"role": "user", "content": "é\"x"}]) == '<s>"é\\"x"!'
    with pytest.raises(jinja2.TemplateError, match="no tools"):
        ChatTemplate("{{ raise_exception('no tools') }}", {}).render([])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render([])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ messages.__class__.__mro__ }}", {}).render([])
