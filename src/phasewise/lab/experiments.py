"""The classic experiments, run on the engine through the public `LLM` API.

Each experiment returns an `Experiment`: its settings, one row per measured
request (or per batch), the columns a person reads, and short notes. Prompts are
random token ids (the cost of a forward pass does not depend on which tokens),
fresh for every request so that no prefix-cache hit flatters a measurement;
`ignore_eos` makes every request produce exactly the output length asked for.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from phasewise.core.request import RequestMetrics
from phasewise.report import percentile
from phasewise.outputs import CompletionOutput
from phasewise.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject
    from phasewise.llm import LLM

Progress = Callable[[int], None]          # advance(n): n requests done
Row: TypeAlias = dict[str, int | float | str]   # one measurement, or one printed row: column → value


@dataclass
class Column:
    key: str
    header: str
    fmt: str = ".1f"


@dataclass(kw_only=True)
class Experiment:
    name: str
    settings: JsonObject                       # what was asked (results.json)
    rows: list[Row]                            # every measurement (results.csv)
    columns: list[Column]                      # what the printed table shows
    table: list[Row]                           # the printed rows (medians per point, or stats)
    notes: list[str] = field(default_factory=list)
    requests: list[tuple[str, RequestMetrics]] = field(default_factory=list)   # for traces


def default_prompt_lengths(lo: int = 50, hi: int = 3500, steps: int = 10) -> list[int]:
    """`steps` lengths spaced evenly on a log scale from lo to hi (the small end is where prefill changes)."""
    if steps == 1:
        return [hi]
    return sorted({round(lo * (hi / lo) ** (i / (steps - 1))) for i in range(steps)})


class PromptMaker:
    """Fresh random prompts of exact token lengths, reproducible from a seed."""

    def __init__(self, vocab_size: int, seed: int = 0, low: int = 100) -> None:
        self.rng, self.low, self.high = random.Random(seed), min(low, vocab_size - 1), vocab_size

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(self.low, self.high) for _ in range(n)]


def _rate(n: int, ms: float) -> float:
    return n / ms * 1e3 if ms > 0 else 0.0


def request_row(out: CompletionOutput) -> Row:
    """The timings of one finished request, flat (one CSV row)."""
    m = out.metrics
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    runs = max(n_out - 1, 0)
    itl = m.itl_ms
    return {
        "prompt_tokens": n_prompt, "output_tokens": n_out, "cached_tokens": out.cached_tokens,
        "queue_ms": m.queue_ms, "ttft_ms": m.ttft_ms, "prefill_ms": m.prompt_ms,
        "ms_per_prompt_token": m.prompt_ms / max(n_prompt - out.cached_tokens, 1),
        "prompt_tok_s": _rate(n_prompt - out.cached_tokens, m.prompt_ms),
        "decode_ms": m.decode_ms, "ms_per_output_token": m.decode_ms / runs if runs else 0.0,
        "decode_tok_s": _rate(runs, m.decode_ms),
        "itl_median_ms": percentile(itl, 50), "itl_p90_ms": percentile(itl, 90),
        "e2e_ms": m.e2e_ms, "preemptions": m.preemptions,
        "spec_draft_tokens": m.spec_draft_tokens, "spec_accepted_tokens": m.spec_accepted_tokens,
        "spec_acceptance_rate": m.spec_acceptance_rate, "spec_mean_accepted_len": m.spec_mean_accepted_len,
    }


def numbers(rows: Sequence[Row], key: str) -> list[float]:
    """The values of a numeric column (TypeError for a text one)."""
    values = [v for r in rows if not isinstance(v := r[key], str)]
    if len(values) < len(rows):
        raise TypeError(f"the column {key!r} holds text")
    return values


def _median_by(rows: list[Row], key: str) -> list[Row]:
    """One row per distinct `key` value: the median of every numeric field over its runs."""
    groups: dict[int | float | str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return [{k: statistics.median(numbers(group, k)) if isinstance(group[0][k], (int, float)) else group[0][k]
             for k in group[0]} | {"runs": len(group)} for group in groups.values()]


def _ended(out: CompletionOutput) -> float:
    """When a request that `generate` returned (finished) ended."""
    assert out.metrics.finished is not None
    return out.metrics.finished


def _params(max_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)


def _one(llm: LLM, prompt: list[int], max_tokens: int) -> CompletionOutput:
    return llm.generate([prompt], _params(max_tokens))[0]


def _sweep(llm: LLM, key: str, points: Sequence[int], shape: Callable[[int], tuple[int, int]], runs: int,
           seed: int, progress: Progress) -> tuple[list[Row], list[tuple[str, RequestMetrics]]]:
    """One request per point and run, one after another; shape(point) = (prompt tokens, output tokens)."""
    make = PromptMaker(llm.model_config.vocab_size, seed)
    rows, reqs = [], []
    for n in points:
        for run in range(runs):
            prompt_len, output_len = shape(n)
            out = _one(llm, make(prompt_len), output_len)
            rows.append({key: n, "run": run + 1, **request_row(out)})
            reqs.append((f"{key} {n} run {run + 1}", out.metrics))
            progress(1)
    return rows, reqs


def prompt_sweep(llm: LLM, lengths: Sequence[int], output_tokens: int = 199, runs: int = 1, seed: int = 0,
                 progress: Progress = lambda n: None) -> Experiment:
    """Prefill cost per prompt token as the prompt grows, and decode speed as its context grows."""
    rows, reqs = _sweep(llm, "prompt_len", lengths, lambda n: (n, output_tokens), runs, seed, progress)
    cols = [Column("prompt_len", "prompt tokens", "d"), Column("prefill_ms", "prefill ms"),
            Column("ms_per_prompt_token", "ms / prompt tok", ".3f"), Column("prompt_tok_s", "prompt tok/s"),
            Column("decode_tok_s", "decode tok/s"), Column("ms_per_output_token", "ms / output tok", ".2f")]
    table = _median_by(rows, "prompt_len")
    best = min(table, key=lambda r: r["ms_per_prompt_token"])
    notes = [f"cheapest prefill per token at {best['prompt_len']} prompt tokens "
             f"({best['ms_per_prompt_token']:.3f} ms, {best['prompt_tok_s']:.0f} tok/s)",
             f"decode: {table[0]['ms_per_output_token']:.2f} ms/token after {table[0]['prompt_len']} prompt "
             f"tokens, {table[-1]['ms_per_output_token']:.2f} after {table[-1]['prompt_len']}"]
    settings: JsonObject = {"lengths": list(lengths), "output_tokens": output_tokens,
                            "runs": runs, "seed": seed}
    return Experiment(name="prompt-sweep", settings=settings, rows=rows, columns=cols, table=table,
                      notes=notes, requests=reqs)


def output_sweep(llm: LLM, lengths: Sequence[int], prompt_tokens: int = 32, runs: int = 1, seed: int = 0,
                 progress: Progress = lambda n: None) -> Experiment:
    """Total decode time against output length, with the (flat) prefill beside it."""
    rows, reqs = _sweep(llm, "output_len", lengths, lambda n: (prompt_tokens, n), runs, seed, progress)
    cols = [Column("output_len", "output tokens", "d"), Column("prefill_ms", "prefill ms"),
            Column("decode_ms", "decode ms", ".0f"), Column("ms_per_output_token", "ms / output tok", ".2f"),
            Column("decode_tok_s", "decode tok/s"), Column("e2e_ms", "total ms", ".0f")]
    table = _median_by(rows, "output_len")
    pre = [r["prefill_ms"] for r in table]
    notes = [f"prefill stays {min(pre):.1f}–{max(pre):.1f} ms across output lengths; decode grows "
             f"from {table[0]['decode_ms']:.0f} ms to {table[-1]['decode_ms']:.0f} ms"]
    settings: JsonObject = {"lengths": list(lengths), "prompt_tokens": prompt_tokens,
                            "runs": runs, "seed": seed}
    return Experiment(name="output-sweep", settings=settings, rows=rows, columns=cols, table=table,
                      notes=notes, requests=reqs)


REPEAT_TIMINGS = ("ttft_ms", "prefill_ms", "ms_per_output_token", "decode_tok_s", "e2e_ms")


def spread(values: list[float]) -> dict[str, float]:
    """Median, p5, p95, mean, standard deviation and coefficient of variation of a sample."""
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"median": percentile(values, 50), "p5": percentile(values, 5), "p95": percentile(values, 95),
            "mean": mean, "std": std, "cv": std / mean if mean else 0.0,
            "min": min(values), "max": max(values)}


def outliers(values: list[float], k: float = 3.5, min_rel: float = 0.1) -> list[int]:
    """Indices of values farther than k robust deviations (1.4826·MAD) and min_rel from the median."""
    med = statistics.median(values)
    mad = 1.4826 * statistics.median(abs(v - med) for v in values)
    return [i for i, v in enumerate(values)
            if abs(v - med) > max(k * mad, min_rel * abs(med)) and abs(v - med) > 0]


def repeat(llm: LLM, runs: int = 20, prompt_tokens: int = 128, output_tokens: int = 64, seed: int = 0,
           progress: Progress = lambda n: None) -> Experiment:
    """The same request `runs` times, one after another: how much one measurement can mislead."""
    prompt = PromptMaker(llm.model_config.vocab_size, seed)(prompt_tokens)
    rows: list[Row] = []
    reqs: list[tuple[str, RequestMetrics]] = []
    for run in range(runs):
        out = _one(llm, prompt, output_tokens)
        rows.append({"run": run + 1, **request_row(out)})
        reqs.append((f"run {run + 1}", out.metrics))
        progress(1)
    table: list[Row] = []
    notes: list[str] = []
    for key in REPEAT_TIMINGS:
        values = numbers(rows, key)
        table.append({"timing": key, **spread(values)})
        for i in outliers(values):
            first = " (the first run)" if i == 0 else ""
            notes.append(f"outlier: run {i + 1}{first} {key} = {values[i]:.2f}, "
                         f"{values[i] / statistics.median(values):.2f}x the median")
    cols = [Column("timing", "timing", "s"), Column("median", "median", ".2f"), Column("p5", "p5", ".2f"),
            Column("p95", "p95", ".2f"), Column("cv", "CV", ".1%"), Column("min", "min", ".2f"),
            Column("max", "max", ".2f")]
    settings: JsonObject = {"runs": runs, "prompt_tokens": prompt_tokens,
                            "output_tokens": output_tokens, "seed": seed}
    return Experiment(name="repeat", settings=settings, rows=rows, columns=cols, table=table,
                      notes=notes or ["no outliers"], requests=reqs)


def batch_sweep(llm: LLM, concurrencies: Sequence[int], prompt_tokens: int = 128, output_tokens: int = 64,
                seed: int = 0, progress: Progress = lambda n: None) -> Experiment:
    """c requests at once, for each c: aggregate output tokens/s against each request's inter-token
    latency."""
    make = PromptMaker(llm.model_config.vocab_size, seed)
    rows: list[Row] = []
    reqs: list[tuple[str, RequestMetrics]] = []
    for c in concurrencies:
        outs = llm.generate([make(prompt_tokens) for _ in range(c)], _params(output_tokens))
        start = min(o.metrics.arrival for o in outs)
        wall_s = max(_ended(o) for o in outs) - start
        itl = [x for o in outs for x in o.metrics.itl_ms]
        ttft = [o.metrics.ttft_ms for o in outs]
        tokens = sum(len(o.token_ids) for o in outs)
        rows.append({"concurrency": c, "output_tokens": tokens, "wall_s": wall_s,
                     "output_tok_s": tokens / wall_s, "per_request_tok_s": tokens / wall_s / c,
                     "itl_median_ms": percentile(itl, 50), "itl_p90_ms": percentile(itl, 90),
                     "ttft_median_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
                     "preemptions": sum(o.metrics.preemptions for o in outs),
                     "spec_draft_tokens": sum(o.metrics.spec_draft_tokens for o in outs),
                     "spec_accepted_tokens": sum(o.metrics.spec_accepted_tokens for o in outs)})
        reqs += [(f"c={c} #{i}", o.metrics) for i, o in enumerate(outs)]
        progress(c)
    cols = [Column("concurrency", "concurrent", "d"), Column("output_tok_s", "output tok/s"),
            Column("per_request_tok_s", "tok/s per request"), Column("itl_median_ms", "ITL median ms"),
            Column("itl_p90_ms", "ITL p90 ms"), Column("ttft_median_ms", "TTFT median ms", ".0f")]
    tok_s, itl_ms = numbers(rows, "output_tok_s"), numbers(rows, "itl_median_ms")
    top = tok_s.index(max(tok_s))
    notes = [f"{tok_s[top] / tok_s[0]:.1f}x the aggregate throughput of concurrency "
             f"{rows[0]['concurrency']} at concurrency {rows[top]['concurrency']}, for "
             f"{itl_ms[top] / itl_ms[0]:.1f}x the median inter-token latency"]
    settings: JsonObject = {"concurrencies": list(concurrencies), "prompt_tokens": prompt_tokens,
                            "output_tokens": output_tokens, "seed": seed}
    return Experiment(name="batch-sweep", settings=settings, rows=rows, columns=cols, table=rows, notes=notes,
                      requests=reqs)
