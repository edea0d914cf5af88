"""A model's chat template (Jinja), rendered as transformers' `apply_chat_template` renders it, without
importing transformers (1-2 s at start).

The same environment: Jinja's immutable sandbox with trim_blocks and lstrip_blocks, loop controls,
`{% generation %}` blocks (rendered as their body), a `tojson` that keeps non-ASCII text and takes
indent / separators / sort_keys, `raise_exception`, `strftime_now`, and namespaces that refuse
underscore names. The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) and a request's chat_template_kwargs.
tests/test_chat_template.py holds the renderings to transformers' own on every model at hand, with and without
tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING

import jinja2
import jinja2.ext
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from phasewise.json_types import JsonValue


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body."""
    tags = {"generation"}

    def parse(self, parser: Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() without underscore attributes (no way to CPython internals)."""

    # Jinja's signature trick: namespace(self=...) works
    def __init__(*args: object, **kwargs: object) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
    pair = None
    if separators is not None:
        item, key = separators                  # json.dumps' pair (a template may pass a list)
        pair = (item, key)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=pair, sort_keys=sort_keys)


def _plain(value: object) -> JsonValue:
    """What the template may see: JSON types only (subclasses reduced to their base type, keys strings)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, dict=dict, namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


class ChatTemplate:
    """One template and the special tokens it may name; `render` raises jinja2.TemplateError."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, JsonValue]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, JsonValue]] | None = None,
               documents: Sequence[Mapping[str, JsonValue]] | None = None,
               template_kwargs: Mapping[str, JsonValue] | None = None) -> str:
        """template_kwargs: more variables (a request's chat_template_kwargs, such as enable_thinking)."""
        context = {**{k: _plain(v) for k, v in (template_kwargs or {}).items()}, **self.special_tokens,
                   "messages": _plain(messages), "tools": _plain(tools), "documents": _plain(documents),
                   "add_generation_prompt": add_generation_prompt}
        return _compile(self.source).render(context)
