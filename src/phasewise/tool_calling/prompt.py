"""Tools into the prompt, and the grammar that forces a call: what a chat template with or without
tool support needs, and which output format (parser.py) the model will answer in."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import jsonschema

from phasewise.json_types import array, obj, objects, text
from phasewise.tool_calling.parser import ToolFormat

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject, JsonValue

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_CALLS = 8              # calls in one forced reply with parallel_tool_calls
# JSON on one line with OpenAI's separators, as structured outputs write it (structured/grammar_compiler.py)
_JSON_OPTIONS: JsonObject = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

GENERIC_TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the request. Each function is described by a JSON schema:
<tools>
{tools}
</tools>

To call a function, reply with one JSON object per call, naming the function and giving its arguments, each \
inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>"""


def chat_tool_field(i: int, key: str) -> str:
    """Where a chat request keeps tool i's `key` ("name", "parameters"): tools[i].function.key."""
    return f"tools[{i}].function.{key}"


def check_tools(tools: object, field: Callable[[int, str], str] = chat_tool_field) -> list[JsonObject]:
    """OpenAI's `tools` list, checked (ValueError says what is wrong): each {"type": "function",
    "function": {"name", "description"?, "parameters"?}}. field(i, key): where the request that sent
    them keeps tool i's name or parameters, as its errors name them."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{field(i, 'name')} must be 1-64 letters, digits, _ . or -, got {name!r}")
        if name in names:
            raise ValueError(f"{field(i, 'name')} {name!r} appears twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"{field(i, 'parameters')} must be a JSON schema object")
        if params:
            try:
                jsonschema.validators.validator_for(params).check_schema(params)
            except jsonschema.SchemaError as e:
                where = "".join(f"[{p!r}]" for p in e.path)
                raise ValueError(f"{field(i, 'parameters')} is not a valid JSON schema: "
                                 f"{where + ' ' if where else ''}{e.message}") from None
    return tools


def tool_format(template: str) -> ToolFormat:
    """The format a model with this chat template calls tools in: "mistral" for [TOOL_CALLS],
    "llama3_json" for Llama 3.1+'s JSON calls, else "hermes" (<tool_call> blocks: Qwen2.5, Qwen3,
    Hermes, and the generic prompt)."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def supports_tools(template: str) -> bool:
    """The template renders a `tools` list itself."""
    return "tools" in template


def _arguments(call: Mapping[str, JsonValue]) -> tuple[JsonValue, JsonValue]:
    """A tool call's (name, arguments), the arguments as an object when they are JSON text."""
    fn: Mapping[str, JsonValue] = obj(call["function"]) if "function" in call else call
    args = fn.get("arguments", {})
    if isinstance(args, str):              # OpenAI sends arguments as JSON text; templates want the object
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return fn.get("name", ""), args


def native_messages(messages: Sequence[Mapping[str, JsonValue]]) -> list[Mapping[str, JsonValue]]:
    """Messages for a template with tool support: each tool call's arguments as an object."""
    out: list[Mapping[str, JsonValue]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls: list[JsonValue] = []
            for c in objects(m["tool_calls"]):
                name, args = _arguments(c)
                function = {**obj(c.get("function", {})), "name": name, "arguments": args}
                calls.append({**c, "function": function})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def generic_messages(messages: Sequence[Mapping[str, JsonValue]],
                     tools: Sequence[Mapping[str, JsonValue]] | None) -> list[JsonObject]:
    """Messages for a template without tool support: the tools in the system message (GENERIC_TOOLS_PROMPT),
    an assistant's calls as <tool_call> blocks in its content, tool results as a user message of
    <tool_response> blocks. Every content is a string."""
    out: list[JsonObject] = []
    if tools:
        block = GENERIC_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system",
                        "content": f"{messages[0].get('content') or ''}\n\n{block}".lstrip()})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] = f"{out[-1]['content']}\n{response}"
            else:
                out.append({"role": "user", "content": response, "_tool": True})
            continue
        if m.get("tool_calls"):
            calls = []
            for c in objects(m["tool_calls"]):
                name, args = _arguments(c)
                call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
                calls.append(f"<tool_call>\n{call}\n</tool_call>")
            content = "\n".join(([text(content)] if content else []) + calls)
        out.append({"role": m["role"], "content": content})
    return [{k: v for k, v in m.items() if k != "_tool"} for m in out]


def call_grammar(tools: Sequence[Mapping[str, JsonValue]], fmt: str, name: str | None = None,
                 parallel: bool = True) -> str:
    """A Lark grammar (llguidance's, with inline JSON schemas) whose every sentence is one call (or, with
    parallel, one to MAX_CALLS) of the named tool or of any of them, with arguments of its parameters'
    schema."""
    functions = [obj(t["function"]) for t in tools]
    chosen = [f for f in functions if name is None or f["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    key = "parameters" if fmt == "llama3_json" else "arguments"
    objects: list[JsonObject] = [{"type": "object", "additionalProperties": False, "required": ["name", key],
                                  "properties": {"name": {"const": f["name"]},
                                                 key: closed(f.get("parameters") or {"type": "object"})}}
                                 for f in chosen]
    schema: JsonObject = {**(objects[0] if len(objects) == 1 else {"anyOf": [*objects]}),
                          "x-guidance": _JSON_OPTIONS}
    call = f"%json {json.dumps(schema, ensure_ascii=False)}"
    more = f"~0..{MAX_CALLS - 1}"           # a small model forced to call may never stop calling
    if fmt == "llama3_json":
        repeat = f' ("; " call){more}' if parallel else ""
        return f"start: call{repeat}\ncall: {call}\n"
    if fmt == "mistral":
        repeat = f' (", " call){more}' if parallel else ""
        return f'start: "[TOOL_CALLS][" call{repeat} "]"\ncall: {call}\n'
    repeat = f' ("\\n" call){more}' if parallel else ""
    return f'start: call{repeat}\ncall: "<tool_call>\\n" {call} "\\n</tool_call>"\n'


# the keywords whose values are one schema, a list of schemas, or a map of names to schemas
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "prefixItems")       # not allOf: its branches' properties add up
_MAP = ("properties", "$defs", "definitions", "dependentSchemas")


def closed(schema: JsonValue) -> JsonValue:
    """A call's arguments schema with every object that lists its `properties` closed to other keys
    (additionalProperties false) unless it says what they may be (additionalProperties or
    patternProperties): a JSON schema leaves them open, and a forced call would then carry keys the
    tool does not take."""
    if not isinstance(schema, dict):
        return schema
    out: JsonObject = dict(schema)
    for k in _ONE:
        if k in out:
            out[k] = closed(out[k])
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [closed(v) for v in array(out[k])]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(v) for name, v in obj(out[k]).items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties",
                                    "allOf"} & set(out):
        out["additionalProperties"] = False
    return out
