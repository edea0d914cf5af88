"""Where one request's time went, as every API's response reports it (`timings`: llama.cpp-style keys, the
output split into thinking and answer, ITL percentiles, speculation's counts when it ran, the disk tier's
tokens and load time when it gave some)."""

from __future__ import annotations

from typing import Literal, get_args

from phasewise.json_types import JsonObject
from phasewise.outputs import CompletionOutput
from phasewise.report import percentile, timings as report_timings

TimingKey = Literal["queue_ms", "ttft_ms", "prompt_n", "cache_n", "prompt_ms", "prompt_per_second",
                    "predicted_n", "predicted_ms", "predicted_per_second", "total_ms", "preemptions",
                    "thinking_n", "thinking_ms", "ttfa_ms"]
SpecKey = Literal["spec_draft_n", "spec_accepted_n", "spec_acceptance_rate", "spec_mean_accepted_len"]
DiskKey = Literal["disk_n", "disk_load_ms"]
TIMING_KEYS: tuple[TimingKey, ...] = get_args(TimingKey)
SPEC_KEYS: tuple[SpecKey, ...] = get_args(SpecKey)
DISK_KEYS: tuple[DiskKey, ...] = get_args(DiskKey)


def timings(out: CompletionOutput) -> JsonObject:
    """Where the time of one request went (llama.cpp-style keys, plus ITL percentiles); the output split
    into thinking (thinking_n tokens, thinking_ms) and answer (ttfa_ms: its first token, beside ttft_ms)."""
    t = report_timings(out)
    body: JsonObject = {k: t[k] for k in TIMING_KEYS}
    itl = t["itl_ms"]
    body["itl_ms_p50"] = percentile(itl, 50)
    body["itl_ms_p99"] = percentile(itl, 99)
    if t["spec_draft_n"]:                      # speculative decoding ran on this request
        for k in SPEC_KEYS:
            body[k] = t[k]
    if t["disk_n"]:                            # of cache_n, tokens loaded from the prompt cache's disk tier
        for d in DISK_KEYS:
            body[d] = t[d]
    return body
