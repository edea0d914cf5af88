"""A request body's bytes → a validated pydantic model, or a 400 in OpenAI's shape a person can read."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from phasewise.json_types import JsonValue
from phasewise.server.api_error import bad_request

M = TypeVar("M", bound=BaseModel)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


MAX_DEPTH = 128            # arrays and objects inside each other; a deeper body is refused before parsing
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in JSON text (strings skipped), without recursing: a body nested
    thousands deep would overflow the parser's (and every validator's) stack."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return MAX_DEPTH
    depth = deepest = 0
    for bracket in _BRACKET.findall(_STRING.sub(b"", raw)):
        depth += 1 if bracket in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def parse_body(raw: bytes, model: type[M]) -> M:
    """JSON bytes → a validated model, or a 400 APIError with a message a person can read."""
    if nesting_depth(raw) > MAX_DEPTH:
        raise bad_request(f"the request body nests arrays and objects more than {MAX_DEPTH} levels deep")
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    where = _lone_surrogate(obj)
    if where is not None:   # JSON allows "\ud800" alone; no tokenizer can encode it
        raise bad_request(f"{where or 'a string'} is not valid Unicode: it holds a lone surrogate "
                          "(an unpaired \\ud800-\\udfff escape)", where.split(".")[0] if where else None)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise bad_request(*validation_message(e.errors(include_url=False, include_input=False,
                                                       include_context=False))) from None


def _lone_surrogate(obj: JsonValue, path: str = "") -> str | None:
    """The dotted path of the first string (key or value) in obj that UTF-8 cannot encode, else None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _lone_surrogate(key) is not None:
            return here
        found = _lone_surrogate(value, here)
        if found is not None:
            return found
    return None


def validation_message(errors: Sequence[ErrorDetails]) -> tuple[str, str | None]:
    """The first error as 'field.sub: message', without pydantic's types, inputs or links."""
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if not _is_type_tag(p)]
    if loc and loc[0] == "body":       # FastAPI's own validation prefixes the body
        loc = loc[1:]
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err.get("type") == "missing":
        msg = "this field is required"
    where = ".".join(loc)
    return (f"{where}: {msg}" if where else msg), (loc[0] if loc else None)


def _is_type_tag(part: str | int) -> bool:
    """Union members show up in pydantic locations as 'str', 'list[TextPart]', ...: not field names."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict", "none")
                                      or "[" in part)
