"""JSON as a type: what request bodies, config.json files, chat messages and results files hold.

`JsonValue` is pydantic's recursive JSON type (null, bool, number, string, list, object), so a pydantic
model field typed with it validates as JSON; `JsonObject` is one JSON object.
"""

from typing import TypeAlias

from pydantic import JsonValue

JsonObject: TypeAlias = dict[str, JsonValue]

__all__ = ["JsonObject", "JsonValue"]
