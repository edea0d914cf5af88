"""Request bodies of the OpenAI-compatible API, their conversion to SamplingParams, and API errors.

Pydantic checks types only (unknown fields are ignored); ranges are checked by
SamplingParams, whose messages name the field. Every failure becomes an APIError,
rendered in OpenAI's shape {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from phasewise.sampling.params import SamplingParams
from phasewise.server import constraints

MAX_CHOICES = 128          # n x prompts of one API call
INT64 = 2 ** 63


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class KVTransferParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
    transfer_id: str = Field(min_length=1, max_length=200)


# Request fields of OpenAI's, vLLM's and llama.cpp's servers that would change the output and that
# this server does not implement: a 400 naming the field, never silently ignored. Fields that change
# nothing in the output (user, metadata, store, service_tier, cache_prompt ...) pass.
UNSUPPORTED_FIELDS = frozenset({
    # constrained output (vLLM): free whitespace inside JSON
    "guided_whitespace_pattern",
    # tools and formats (OpenAI)
    "functions", "function_call", "tool_choice", "prediction", "audio", "modalities", "reasoning_effort",
    "web_search_options", "verbosity",
    # sampling and penalties (vLLM, llama.cpp)
    "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "logits_processors", "typical_p",
    "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent",
    "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "repeat_last_n", "penalty_last_n", "repeat_penalty",
    "top_n_sigma", "samplers", "n_predict", "n_probs", "truncate_prompt_tokens", "include_stop_str_in_output",
})


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Request:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value is not None:
                raise bad_request(f"{name} is not supported by this server", name)
        return self

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # the extra (vLLM-style) sampling fields
    top_k: int | None = Field(None, ge=-1, lt=INT64)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=INT64)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    # structured outputs (server/constraints.py: OpenAI's, vLLM's and llama.cpp's spellings)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None    # accepted and ignored: llguidance is the one backend
    json_schema: Any = None
    grammar: Any = None
    # prefill/decode disaggregation (set by `serve --role proxy`): the transfer carrying this prompt's KV
    kv_transfer_params: KVTransferParams | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("must be a string or a list of strings")

    def _common(self) -> dict[str, Any]:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        fields = {
            "n": self.n, "seed": self.seed, "stop": self.stop, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids or [],
            "skip_special_tokens": self.skip_special_tokens,
            "structured_outputs": constraints.structured_outputs(
                {name: getattr(self, name) for name in constraints.FIELDS}, bad_request)}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return fields

    @property
    def constraint_field(self) -> str | None:
        """The field that constrains the output (response_format, structured_outputs, ...), or None."""
        return constraints.given_field({name: getattr(self, name) for name in constraints.FIELDS})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


_IDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
_PROMPT = {"anyOf": [{"type": "string"}, _IDS,
                     {"type": "array", "items": {"anyOf": [{"type": "string"}, _IDS]}, "minItems": 1}]}


class CompletionRequest(_Request):
    prompt: Any = Field(json_schema_extra=_PROMPT)     # checked by _prompt; the schema says what it takes
    max_tokens: int | None = Field(16, ge=-INT64, lt=INT64)   # OpenAI's and vLLM's default here
    logprobs: int | None = Field(None, ge=-INT64, lt=INT64)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        """One prompt or a batch: text, token ids, a list of texts, or a list of token-id lists."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(v, str):
            return [v]
        if ids(v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
            return v
        raise ValueError("must be a string, a list of token ids, or a non-empty list of either")

    def prompts(self) -> list[str | list[int]]:
        return self.prompt

    def sampling_params(self) -> SamplingParams:
        """With echo, the prompt's tokens come back before the completion, with their logprobs when
        logprobs is set (the engine's prompt_logprobs), and max_tokens may be 0 (the prompt only)."""
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (use n)", "best_of")
        if self.n * len(self.prompt) > MAX_CHOICES:
            raise bad_request(f"n x the number of prompts must be at most {MAX_CHOICES}", "n")
        prompt_logprobs = None
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            prompt_logprobs = self.logprobs or 0
        return make_params(self._common(), self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


ROLES = ("system", "developer", "user", "assistant")   # developer: OpenAI's newer name of system


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        if self.role not in ROLES:
            raise bad_request(f"messages: a role must be one of {', '.join(ROLES)}, got {self.role!r}"
                              + (" (tool calling is not supported yet)" if self.role in ("tool", "function") else ""),
                              "messages")
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=-INT64, lt=INT64)   # None: as many as the context allows
    max_completion_tokens: int | None = Field(None, ge=-INT64, lt=INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-INT64, lt=INT64)
    tools: list[Any] | None = None

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        return [m.as_dict() for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= SamplingParams.MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}], "
                              f"got {self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return make_params(self._common(), max_tokens, logprobs)


def make_params(fields: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(**fields, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except ValueError as e:
        message = str(e)
        param = message.split(" ", 1)[0]
        raise bad_request(message, param if param in fields or param in ("max_tokens", "logprobs") else None) from e


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The params of choice i: with a seed, choice i gets seed + i so the choices differ."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % 2 ** 64)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes → a validated model, or a 400 APIError with a message a person can read."""
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


def _lone_surrogate(obj: Any, path: str = "") -> str | None:
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


def validation_message(errors: Sequence[dict]) -> tuple[str, str | None]:
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


def _is_type_tag(part: Any) -> bool:
    """Union members show up in pydantic locations as 'str', 'list[TextPart]', ...: not field names."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict", "none")
                                      or "[" in part)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model` (the routes parse bodies themselves, to
    answer 400 in OpenAI's shape rather than FastAPI's 422, so FastAPI cannot see the model)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_schemas() -> dict[str, Any]:
    """The JSON Schemas of every request body (and what they use), for the OpenAPI components."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "validation") for m in BODIES], ref_template="#/components/schemas/{model}")
    return top["$defs"]
