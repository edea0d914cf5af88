"""The sampling fields the OpenAI-shaped bodies share (chat, completions, Responses): OpenAI's, vLLM's and
llama.cpp's spellings, typed, and their SamplingParams fields; and the per-request thinking budgets.

Pydantic checks types; ranges are SamplingParams' (its ValueError names the field, which these bodies
spell as it does), except temperature, whose range is each API's (OpenAI's [0, 2] here).
"""

from __future__ import annotations

from typing import Annotated, TypedDict

from pydantic import BaseModel, Field, StrictBool, WithJsonSchema, field_validator

from phasewise.core.sampling_params import SamplingParams, StructuredOutputs
from phasewise.json_types import JsonObject
from phasewise.server import constraints
from phasewise.server.api_error import bad_request

INT64 = 2 ** 63
MAX_TEMPERATURE = 2        # OpenAI's range of temperature: [0, 2]
RETENTIONS = {"in_memory": None, "24h": 86_400.0}    # prompt_cache_retention → the engine's cache_ttl (s)

# what `stop` takes, as the schema says it (_stop makes it a list)
_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}


class CommonParams(TypedDict, total=False):
    """The SamplingParams fields that every API's request sets alike (the floats when given)."""
    n: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    min_tokens: int
    stop_token_ids: list[int]
    skip_special_tokens: bool
    structured_outputs: StructuredOutputs | None
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    top_k: int
    min_p: float
    repetition_penalty: float
    cache_salt: str | None
    cache_ttl: float | None


class BudgetFields(BaseModel):
    """The per-request thinking budgets taken (server/thinking.py): vLLM's, llama-server's and its other
    spelling; -1: the server's default (--reasoning-budget)."""
    thinking_token_budget: int | None = Field(None, ge=-1, lt=INT64)
    thinking_budget_tokens: int | None = Field(None, ge=-1, lt=INT64)
    reasoning_budget_tokens: int | None = Field(None, ge=-1, lt=INT64)

    def budget_fields(self) -> dict[str, int | None]:
        return {"thinking_token_budget": self.thinking_token_budget,
                "thinking_budget_tokens": self.thinking_budget_tokens,
                "reasoning_budget_tokens": self.reasoning_budget_tokens}


class SamplingFields(BaseModel):
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Annotated[list[str], WithJsonSchema(_STOP)] = Field(default_factory=list)   # checked by _stop
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # the extra (vLLM-style) sampling fields
    top_k: int | None = Field(None, ge=-1, lt=INT64)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0, lt=INT64)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: StrictBool = True
    logit_bias: dict[str, float] | None = None
    # structured outputs (server/constraints.py: vLLM's and llama.cpp's spellings; OpenAI's is each API's own)
    structured_outputs: JsonObject | None = None
    guided_json: JsonObject | str | None = None          # a JSON schema, or its text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None    # accepted and ignored: llguidance is the one backend
    json_schema: JsonObject | str | None = None
    grammar: str | None = None
    # prompt caching: vLLM's salt (requests of other salts share no cached block), OpenAI's key (the Ray
    # prefix router's: deploy/prefix_router.py) and retention ("24h": a day on disk; "in_memory": the default)
    cache_salt: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: object) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("must be a string or a list of strings")

    def common(self, n: int, constraint: StructuredOutputs | None) -> CommonParams:
        """The SamplingParams fields these set, with the request's structured output (`constraint`)."""
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.temperature is not None and not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE}], "
                              f"got {self.temperature}", "temperature")
        fields: CommonParams = {
            "n": n, "seed": self.seed, "stop": self.stop, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids or [],
            "skip_special_tokens": self.skip_special_tokens, "structured_outputs": constraint,
            "cache_salt": self.cache_salt, "cache_ttl": self.cache_ttl()}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return fields

    def cache_ttl(self) -> float | None:
        """prompt_cache_retention as the engine's cache_ttl (None: its default); a bad salt or retention is a
        400."""
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        retention = self.prompt_cache_retention
        if retention is not None and retention not in RETENTIONS:
            raise bad_request(f"prompt_cache_retention must be {' or '.join(map(repr, RETENTIONS))}, got "
                              f"{retention!r}",
                              "prompt_cache_retention")
        return RETENTIONS[retention] if retention is not None else None

    def constraint_fields(self) -> JsonObject:
        """The vLLM and llama.cpp constraint fields by name (constraints.FIELDS; None: not given)."""
        return {name: getattr(self, name) for name in constraints.FIELDS
                if name in SamplingFields.model_fields}


def make_params(fields: CommonParams, max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None, max_tokens_field: str = "max_tokens",
                prompt_only: bool = False) -> SamplingParams:
    """SamplingParams, or a 400 naming the field its ValueError names (max_tokens as the API spells it).
    max_tokens 0 (the prompt only) is taken with prompt_logprobs or when the API calls it a pre-warm
    (`prompt_only`), a 400 otherwise."""
    if max_tokens == 0 and prompt_logprobs is None and not prompt_only:
        raise bad_request(f"{max_tokens_field} must be at least 1, got 0", max_tokens_field)
    try:
        return SamplingParams(**fields, max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)
    except ValueError as e:
        message = str(e)
        param = message.split(" ", 1)[0]
        if param == "max_tokens":
            param = max_tokens_field
        known = param in fields or param in ("logprobs", max_tokens_field)
        raise bad_request(message, param if known else None) from e
