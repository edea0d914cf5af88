"""Admission checks of a request before it reaches the engine core, the same for the server and the
CLI: its prompt's token ids against the vocabulary, and prompt + max_tokens against the context and
the KV pool. Each failure is a RequestError (a ValueError naming the request field at fault; the
server's 400, the CLI's one line)."""

from __future__ import annotations

import dataclasses

from phasewise.sampling.params import SamplingParams


class RequestError(ValueError):
    """Bad input in a request; `param` names the field at fault ("prompt" is the prompt or the messages)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """The prompt (plus max_tokens) does not fit the context."""


def check_token_ids(ids: list[int], vocab: int) -> list[int]:
    """A prompt given as token ids: every id must be in the vocabulary."""
    bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is out of range: the vocabulary has {vocab} tokens", "prompt")
    return ids


def fit(n: int, params: SamplingParams, max_model_len: int, kv_tokens: int, vocab: int) -> SamplingParams:
    """Check a prompt of n tokens + max_tokens against the context (max_model_len) and the pool
    (kv_tokens); no max_tokens → as many as fit."""
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"stop_token_ids: token id {bad} is out of range: the vocabulary has {vocab} tokens",
                           "stop_token_ids")
    if n >= max_model_len:
        raise ContextLengthError(f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                                 f"has {n} tokens (at least one token must be left to generate)", "prompt")
    if params.max_tokens is None:
        room = min(max_model_len, kv_tokens) - n
        if room < 1:
            raise ValueError(f"the prompt has {n} tokens, but the KV cache holds only {kv_tokens}: "
                             "raise the KV cache memory")
        return dataclasses.replace(params, max_tokens=room)
    if n + params.max_tokens > max_model_len:
        raise ContextLengthError(f"This model's maximum context length is {max_model_len} tokens, but "
                                 f"{n + params.max_tokens} were requested ({n} in the prompt + "
                                 f"{params.max_tokens} max_tokens): reduce the prompt or max_tokens",
                                 "max_tokens")
    return params
