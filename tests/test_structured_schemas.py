"""Hypothesis-generated JSON schemas (objects, arrays, enums, nesting, required fields, string patterns
and lengths, integer bounds) on the default model: every output that ends with "stop" validates against
its schema (the jsonschema package), through the server (n = 3, streamed and not) and offline with
speculative decoding on."""

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
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
)


def _object(props: dict) -> st.SearchStrategy:
    return st.lists(st.sampled_from(sorted(props)), unique=True).map(
        lambda required: {"type": "object", "properties": props, "required": required, "additionalProperties": False})


SCHEMAS = st.dictionaries(NAMES, st.recursive(LEAVES, lambda inner: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(1, 3)),
    st.dictionaries(NAMES, inner, min_size=1, max_size=3).flatmap(_object)), max_leaves=6),
    min_size=1, max_size=4).flatmap(_object)
ASK = [{"role": "user", "content": "Fill in this record as JSON."}]


@pytest.fixture(scope="module")
def speculative():
    from phasewise import LLM

    return LLM(speculative="ngram", kv_cache_memory=0.1, warmup=False)


def check(texts_and_reasons, schema) -> int:
    stopped = 0
    for text, reason in texts_and_reasons:
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            stopped += 1
        else:
            assert reason == "length", reason
    return stopped


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(SCHEMAS)
def test_every_finished_output_validates_against_its_schema(server, speculative, schema):
    from phasewise import SamplingParams, StructuredOutputs

    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
    body = {"model": MODEL, "messages": ASK, "n": 3, "temperature": 0.9, "seed": 11, "max_tokens": 96,
            "response_format": fmt}
    out = server.post("/v1/chat/completions", body).json()
    stopped = check([(c["message"]["content"], c["finish_reason"]) for c in out["choices"]], schema)
    texts, reasons = ["", "", ""], [None] * 3
    for event in sse_events(server.post("/v1/chat/completions", {**body, "stream": True}))[:-1]:
        for c in event["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    stopped += check(zip(texts, reasons), schema)
    outs = speculative.chat([ASK] * 3, [SamplingParams(temperature=0.9, seed=s, max_tokens=96,
                                                       structured_outputs=StructuredOutputs(json=schema))
                                        for s in range(3)])
    stopped += check([(o.text, o.finish_reason) for o in outs], schema)
    assert stopped, "no output finished within max_tokens"
