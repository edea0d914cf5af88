"""Engine outputs → OpenAI-shaped response bodies: choices, chunks, logprobs, usage, timings."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from phasewise.engine.outputs import TokenLogprobs
from phasewise.engine.request import percentile
from phasewise.outputs import CompletionOutput
from phasewise.report import timings as report_timings

TIMING_KEYS = ("queue_ms", "ttft_ms", "prompt_n", "cache_n", "prompt_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_second", "total_ms", "preemptions")


def timings(out: CompletionOutput) -> dict[str, Any]:
    """Where the time of one request went (llama.cpp-style keys, plus ITL percentiles)."""
    t = report_timings(out)
    body = {k: t[k] for k in TIMING_KEYS}
    itl = t["itl_ms"]
    body["itl_ms_p50"] = percentile(itl, 50)
    body["itl_ms_p99"] = percentile(itl, 99)
    if t["spec_draft_n"]:                      # speculative decoding ran on this request
        for k in ("spec_draft_n", "spec_accepted_n", "spec_acceptance_rate", "spec_mean_accepted_len"):
            body[k] = t[k]
    return body


def usage(per_prompt: Sequence[CompletionOutput], outputs: Sequence[CompletionOutput]) -> dict[str, Any]:
    """Prompt tokens counted once per prompt (not per choice), completion tokens over all choices."""
    prompt = sum(len(o.prompt_token_ids) for o in per_prompt)
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in per_prompt)}}


class TokenText:
    """Token id → its text (special tokens kept), cached; and the logprob bodies built from them."""

    def __init__(self, tokenizer: Any) -> None:
        self._text = lru_cache(maxsize=65536)(
            lambda i: tokenizer.decode([i], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)

    def completion_logprobs(self, token_ids: Sequence[int], lps: Sequence[TokenLogprobs],
                            offset: int = 0) -> dict[str, Any]:
        """The legacy completions format; text_offset counts from `offset` (characters of text so far)."""
        tokens = [self(t) for t in token_ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self(i): v for i, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, token_ids: Sequence[int], lps: Sequence[TokenLogprobs]) -> dict[str, Any]:
        def entry(i: int, v: float) -> dict[str, Any]:
            s = self(i)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in zip(token_ids, lps)]}


def _stop_reason(out: CompletionOutput) -> str | int | None:
    return out.stop_reason


def completion_body(rid: str, created: int, model: str, outputs: Sequence[CompletionOutput],
                    per_prompt: Sequence[CompletionOutput], want_logprobs: bool, tt: TokenText) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        choice = {"index": i, "text": out.text,
                  "logprobs": tt.completion_logprobs(out.token_ids, out.logprobs or []) if want_logprobs else None,
                  "finish_reason": out.finish_reason, "stop_reason": _stop_reason(out)}
        if len(outputs) > 1:
            choice["timings"] = timings(out)
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(per_prompt, outputs), "timings": timings(outputs[0])}


def chat_body(rid: str, created: int, model: str, outputs: Sequence[CompletionOutput], want_logprobs: bool,
              tt: TokenText) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outputs):
        choice = {"index": i, "message": {"role": "assistant", "content": out.text},
                  "logprobs": tt.chat_logprobs(out.token_ids, out.logprobs or []) if want_logprobs else None,
                  "finish_reason": out.finish_reason, "stop_reason": _stop_reason(out)}
        if len(outputs) > 1:
            choice["timings"] = timings(out)
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(outputs[:1], outputs), "timings": timings(outputs[0])}


def chunk(rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]],
          include_usage: bool, **extra: Any) -> dict[str, Any]:
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:
        body["usage"] = None
    body.update(extra)
    return body
