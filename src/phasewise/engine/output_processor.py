"""OutputProcessor: the engine core's token deltas → text deltas and completion outputs, one request
at a time (detokenization, stop strings, logprobs, finish and stop reasons), as vLLM v1 keeps it
beside its core. The core stays tokenizer-free."""

from __future__ import annotations

from dataclasses import dataclass

from phasewise.core.handoffs import RequestOutput
from phasewise.core.request import FinishReason, Request
from phasewise.outputs import CompletionOutput, StreamDelta
from phasewise.tokenization.detokenizer import IncrementalDetokenizer
from phasewise.tokenization.tokenizer import Tokenizer


@dataclass
class _Tracked:
    output: CompletionOutput
    detok: IncrementalDetokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}

    def add(self, request: Request, prompt_text: str | None) -> None:
        """Track a request the core has taken (its output starts empty)."""
        params = request.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                       params.stop)
        out = CompletionOutput(request_id=request.request_id, prompt=prompt_text,
                               prompt_token_ids=request.prompt_token_ids, text="", token_ids=[],
                               finish_reason=None, stop_reason=None,
                               logprobs=[] if params.logprobs is not None else None,
                               metrics=request.metrics)
        self._tracked[request.request_id] = _Tracked(out, detok)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def request_ids(self) -> list[str]:
        return list(self._tracked)

    def output(self, request_id: str) -> CompletionOutput:
        """The request's output so far (complete once finish_reason is set)."""
        return self._tracked[request_id].output

    def abort(self, request_id: str) -> None:
        """Stop tracking a request; an unfinished output ends with finish_reason "abort"."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and tracked.output.finish_reason is None:
            tracked.output.finish_reason = FinishReason.ABORT.value

    def process(self, o: RequestOutput) -> StreamDelta:
        """One step's tokens of a tracked request as text. A delta that is finished while `o` is not
        was ended by a stop string: the caller ends it in the core too."""
        tracked = self._tracked[o.request_id]
        out, detok = tracked.output, tracked.detok
        new_ids, new_lps = o.new_token_ids, o.new_logprobs
        if len(new_ids) > 1 and detok.has_stop_strings:   # accepted drafts: keep none past a stop string
            text = ""
            for i, t in enumerate(new_ids):
                text += detok.add([t])
                if detok.stopped:
                    new_ids, new_lps = new_ids[:i + 1], new_lps[:i + 1]
                    break
        else:
            text = detok.add(new_ids)
        out.token_ids.extend(new_ids)
        out.cached_tokens = o.request.num_cached_tokens or 0
        if out.prompt_logprobs is None and o.request.prompt_logprobs is not None:   # the prompt has run
            out.prompt_logprobs = list(o.request.prompt_logprobs)
        if out.logprobs is not None:
            out.logprobs.extend(new_lps)
        finished, reason = o.finished, o.finish_reason
        if detok.stopped:
            finished, reason = True, FinishReason.STOP
        if finished:
            if detok.stopped:
                out.stop_reason = detok.stop_reason
            else:
                text += detok.finish()
                last = out.token_ids[-1] if out.token_ids else None
                if reason is FinishReason.STOP and last in o.request.sampling_params.stop_token_ids:
                    out.stop_reason = last
                if reason is FinishReason.ERROR:
                    out.error = _refusal(o.request, last, self.tokenizer)
            assert reason is not None                     # a finished output has its reason
            out.finish_reason = reason.value
            del self._tracked[o.request_id]
        out.text += text
        return StreamDelta(request_id=o.request_id, text=text, token_ids=list(new_ids),
                           logprobs=list(new_lps), finished=finished, output=out)


def _refusal(request: Request, token_id: int | None, tokenizer: Tokenizer) -> str:
    """Why a request ended in error: the token its grammar refused (the only error a step leaves in an
    output)."""
    grammar = request.grammar
    cause = (grammar.error or "").splitlines()[0] if grammar is not None else ""
    token = "a token" if token_id is None else \
        f"token {token_id} ({tokenizer.decode([token_id], skip_special_tokens=False)!r})"
    if cause == "NoExtensionBias":      # llguidance: no token of the vocabulary continues the output
        return f"{DEAD_END}: no token of this model's vocabulary continues the output, and it is not complete"
    return f"the output's grammar refused {token}" + (f": {cause}" if cause else "")


# how an output's error starts when its constraint cannot be completed (the request's fault, not the engine's)
DEAD_END = "the output's constraint cannot be completed"
