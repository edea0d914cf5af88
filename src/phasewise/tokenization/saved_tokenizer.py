"""A `tokenizers` tokenizer with its tokenizer_config.json fields and chat template, as a GGUF's
metadata builds it (gguf_vocab.py) or as a folder holds it (tokenizer.json, tokenizer_config.json, the
chat template: what transformers' save_pretrained writes, and the tokenizer cache), used with
`tokenizers` and Jinja alone: transformers' import and its tokenizer wrapper take about 2 s, reading
a folder this way about 0.1-0.4 s. It answers the part of transformers' tokenizer API that
`phasewise.tokenization.tokenizer.Tokenizer` uses, with transformers' results (tests/test_chat_template.py
holds the two reading the same folder: encodings, decodings, chat renderings, special ids).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as RustTokenizer

from phasewise.tokenization.chat_template import ChatTemplate

if TYPE_CHECKING:
    from phasewise.json_types import JsonValue

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: JsonValue) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class SavedTokenizer:
    """A tokenizer, its tokenizer_config.json fields (special tokens' texts, ...) and chat template;
    `folder`: where it was read from (None: built in memory)."""

    def __init__(self, backend: RustTokenizer, config: Mapping[str, JsonValue], chat_template: str | None,
                 folder: Path | None = None) -> None:
        self.backend_tokenizer, self.config, self.folder = backend, dict(config), folder
        self.chat_template = chat_template
        self.special_tokens_map = {name: text for name in SPECIAL_NAMES
                                   if (text := _token_text(config.get(name))) is not None}
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = (
            self.special_tokens_map.get(name)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token"))
        self.added_tokens_decoder = self.backend_tokenizer.get_added_tokens_decoder()

    @classmethod
    def read(cls, folder: Path) -> SavedTokenizer:
        """The tokenizer in `folder`; ValueError when the folder is not one written with a tokenizers
        backend (then transformers itself should read it)."""
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            backend = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:   # OSError, bad JSON, or tokenizers' own Exception type
            raise ValueError(f"not a saved fast tokenizer: {folder} ({e})") from e
        if not isinstance(config, dict) or config.get("backend", "tokenizers") != "tokenizers":
            raise ValueError(f"not a saved fast tokenizer: {folder}")
        template = folder / "chat_template.jinja"
        chat_template = template.read_text() if template.is_file() else config.get("chat_template")
        if isinstance(chat_template, list):   # named templates: the default one
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default", next(iter(named.values()), None))
        return cls(backend, config, chat_template if isinstance(chat_template, str) else None, folder)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.eos_token) if self.eos_token else None

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend_tokenizer.token_to_id(token)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False
               ) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is not kept: decoding stays concatenative")
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, JsonValue]], tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            tools: Sequence[Mapping[str, JsonValue]] | None = None,
                            **kwargs: JsonValue) -> str:
        if tokenize:
            raise ValueError("apply_chat_template gives text here; encode it")
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return ChatTemplate(self.chat_template, self.special_tokens_map).render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, template_kwargs=kwargs)

    def save_pretrained(self, folder: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (as transformers does)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend_tokenizer.save(str(folder / "tokenizer.json"))
        config = {k: v for k, v in self.config.items() if k != "chat_template"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        if self.chat_template:
            (folder / "chat_template.jinja").write_text(self.chat_template)
