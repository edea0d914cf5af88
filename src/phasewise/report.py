"""Where the time went: llama.cpp-style perf lines and the JSON timings of one request."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict   # typing has NotRequired from Python 3.11

from phasewise.outputs import CompletionOutput


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (numpy's default method); 0.0 for no values. The one definition
    the report, the server's timings, the lab and the load statistics share."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Timings(TypedDict):
    """One request's timings, llama.cpp's keys (ms, tokens, tokens per second)."""
    load_ms: NotRequired[float]
    queue_ms: float
    prompt_n: int
    cache_n: int
    disk_n: int                     # of cache_n, the tokens loaded from the prompt cache's disk tier,
    disk_load_ms: float             # and the time that took (before the prefill: part of queue_ms)
    prompt_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    ttft_ms: float
    thinking_n: int                 # output tokens inside the thinking block (0 when nothing was thought)
    thinking_ms: float              # first token → the end of the thinking
    ttfa_ms: float | None           # arrival → the first answer token (None: no answer token yet)
    itl_ms: list[float]
    total_ms: float
    preemptions: int
    spec_draft_n: int
    spec_accepted_n: int
    spec_acceptance_rate: float
    spec_mean_accepted_len: float
    spec_k_chosen: NotRequired[dict[str, int]]        # adaptive speculation: drafts chosen → decode steps
    # the measured costs of its last choice: plain, row, draft
    spec_costs_ms: NotRequired[dict[str, float]]


class GenerateJson(TypedDict):
    """The `generate --json` object."""
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    timings: Timings


def _rate(n: int, ms: float) -> float:
    return n / ms * 1e3 if ms > 0 else 0.0


def timings(out: CompletionOutput, load_ms: float | None = None) -> Timings:
    """prompt_* is the prefill (first scheduled → first token); predicted_* the decode steps after it."""
    m = out.metrics
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    runs = max(n_out - 1, 0)
    t: Timings = {
        "queue_ms": m.queue_ms,
        "prompt_n": n_prompt,
        "cache_n": out.cached_tokens,
        "disk_n": m.disk_tokens,
        "disk_load_ms": m.disk_load_ms,
        "prompt_ms": m.prompt_ms,
        "prompt_per_second": _rate(n_prompt - out.cached_tokens, m.prompt_ms),
        "predicted_n": runs,
        "predicted_ms": m.decode_ms,
        "predicted_per_second": _rate(runs, m.decode_ms),
        "ttft_ms": m.ttft_ms,
        "thinking_n": m.thinking_tokens,
        "thinking_ms": m.thinking_ms,
        "ttfa_ms": m.ttfa_ms,
        "itl_ms": m.itl_ms,
        "total_ms": m.e2e_ms,
        "preemptions": m.preemptions,
        "spec_draft_n": m.spec_draft_tokens,          # speculative decoding: drafts verified,
        "spec_accepted_n": m.spec_accepted_tokens,    # accepted,
        "spec_acceptance_rate": m.spec_acceptance_rate,
        "spec_mean_accepted_len": m.spec_mean_accepted_len,   # tokens per verification step (accepted + 1)
    }
    if m.spec_k_chosen:
        t["spec_k_chosen"] = {str(k): n for k, n in sorted(m.spec_k_chosen.items(), reverse=True)}
    if m.spec_costs is not None:
        t["spec_costs_ms"] = dict(zip(("plain", "row", "draft"), m.spec_costs))
    if load_ms is not None:
        t = {"load_ms": load_ms, **t}
    return t


def _chosen_line(t: Timings) -> list[str]:
    """Adaptive speculation's choices (k × decode steps) and the costs they were made from."""
    if "spec_k_chosen" not in t:
        return []
    costs = t.get("spec_costs_ms")
    said = "" if costs is None else (f" (a plain step {costs['plain']:.1f} ms, a draft row "
                                     f"+{costs['row']:.2f} ms, a draft step {costs['draft']:.2f} ms)")
    return ["drafts chosen    = " + ", ".join(f"{k} x {n}" for k, n in t["spec_k_chosen"].items()) + said]


def timings_json(out: CompletionOutput, load_ms: float) -> GenerateJson:
    """The `generate --json` object."""
    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "finish_reason": out.finish_reason,
        "timings": timings(out, load_ms),
    }


def perf_lines(out: CompletionOutput, load_ms: float) -> list[str]:
    t = timings(out, load_ms)
    n_prompt, runs = t["prompt_n"], t["predicted_n"]
    itl = t["itl_ms"]
    per_prompt = t["prompt_ms"] / n_prompt if n_prompt else 0.0
    per_run = t["predicted_ms"] / runs if runs else 0.0
    answer = f"{t['ttfa_ms']:.1f} ms" if t["ttfa_ms"] is not None else "none"
    return [
        f"load time        = {load_ms:9.1f} ms",
    ] + ([f"prompt cache     = {t['disk_load_ms']:9.1f} ms / {t['disk_n']:5d} tokens read from disk"]
         if t["disk_n"] else []) + [
        f"prompt eval time = {t['prompt_ms']:9.1f} ms / {n_prompt:5d} tokens "
        f"({per_prompt:.2f} ms per token, {t['prompt_per_second']:.1f} tokens per second)",
        f"eval time        = {t['predicted_ms']:9.1f} ms / {runs:5d} runs   "
        f"({per_run:.2f} ms per token, {t['predicted_per_second']:.1f} tokens per second)",
        f"time to first token = {t['ttft_ms']:.1f} ms, inter-token latency median "
        f"{percentile(itl, 50):.1f} ms, p90 {percentile(itl, 90):.1f} ms",
    ] + ([f"thinking         = {t['thinking_ms']:9.1f} ms / {t['thinking_n']:5d} tokens, first answer token "
          f"at {answer}"] if t["thinking_n"] else []) + [
        f"total time       = {t['total_ms']:9.1f} ms / {n_prompt + len(out.token_ids):5d} tokens"
        + (f" ({t['preemptions']} preemptions)" if t["preemptions"] else ""),
    ] + ([f"speculative      = {t['spec_accepted_n']} of {t['spec_draft_n']} draft tokens accepted "
          f"({t['spec_acceptance_rate']:.1%}), {t['spec_mean_accepted_len']:.2f} tokens per verification "
          "step"]
         if t["spec_draft_n"] else []) + _chosen_line(t)
