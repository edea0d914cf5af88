"""Tokenizer wrapper (GGUF or HF folder); its streaming counterpart is detokenizer.py's
IncrementalDetokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from phasewise import tool_calling
from phasewise.config import default_cache_dir
from phasewise.loading.file_key import content_key
from phasewise.tokenization.gguf_vocab import UnsupportedVocab, byte_alphabet, paused_gc, read_vocab
from phasewise.tokenization.saved_tokenizer import SavedTokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RustTokenizer

    from phasewise.json_types import JsonValue

# Turn-ending tokens of common chat formats (ChatML, Llama 3, Phi-3, Gemma, Llama 2 / Mistral).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
CACHE_FORMAT = 3  # bump to invalidate every cached tokenizer (3: keyed by content)
# The turn format of a GGUF that ships no chat template, known by a token of its vocabulary (as
# llama.cpp falls back to its built-in templates). Gemma: system text opens the next user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
    "{% else %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n'"
    " + (ns.system if m['role'] == 'user' else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% if m['role'] == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
FALLBACK_TEMPLATES = {"<start_of_turn>": GEMMA_TEMPLATE}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # SentencePiece's byte-fallback tokens


class HFTokenizer(Protocol):
    """What Tokenizer uses of a transformers fast tokenizer (a SavedTokenizer answers the same)."""

    @property
    def backend_tokenizer(self) -> RustTokenizer: ...
    @property
    def added_tokens_decoder(self) -> Mapping[int, object]: ...   # id → AddedToken
    @property
    def chat_template(self) -> str | dict[str, str] | None: ...   # a dict: named templates
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def bos_token(self) -> str | None: ...
    @property
    def eos_token(self) -> str | None: ...
    @property
    def pad_token(self) -> str | None: ...
    @property
    def unk_token(self) -> str | None: ...
    def __len__(self) -> int: ...
    def get_added_vocab(self) -> dict[str, int]: ...
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], *, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str: ...
    def convert_ids_to_tokens(self, token_id: int) -> str | None: ...
    def apply_chat_template(self, messages: Sequence[Mapping[str, JsonValue]], *, tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            tools: Sequence[Mapping[str, JsonValue]] | None = None,
                            **kwargs: JsonValue) -> str: ...
    def save_pretrained(self, folder: str) -> object: ...


def _as_hf(tokenizer: object) -> HFTokenizer:
    """A transformers tokenizer as the HFTokenizer it is: transformers types the results of
    apply_chat_template and convert_ids_to_tokens as every form they take, where phasewise's calls get
    one (tokenize=False: a str; one id: its token)."""
    return cast(HFTokenizer, tokenizer)


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def gguf_cache_key(path: Path) -> str:
    """Hash of the GGUF's content (loading/file_key.py: a copied or moved file hits) and of the
    converting libraries' versions."""
    from importlib.metadata import version

    raw = f"{CACHE_FORMAT}|{content_key(path)}|{version('transformers')}|{version('tokenizers')}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _save_atomically(hf: HFTokenizer, final: Path) -> None:
    """save_pretrained into a temp dir beside `final`, then rename it into place (losing a race is fine)."""
    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent)
        hf.save_pretrained(tmp)
        os.rename(tmp, final)  # atomic; fails if another process already put a complete copy there
    except OSError:
        pass  # unwritable cache or a lost race: the cache is only an optimisation
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _converted(path: Path, cached: Path | None) -> tuple[HFTokenizer, bool]:
    """(transformers' conversion of the GGUF's tokenizer, whether it came from `cached`), kept in
    `cached` (None: not kept): 12-28 s for a vocabulary of 150k, so only for a tokenizer gguf_vocab.py
    does not build."""
    if cached is not None and cached.is_dir():
        try:
            return SavedTokenizer.read(cached), True
        except ValueError:  # unreadable cache: convert again and replace it
            shutil.rmtree(cached, ignore_errors=True)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        hf = _as_hf(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    except Exception as e:
        try:   # an architecture transformers cannot build (OLMoE): its tokenizer fields alone
            hf = _as_hf(PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name))
        except Exception:
            raise ValueError(f"cannot load the tokenizer of {path}: {_one_line(e)}") from e
    if cached is not None:
        _save_atomically(_with_fallback_template(hf), cached)
    return hf, False


def _with_fallback_template(hf: HFTokenizer) -> HFTokenizer:
    """`hf`, given its family's turn format if it has no chat template and a known turn token."""
    if not hf.chat_template:
        template = next((tpl for marker, tpl in FALLBACK_TEMPLATES.items()
                         if hf.backend_tokenizer.token_to_id(marker) is not None), None)
        setattr(hf, "chat_template", template)     # a plain attribute of both kinds of HFTokenizer
    return hf


class Tokenizer:
    """Wraps a fast tokenizer (a SavedTokenizer or transformers'): encoding, chat template, decoding, special
    ids."""

    def __init__(self, hf: HFTokenizer, extra_eos_ids: Iterable[int] = (), from_cache: bool = False) -> None:
        self.hf = hf
        self.from_cache = from_cache  # True when a GGUF's converted tokenizer came from the cache
        self.vocab_size: int = len(hf)
        self.bos_token_id: int | None = hf.bos_token_id
        eos = {i for i in extra_eos_ids if 0 <= i < self.vocab_size}
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        template = self.chat_template
        self._added_ids = frozenset(hf.added_tokens_decoder)
        turn_ends = (hf.backend_tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS if t in template)
        eos.update(i for i in turn_ends if i in self._added_ids)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._byte_decoder = _byte_level_decoder(hf)

    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: str | Path | None = None,
                  use_cache: bool = True) -> Tokenizer:
        """The tokenizer a GGUF's metadata describes, built from it (gguf_vocab.py: about a second for
        any vocabulary); one it does not build is transformers' conversion, kept under cache_dir/tokenizers
        by the file's content."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"not a GGUF file (bad magic): {path}")
        try:
            with paused_gc():
                vocab = read_vocab(path)
                hf = SavedTokenizer(vocab.backend, vocab.config, vocab.chat_template)
        except UnsupportedVocab as e:
            print(f"phasewise: warning: {e}: converting the tokenizer of {path.name} with transformers "
                  "(slow)", file=sys.stderr)
            root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
            converted, hit = _converted(path,
                                        root / "tokenizers" / gguf_cache_key(path) if use_cache else None)
            return cls(_with_fallback_template(converted), from_cache=hit)
        except Exception as e:   # a malformed header (ValueError) or vocabulary (tokenizers' own Exception)
            raise ValueError(f"cannot load the tokenizer of {path}: {_one_line(e)}") from e
        return cls(_with_fallback_template(hf))

    @classmethod
    def from_hf(cls, folder: str | Path) -> Tokenizer:
        """Load from an HF model folder (tokenizer.json / tokenizer_config.json, optional
        generation_config.json)."""
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise ValueError(f"model folder not found: {folder}")
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"no tokenizer in {folder} (expected one of {', '.join(TOKENIZER_FILES)})")
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer in {folder}: {_one_line(e)}") from e
        return cls(_as_hf(hf), extra_eos_ids=_generation_config_eos(folder))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """A *.gguf file → from_gguf; a directory → from_hf."""
        path = Path(path).expanduser()
        if path.is_dir():
            return cls.from_hf(path)
        if path.suffix.lower() == ".gguf":
            return cls.from_gguf(path)
        if not path.exists():
            raise ValueError(f"no such file or directory: {path}")
        raise ValueError(f"expected a .gguf file or an HF model folder: {path}")

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with another chat template (serve --chat-template), whose end-of-turn token is
        an end of sequence too."""
        setattr(self.hf, "chat_template", source)     # a plain attribute of both kinds of HFTokenizer
        return Tokenizer(self.hf, self.eos_token_ids, self.from_cache)

    @property
    def backend(self) -> RustTokenizer:
        """The `tokenizers.Tokenizer` underneath (what grammar compilers read the vocabulary from)."""
        return self.hf.backend_tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize raw text; add_special_tokens adds BOS etc. only if the model is configured to."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of text with no special tokens added (as a rendered chat is encoded) and the character
        each token ends at (the Rust tokenizer's offsets, which `encode` runs through too)."""
        enc = self.backend.encode(text, add_special_tokens=False)
        return list(enc.ids), [end for _, end in enc.offsets]

    def render_chat(self, messages: Sequence[Mapping[str, JsonValue]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, JsonValue]] | None = None,
                    template_kwargs: Mapping[str, JsonValue] | None = None,
                    continue_final: bool = False) -> str:
        """The chat template applied to messages (and OpenAI-style tools), as text. A template without
        tool support gets the tools, tool calls and tool results in a generic form (tool_calling/prompt.py).
        template_kwargs: more variables for the template (a request's chat_template_kwargs: enable_thinking).
        continue_final: the text ends inside the final (assistant) message, which the model continues."""
        if not self.has_chat_template():
            raise ValueError("this tokenizer has no chat template; pass a raw prompt instead")
        import jinja2

        native_tools = None
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            if tool_calling.supports_tools(self.chat_template):
                messages, native_tools = tool_calling.native_messages(messages), tools or None
            else:
                messages = tool_calling.generic_messages(messages, tools)
        try:
            opened = add_generation_prompt and not continue_final     # a new assistant turn
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=opened,
                                               tools=native_tools, **(template_kwargs or {}))
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {_one_line(e)}") from e
        except (TypeError, AttributeError) as e:       # a request's variable of a type the template cannot
                                                       # use
            if not template_kwargs:
                raise
            raise ValueError(f"chat template failed with chat_template_kwargs: {_one_line(e)}") from e
        return _continued(text, messages[-1]) if continue_final and messages else text

    def apply_chat_template(self, messages: Sequence[Mapping[str, JsonValue]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, JsonValue]] | None = None,
                            template_kwargs: Mapping[str, JsonValue] | None = None,
                            continue_final: bool = False) -> list[int]:
        """Token ids of the rendered chat (the template supplies any BOS, as in transformers)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools,
                                            template_kwargs, continue_final),
                           add_special_tokens=False)

    @property
    def chat_template(self) -> str:
        """The chat template's text ("" without one; a template dict's entries joined)."""
        template = self.hf.chat_template or ""
        return "\n".join(template.values()) if isinstance(template, dict) else template

    @property
    def tool_format(self) -> tool_calling.ToolFormat:
        """How this model writes tool calls: "hermes" or "llama3_json" (tool_calling/parser.py)."""
        return tool_calling.tool_format(self.chat_template)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ids, without transformers' tokenization-space clean-up (so decoding is concatenative)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. A token may hold part of a character (a piece of an
        emoji): its own bytes, where decoding it alone gives U+FFFD."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_decoder is not None:           # byte-level BPE (GPT-2 style): one char per byte
            if all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            return piece.encode()
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece: ▁ is a space


def _byte_level_decoder(hf: HFTokenizer) -> dict[str, int] | None:
    """Char → byte of a byte-level BPE tokenizer's alphabet; None for other tokenizers."""
    decoder = hf.backend_tokenizer.decoder
    state = json.loads(decoder.__getstate__()) if decoder is not None else {}
    kinds = {state.get("type")} | {d.get("type") for d in state.get("decoders", [])}
    if "ByteLevel" not in kinds:
        return None
    return {c: b for b, c in enumerate(byte_alphabet())}


def _generation_config_eos(folder: Path) -> list[int]:
    import json

    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    return [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]


def _continued(text: str, final: Mapping[str, JsonValue]) -> str:
    """The rendered chat cut right after the final message's text (what comes after it closes the turn),
    as transformers' continue_final_message cuts it."""
    content = final.get("content")
    body = content.strip() if isinstance(content, str) else ""
    at = text.rfind(body) if body else -1
    if at < 0:
        raise ValueError("the final message has no text to continue in the rendered chat")
    return text[:at + len(body)]
