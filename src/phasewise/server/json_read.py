"""Reading JSON the server built itself (a ToolCallParser's pieces, its own response items, a stored
conversation): each value is narrowed to the type its builder gave it, and a value of another type is a
TypeError, as indexing it would have been. A client's JSON is checked where it is read, with a 400."""

from __future__ import annotations

from phasewise.json_types import JsonObject, JsonValue


def _wrong(value: JsonValue, expected: str) -> TypeError:
    return TypeError(f"expected a JSON {expected}, got {type(value).__name__}")


def text(value: JsonValue) -> str:
    if not isinstance(value, str):
        raise _wrong(value, "string")
    return value


def integer(value: JsonValue) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong(value, "integer")
    return value


def obj(value: JsonValue) -> JsonObject:
    if not isinstance(value, dict):
        raise _wrong(value, "object")
    return value


def array(value: JsonValue) -> list[JsonValue]:
    if not isinstance(value, list):
        raise _wrong(value, "array")
    return value


def objects(value: JsonValue) -> list[JsonObject]:
    """The objects of a JSON array; null (an absent list) has none."""
    return [] if value is None else [obj(v) for v in array(value)]
