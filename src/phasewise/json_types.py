"""JSON as a type: what request bodies, config.json files, chat messages and results files hold.

`JsonValue` is pydantic's recursive JSON type (null, bool, number, string, list, object), so a pydantic
model field typed with it validates as JSON; `JsonObject` is one JSON object. `text`, `integer`, `obj`,
`array` and `objects` read a value as the type its producer gave it (JSON the server built itself, a chat
message's parts): another type is a TypeError, as using the value as that type would have been. A client's
JSON is checked where it is read, with a message for the client.
"""

from typing import TypeAlias

from pydantic import JsonValue

JsonObject: TypeAlias = dict[str, JsonValue]

__all__ = ["JsonObject", "JsonValue", "array", "integer", "obj", "objects", "text"]


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
