"""Hypothesis-generated JSON schemas (objects, arrays, enums, nesting, required fields, string patterns
and lengths, integer bounds) on the default model: given as many tokens as the longest text the schema
allows, every output ends with "stop" and validates against its schema (the jsonschema package), through
the server (n = 3, streamed and not) and offline with speculative decoding on."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from live_server import MODEL, sse_events

pytestmark = pytest.mark.slow

NAMES = st.from_regex(r"[a-z]{1,6}", fullmatch=True)
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-100, 100), st.integers(0, 1000)),
    st.lists(st.sampled_from(["red", "green", "blue", "a b", "1"]), min_size=1, max_size=4, unique=True)
    .map(lambda values: {"enum": values}),
    st.sampled_from([r"^[a-z]{1,8}$", r"^[A-Z][a-z]{0,6}$", r"^[0-9]{3}-[0-9]{2}$"])
    .map(lambda p: {"type": "string", "pattern": p}),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
)


def _object(props: dict) -> st.SearchStrategy:
    return st.lists(st.sampled_from(sorted(props)), unique=True).map(
        lambda required: {"type": "object", "properties": props, "required": required, "additionalProperties": False})


SCHEMAS = st.dictionaries(NAMES, st.recursive(LEAVES, lambda inner: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(1, 3)),
    st.dictionaries(NAMES, inner, min_size=1, max_size=3).flatmap(_object)), max_leaves=6),
    min_size=1, max_size=4).flatmap(_object)
MAX_BYTES = 400
ASK = [{"role": "user", "content": "Fill in this record as JSON."}]


@pytest.fixture(scope="module")
def speculative():
    from phasewise import LLM

    return LLM(speculative="ngram", kv_cache_memory=0.1, warmup=False)


def longest(schema: dict) -> int:
    """Bytes of the longest compact JSON text `schema` allows: a bound on its tokens (a token is >= 1 byte)."""
    if "enum" in schema:
        return max(len(json.dumps(v).encode()) for v in schema["enum"])
    kind = schema["type"]
    if kind == "boolean":
        return 5
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "string":   # a pattern's longest match is ASCII; other characters may be a \\uXXXX pair (12 bytes)
        return 2 + ({r"^[a-z]{1,8}$": 8, r"^[A-Z][a-z]{0,6}$": 7, r"^[0-9]{3}-[0-9]{2}$": 6}[schema["pattern"]]
                    if "pattern" in schema else 12 * schema["maxLength"])
    if kind == "array":
        n = schema["maxItems"]
        return 2 + n * longest(schema["items"]) + 2 * (n - 1)
    props = schema["properties"]
    return 2 + sum(len(json.dumps(k)) + 2 + longest(v) for k, v in props.items()) + 2 * (len(props) - 1)


def check(texts_and_reasons, schema) -> None:
    for text, reason in texts_and_reasons:
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), schema)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(SCHEMAS.filter(lambda schema: longest(schema) <= MAX_BYTES))
def test_every_output_ends_within_its_schemas_length_and_validates(server, speculative, schema):
    from phasewise import SamplingParams, StructuredOutputs

    budget = longest(schema)

    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
    body = {"model": MODEL, "messages": ASK, "n": 3, "temperature": 0.9, "seed": 11, "max_tokens": budget,
            "response_format": fmt}
    out = server.post("/v1/chat/completions", body).json()
    check([(c["message"]["content"], c["finish_reason"]) for c in out["choices"]], schema)
    texts, reasons = ["", "", ""], [None] * 3
    for event in sse_events(server.post("/v1/chat/completions", {**body, "stream": True}))[:-1]:
        for c in event["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    check(zip(texts, reasons), schema)
    outs = speculative.chat([ASK] * 3, [SamplingParams(temperature=0.9, seed=s, max_tokens=budget,
                                                       structured_outputs=StructuredOutputs(json=schema))
                                        for s in range(3)])
    check([(o.text, o.finish_reason) for o in outs], schema)
