"""The tool-call parser: calls and content the same however the text is split into deltas, argument
fragments adding up to each call's arguments, both formats, and text that only looks like a call."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from phasewise.tool_calling import ToolCallParser, call_grammar, check_tools, generic_messages, tool_format

CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": [2, "}"]}}}\n</tool_call>')


def run(text: str, cuts: list[int], fmt: str = "hermes", names=frozenset(),
        max_calls: int | None = None) -> tuple[ToolCallParser, list[dict]]:
    parser, pieces, last = ToolCallParser(fmt, names, max_calls), [], 0
    for cut in sorted(cuts):
        pieces += parser.feed(text[last:cut])
        last = cut
    pieces += parser.feed(text[last:], final=True)
    return parser, pieces


def replay(pieces: list[dict]) -> tuple[str, list[dict]]:
    """What a client builds from the deltas: the content, and each call by index."""
    content, calls = "", {}
    for p in pieces:
        content += p.get("content", "")
        for c in p.get("tool_calls", ()):
            call = calls.setdefault(c["index"], {"name": "", "arguments": "", "id": None})
            call["id"] = c.get("id", call["id"])
            call["name"] += c["function"].get("name", "")
            call["arguments"] += c["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(CALLS)), max_size=40))
def test_hermes_calls_come_out_the_same_however_the_text_is_split(cuts):
    parser, pieces = run(CALLS, cuts)
    content, calls = replay(pieces)
    assert content == parser.content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": {"c": [2, "}"]}})]
    assert [c["arguments"] for c in calls] == [c.arguments for c in parser.calls]
    assert [c["id"] for c in calls] == [c.id for c in parser.calls]


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="<tool_call>{}\" \n/abc", max_size=60), st.lists(st.integers(0, 60), max_size=10))
def test_text_without_a_whole_call_is_all_content(text, cuts):
    parser, pieces = run(text, [c for c in cuts if c <= len(text)])
    content, calls = replay(pieces)
    if not parser.calls:
        assert content == text
    assert len(calls) == len(parser.calls)


def test_arguments_first_and_a_cut_call():
    parser, pieces = run('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', [5, 20])
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("f", {"x": 1})]
    parser, pieces = run('<tool_call>\n{"name": "f", "argu', [])      # max_tokens cut it: content, not a call
    assert not parser.calls and replay(pieces)[0] == '<tool_call>\n{"name": "f", "argu'
    parser, pieces = run("a <tool_call>[1, 2]</tool_call> b", [4, 13])  # not a call object: content
    assert not parser.calls and replay(pieces)[0] == "a <tool_call>[1, 2]</tool_call> b"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=10))
def test_a_bare_call_object_naming_a_tool_is_a_call(cuts):
    bare = '  {"name": "get_weather", "arguments": {"city": "Paris"}}'
    parser, pieces = run(bare, [c for c in cuts if c <= len(bare)], names={"get_weather"})
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris"})]
    assert replay(pieces)[0] == ""
    for names, text in (({"add"}, bare), ({"get_weather"}, '{"name": "get_weather"} and more'), (set(), bare)):
        parser, pieces = run(text, [c for c in cuts if c <= len(text)], names=names)
        assert not parser.calls and replay(pieces)[0] == text


UNTAGGED = [   # (reply, its calls): how small models write calls without tags (Qwen2.5-Coder-0.5B the first)
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     [("get_weather", {"city": "Paris"})]),
    ('```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "add", "arguments": {"a": 1}}\n```',
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]),
    ('[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": "{\\"a\\": 2}"}]',
     [("add", {"a": 1}), ("add", {"a": 2})]),
    ('```xml\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n```', [("add", {})]),
    ('\n<function_call>{"name": "add", "parameters": {"a": 1}}</function_call>', [("add", {"a": 1})]),
]
NOT_CALLS = ['```json\n{"a": 1}\n```',                                          # JSON, not a call
             '```json\n{"name": "get_weather", "arguments": {}}\n```\nand more',  # a call and text
             '```json\n{"name": "search", "arguments": {}}\n```',                  # not one of the tools
             '```json\n{"name": "get_weather", "argu',                            # cut by max_tokens
             '<tools>[1, 2]</tools>']


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 120), max_size=10))
def test_untagged_calls_in_fences_lists_and_wrappers_are_calls(cuts):
    names = {"get_weather", "add"}
    for text, calls in UNTAGGED:
        parser, pieces = run(text, [c for c in cuts if c <= len(text)], names=names)
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls
        assert replay(pieces) == ("", [{"name": n, "arguments": json.dumps(a), "id": c.id}
                                       for (n, a), c in zip(calls, parser.calls)])
    for text in NOT_CALLS:
        parser, pieces = run(text, [c for c in cuts if c <= len(text)], names=names)
        assert not parser.calls and replay(pieces)[0] == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(CALLS)), max_size=40))
def test_max_calls_drops_the_later_calls_whole(cuts):
    parser, pieces = run(CALLS, cuts)
    one, one_pieces = run(CALLS, cuts, max_calls=1)
    assert [c.name for c in parser.calls] == ["get_weather", "add"] and [c.name for c in one.calls] == ["get_weather"]
    content, calls = replay(one_pieces)
    first = {**replay(pieces)[1][0], "id": one.calls[0].id}   # (ids are random)
    assert content == "Let me check." and calls == [first]


def test_a_code_answer_streams_at_once_and_only_a_calls_opening_is_held():
    parser = ToolCallParser("hermes", {"add"})
    assert parser.feed("```") == []                          # could still open a fenced call
    assert parser.feed("python\nprint(1)") == [{"content": "```python\nprint(1)"}]
    parser = ToolCallParser("hermes", {"add"})
    assert parser.feed('```json\n{"name": "add", "arguments": {}}\n```') == []
    assert parser.feed("", final=True)[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": "{}"}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 80), max_size=10))
def test_llama3_json_calls(cuts):
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", "parameters": {}}'
    parser, pieces = run(text, [c for c in cuts if c <= len(text)], "llama3_json")
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Oslo"}),
                                                                          ("add", {})]
    parser, pieces = run("The weather is fine.", [3], "llama3_json")
    assert not parser.calls and replay(pieces)[0] == "The weather is fine."


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 90), max_size=10))
def test_mistral_calls(cuts):
    """Both of Mistral's spellings; ids of 9 letters and digits (its templates refuse others)."""
    for text in ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", "arguments": {}}]',
                 '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]add[ARGS]{}'):
        parser, pieces = run(text, [c for c in cuts if c <= len(text)], "mistral")
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Oslo"}),
                                                                              ("add", {})]
        assert all(len(c.id) == 9 and c.id.isalnum() for c in parser.calls) and replay(pieces)[0] == ""
    for text in ("The weather is fine.", "[TOOL_CALLS] not a call"):
        parser, pieces = run(text, [c for c in cuts if c <= len(text)], "mistral")
        assert not parser.calls and replay(pieces)[0] == text.strip()


def test_format_from_the_template_and_tool_checks():
    assert tool_format("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tool_format("<|python_tag|>{{ tools }}") == "llama3_json"
    assert tool_format("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]") == "mistral"
    assert tool_format("{{ messages }}") == "hermes"
    for bad in ([], [{"type": "retrieval"}], [{"function": {"name": "a b"}}],
                [{"function": {"name": "f"}}, {"function": {"name": "f"}}], [{"function": {"name": "f", "parameters": 3}}]):
        try:
            check_tools(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert '"const": "f"' in call_grammar(tools, "hermes") and "<tool_call>" in call_grammar(tools, "hermes")
    try:
        call_grammar(tools, "hermes", "g")
        raise AssertionError("a name not in tools")
    except ValueError as e:
        assert "'g'" in str(e)


def test_generic_messages_put_tools_calls_and_results_in_plain_messages():
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "tool", "content": "43"}]
    out = generic_messages(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "f"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response>"
    assert all(isinstance(m["content"], str) and set(m) == {"role", "content"} for m in out)
