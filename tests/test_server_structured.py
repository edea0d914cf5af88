"""Structured outputs through the server: OpenAI's response_format (also via the openai client's parse
with a pydantic model), vLLM's structured_outputs and guided_* fields, llama.cpp's json_schema and
grammar, streamed or not, on both routes; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel

from live_server import CHAT, MODEL, assert_openai_error, sse_events

pytestmark = pytest.mark.slow

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}
ASK = [{"role": "user", "content": "Give the largest city of France and its population as JSON."}]


class City(BaseModel):
    city: str
    population: int


def test_response_format_json_schema_and_json_object(server):
    client = server.client()
    strict = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                                         response_format=strict)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), CITY)
    ok = [{"role": "user", "content": 'Reply with a JSON object with one key, "ok", set to true.'}]
    out = client.chat.completions.create(model=MODEL, messages=ok, temperature=0, max_tokens=60,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_every_choice_of_n_holds_its_own_grammar(server):
    out = server.client().chat.completions.create(
        model=MODEL, messages=ASK, temperature=1.0, seed=5, n=4, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1
    for choice in out.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), CITY)


def test_metrics_count_constrained_requests_and_their_grammar_time(server):
    before = server.metrics()
    body = {**CHAT, "messages": ASK, "max_tokens": 8, "structured_outputs": {"regex": "[a-z]{20}"}}
    assert server.post("/v1/chat/completions", body).status_code == 200
    after = server.metrics()
    key = 'phasewise:structured_output_requests_total{model_name="%s"}' % MODEL
    assert after[key] == before.get(key, 0) + 1
    for name in ("grammar_compile_seconds", "grammar_mask_seconds"):
        count = 'phasewise:%s_count{model_name="%s"}' % (name, MODEL)
        assert after[count] > before.get(count, 0), name


def test_the_openai_clients_parse_with_a_pydantic_model(server):
    client = server.client()
    for parse in (client.chat.completions.parse, client.beta.chat.completions.parse):
        out = parse(model=MODEL, messages=ASK, temperature=0, max_tokens=60, response_format=City)
        parsed = out.choices[0].message.parsed
        assert isinstance(parsed, City) and parsed.city


@pytest.mark.parametrize("fields, check", [
    ({"structured_outputs": {"choice": ["Paris", "Lyon"]}}, lambda t: t in ("Paris", "Lyon")),
    ({"structured_outputs": {"regex": r"[A-Z][a-z]{1,15}, \d{4}"}},          # bounded: a small model may
     lambda t: re.fullmatch(r"[A-Z][a-z]{1,15}, [0-9]{4}", t)),               # write letters forever
    ({"structured_outputs": {"json": CITY}}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
    ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"}, lambda t: t in ("yes", "no")),
    ({"guided_json": CITY}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
    ({"json_schema": CITY}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),           # llama.cpp
    ({"response_format": {"type": "json_object", "schema": CITY}},                                  # llama.cpp too
     lambda t: jsonschema.validate(json.loads(t), CITY) is None),
    ({"grammar": 'root ::= "It is " [0-9] [0-9]? [0-9]? [0-9]? "."'},          # llama.cpp (bounded: a small
     lambda t: re.fullmatch(r"It is [0-9]{1,4}\.", t)),                     # model may write digits forever)
])
def test_each_ecosystems_fields_constrain_both_routes_streamed_or_not(server, fields, check):
    chat = {**CHAT, "messages": ASK, "temperature": 0, "max_tokens": 60, **fields}
    text = server.post("/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    assert check(text), text
    streamed = server.post("/v1/chat/completions", {**chat, "stream": True})
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in sse_events(streamed)[:-1] if e["choices"]]
    assert "".join(deltas) == text
    completion = {"model": MODEL, "prompt": "The largest city of France:", "temperature": 0, "max_tokens": 60,
                  **fields}
    body = server.post("/v1/completions", completion).json()
    assert check(body["choices"][0]["text"]), body


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"},
                                                                "strict": True}}}, "response_format", "objekt"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"grammar": 'root ::= "a" missing'}, "grammar", "grammar"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar", "only one"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(server, fields, param, words):
    err = assert_openai_error(server.post("/v1/chat/completions", {**CHAT, **fields}), 400, words)
    assert err["param"] == param
