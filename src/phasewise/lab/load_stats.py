"""What a load run measured, per request and in summary: TTFT, TPOT, ITL, end-to-end, throughput, goodput.

Definitions (times in seconds inside records, milliseconds in summaries):
- TTFT: request sent → first content chunk received.
- ITL: gaps between consecutive content chunks of one request (a chunk may carry several tokens).
- TPOT: (end-to-end − TTFT) / (output tokens − 1), per request with at least two output tokens.
- throughput: completed requests, prompt and output tokens (as the server's usage reports them)
  over the benchmark's duration (first send → last response).
- goodput: completed requests per second that met every given SLO (TTFT, TPOT, end-to-end, in ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from typing_extensions import NotRequired, TypedDict   # typing has NotRequired from Python 3.11

from phasewise.report import percentile

SLO_METRICS = ("ttft", "tpot", "e2e")
Latency = Literal["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"]      # a summary's latency keys (`_stats` each)
LATENCIES: tuple[Latency, ...] = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


class Goodput(TypedDict):
    slos_ms: dict[str, float]          # metric → limit (parse_goodput)
    requests: int                      # completed within every SLO
    requests_per_s: float


class LoadSummary(TypedDict):
    """One load run (results.json's runs); times in ms, throughputs per second."""
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    prompt_token_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]          # mean, median, p90, p99 (_stats)
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    usage_reported: bool
    errors: list[str]
    goodput: NotRequired[Goodput]      # with SLOs
    max_concurrency: NotRequired[int | None]   # bench serve's concurrency of the run (None: all at once)


@dataclass(kw_only=True)
class RequestRecord:
    start: float                               # when the request was sent (perf_counter s)
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    # of the prompt, served by the prompt cache (usage's cached_tokens)
    cached_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)   # arrival of each content chunk
    end: float = 0.0
    error: str = ""
    usage_reported: bool = False               # token counts came from the server's usage

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput takes {'|'.join(SLO_METRICS)}:MS, got {spec!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {spec!r}: the limit must be positive")
    return slos


def meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request within every SLO (a TPOT SLO holds trivially for a one-token answer)."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    for name, limit in slos.items():
        value = values[name]
        if value is None:
            if name == "tpot":
                continue
            return False
        if value * 1e3 > limit:
            return False
    return True


def _stats(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    return {"mean": sum(ms) / len(ms) if ms else 0.0, "median": percentile(ms, 50),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def summarize(records: list[RequestRecord], duration_s: float,
              slos: dict[str, float] | None = None) -> LoadSummary:
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    out: LoadSummary = {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
        "prompt_tokens": prompt, "output_tokens": output,
        "request_throughput": rate(len(done)), "prompt_token_throughput": rate(prompt),
        "output_token_throughput": rate(output), "total_token_throughput": rate(prompt + output),
        "ttft_ms": _stats([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": _stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats([g for r in done for g in r.itl]),
        "e2e_ms": _stats([r.e2e for r in done]),
        "usage_reported": all(r.usage_reported for r in done),
        "errors": sorted({r.error for r in records if not r.ok}),
    }
    if slos:
        good = sum(meets(r, slos) for r in records)
        out["goodput"] = {"slos_ms": slos, "requests": good, "requests_per_s": rate(good)}
    return out
