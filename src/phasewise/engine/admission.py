"""The one rule a request passes before the engine core takes it. `LLMEngine.add_request` applies it,
so the server, the CLI and the offline API all admit alike: the prompt's token ids against the
vocabulary, prompt + max_tokens against the context, and the blocks the request can hold at once
against the KV pool. Each failure is a RequestError (a ValueError naming the request field at
fault; the server's 400, the CLI's one line)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from phasewise.core.sampling_params import SamplingParams


class RequestError(ValueError):
    """Bad input in a request; `param` names the field at fault ("prompt" is the prompt or the messages)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """The prompt (plus max_tokens) does not fit the context."""


class Admission:
    """An engine's limits: its context (max_model_len), vocabulary, and KV pool (`pool_blocks`, with
    `blocks_needed(n)`: the most blocks a request of n tokens holds at once, the core's count)."""

    def __init__(self, max_model_len: int, vocab: int, pool_blocks: int,
                 blocks_needed: Callable[[int], int]) -> None:
        self.max_model_len, self.vocab = max_model_len, vocab
        self.pool_blocks, self.blocks_needed = pool_blocks, blocks_needed

    def check(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """params for a prompt of token ids `ids`, with max_tokens set to as many as fit when it is None;
        RequestError when the request can never run."""
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab)), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is out of range: the vocabulary has {self.vocab} tokens",
                               "prompt")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise RequestError(f"stop_token_ids: token id {bad} is out of range: the vocabulary has "
                               f"{self.vocab} tokens", "stop_token_ids")
        if n >= limit:
            raise ContextLengthError(f"This model's maximum context length is {limit} tokens, but the prompt "
                                     f"has {n} tokens (at least one token must be left to generate)",
                                     "prompt")
        if params.max_tokens is None:
            room = self._longest_fit(limit) - n
            if room < 1:
                raise RequestError(f"the prompt has {n} tokens, but the KV cache holds fewer "
                                   f"({self.pool_blocks} blocks): raise the KV cache memory", "prompt")
            return dataclasses.replace(params, max_tokens=room)
        longest = n + params.max_tokens
        if longest > limit:
            raise ContextLengthError(f"This model's maximum context length is {limit} tokens, but {longest} "
                                     f"were requested ({n} in the prompt + {params.max_tokens} max_tokens): "
                                     "reduce the prompt or max_tokens", "max_tokens")
        need = self.blocks_needed(longest)
        if need > self.pool_blocks:
            raise RequestError(f"{longest} tokens (prompt {n} + up to {params.max_tokens} generated) need "
                               f"{need} KV blocks, but the pool holds {self.pool_blocks}: "
                               "raise the KV cache memory", "max_tokens")
        return params

    def _longest_fit(self, limit: int) -> int:
        """The most tokens (at most `limit`) one request can hold in the pool (blocks_needed grows with n)."""
        lo, hi = 0, limit                      # blocks_needed(lo) fits; find the largest such
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(mid) <= self.pool_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo
