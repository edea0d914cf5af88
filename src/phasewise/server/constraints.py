"""The structured-output fields of three ecosystems → one StructuredOutputs (or a 400 naming the field).

OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
"schema", "strict"}}. vLLM: `structured_outputs` {"json" | "json_object" | "regex" | "choice" |
"grammar"} and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
llama.cpp: `json_schema` (a schema) and `grammar` (GBNF). At most one may constrain a request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from phasewise.json_types import JsonObject, JsonValue
from phasewise.core.sampling_params import StructuredOutputs

VLLM_KEYS = ("json", "json_object", "regex", "choice", "grammar")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED, "json_schema", "grammar")


def _given(fields: Mapping[str, JsonValue]) -> list[str]:
    return [name for name in FIELDS if fields.get(name) is not None
            and not (name == "response_format" and _is_text(fields[name]))]


def given_field(fields: Mapping[str, JsonValue]) -> str | None:
    """The field that constrains the request (the first, if several), or None."""
    return next(iter(_given(fields)), None)


def structured_outputs(fields: Mapping[str, JsonValue], bad_request: Callable[[str, str], Exception]
                       ) -> StructuredOutputs | None:
    """From a request's fields (name → value; absent or None: not set); bad_request(message, param)
    makes the error to raise."""
    given = _given(fields)
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"only one of {', '.join(given)} may constrain a request", given[1])
    name = given[0]
    value = fields[name]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError("must be an object")
            unknown = sorted(set(value) - set(VLLM_KEYS) - {"strict"})
            if unknown:
                raise ValueError(f"{', '.join(unknown)} not supported (it takes one of "
                                 f"{', '.join(VLLM_KEYS)})")
            return _vllm(value)
        if name in GUIDED:
            return _vllm({GUIDED[name]: value})
        if name == "json_schema":
            return StructuredOutputs(json=_schema(value))
        return StructuredOutputs(grammar=_text(value))
    except (TypeError, ValueError) as e:
        message = str(e).removeprefix("structured_outputs ")
        raise bad_request(f"{name}: {message}", name) from None


def _vllm(value: JsonObject) -> StructuredOutputs:
    """vLLM's {"json" | "json_object" | "regex" | "choice" | "grammar", "strict"?}; a null is not set."""
    given = {k: v for k, v in value.items() if v is not None}
    return StructuredOutputs(json=_schema(given["json"]) if "json" in given else None,
                             json_object=_flag(given, "json_object", False), regex=_string(given, "regex"),
                             choice=_choices(given["choice"]) if "choice" in given else None,
                             grammar=_string(given, "grammar"), strict=_flag(given, "strict", True))


def _flag(given: Mapping[str, JsonValue], key: str, default: bool) -> bool:
    value = given.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false")
    return value


def _string(given: Mapping[str, JsonValue], key: str) -> str | None:
    value = given.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    return value


def _choices(value: JsonValue) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise ValueError("choice must be a non-empty list of strings")
    return [c for c in value if isinstance(c, str)]


def _schema(value: JsonValue) -> JsonObject | str:
    """A JSON schema: an object, or its JSON text."""
    if not isinstance(value, (dict, str)):
        raise ValueError("json must be a JSON schema object")
    return value


def _is_text(value: JsonValue) -> bool:
    return isinstance(value, dict) and value.get("type", "text") == "text"


def _text(value: JsonValue) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _response_format(value: JsonValue) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise ValueError("must be an object with a type")
    kind = value.get("type")
    if kind == "json_object":      # llama.cpp's {"type": "json_object", "schema": S} constrains to S
        schema = value.get("schema")
        if schema is None:
            return StructuredOutputs(json_object=True)
        return StructuredOutputs(json=_schema(schema))
    if kind != "json_schema":
        raise ValueError(f"type must be text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("json_schema must be an object with a name and a schema")
    schema = spec.get("schema")
    if schema is None:                      # OpenAI's schema is optional: any JSON object then
        return StructuredOutputs(json_object=True)
    # OpenAI's default is strict=false: keywords the compiler does not implement are then not enforced
    return StructuredOutputs(json=_schema(schema),
                             strict=_flag({k: v for k, v in spec.items() if v is not None},
                                          "strict", False))
