"""The experiments' pictures: one PNG per plot, drawn with matplotlib's Agg backend (no screen)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from phasewise.lab.experiments import REPEAT_TIMINGS, Experiment, numbers  # noqa: E402


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _log_ticks(ax: Axes, x: Sequence[float], base: float = 10) -> None:
    """A log x axis labelled with the measured points themselves."""
    ax.set_xscale("log", base=base)
    ax.set_xticks(x, [str(v) for v in x], fontsize=8)
    ax.minorticks_off()


def _twin(ax: Axes, x: Sequence[float], y1: Sequence[float], label1: str, y2: Sequence[float], label2: str,
          color2: str = "tab:orange") -> Axes:
    ax.plot(x, y1, "o-", color="tab:blue")
    ax.set_ylabel(label1, color="tab:blue")
    right = ax.twinx()
    right.plot(x, y2, "s--", color=color2)
    right.set_ylabel(label2, color=color2)
    return right


def prompt_sweep(exp: Experiment, out: Path) -> list[Path]:
    t = exp.table
    x = numbers(t, "prompt_len")
    fig, ax = plt.subplots(figsize=(7, 4))
    _twin(ax, x, numbers(t, "ms_per_prompt_token"), "prefill ms per prompt token",
          numbers(t, "prompt_tok_s"), "prompt tokens / s")
    _log_ticks(ax, x)
    ax.set_xlabel("prompt tokens")
    ax.set_title("Prefill: cost per prompt token")
    paths = [_save(fig, out / "prefill_per_token.png")]
    fig, ax = plt.subplots(figsize=(7, 4))
    _twin(ax, x, numbers(t, "ms_per_output_token"), "decode ms per output token",
          numbers(t, "decode_tok_s"), "decode tokens / s")
    ax.set_xlabel("prompt tokens (the context decode attends to)")
    ax.set_title(f"Decode speed against context ({exp.settings['output_tokens']} output tokens)")
    paths.append(_save(fig, out / "decode_vs_context.png"))
    return paths


def output_sweep(exp: Experiment, out: Path) -> list[Path]:
    t = exp.table
    x = numbers(t, "output_len")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [ms / 1e3 for ms in numbers(t, "decode_ms")], "o-", label="decode (all output tokens)")
    ax.plot(x, [ms / 1e3 for ms in numbers(t, "prefill_ms")], "s--", label="prefill")
    ax.set_xlabel("output tokens")
    ax.set_ylabel("seconds")
    ax.set_title(f"Decode grows with output, prefill does not ({exp.settings['prompt_tokens']}-token prompt)")
    ax.legend()
    paths = [_save(fig, out / "decode_time.png")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, numbers(t, "ms_per_output_token"), "o-")
    ax.set_xlabel("output tokens")
    ax.set_ylabel("ms per output token")
    ax.set_ylim(bottom=0)
    ax.set_title("Decode cost per token as the output grows")
    paths.append(_save(fig, out / "ms_per_output_token.png"))
    return paths


def repeat(exp: Experiment, out: Path) -> list[Path]:
    runs = [r["run"] for r in exp.rows]
    fig, axes = plt.subplots(len(REPEAT_TIMINGS), 1, figsize=(7, 2.2 * len(REPEAT_TIMINGS)), sharex=True)
    for ax, stat in zip(axes, exp.table):
        key = str(stat["timing"])
        ax.plot(runs, [r[key] for r in exp.rows], "o-", ms=4)
        ax.axhline(stat["median"], color="gray", lw=1)
        ax.axhspan(stat["p5"], stat["p95"], color="gray", alpha=0.15)
        ax.set_ylabel(key, fontsize=8)
    axes[0].set_title(f"The same request {len(runs)} times (line: median, band: p5–p95)")
    axes[-1].set_xlabel("run")
    return [_save(fig, out / "runs.png")]


def batch_sweep(exp: Experiment, out: Path) -> list[Path]:
    t = exp.rows
    x = numbers(t, "concurrency")
    fig, ax = plt.subplots(figsize=(7, 4))
    _twin(ax, x, numbers(t, "output_tok_s"), "aggregate output tokens / s",
          numbers(t, "itl_median_ms"), "median inter-token latency, ms")
    _log_ticks(ax, x, base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_title("Batching: throughput and latency")
    paths = [_save(fig, out / "throughput_vs_concurrency.png")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(numbers(t, "itl_median_ms"), numbers(t, "output_tok_s"), "o-")
    for r in t:
        ax.annotate(str(r["concurrency"]), (r["itl_median_ms"], r["output_tok_s"]),
                    textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlabel("median inter-token latency per request, ms")
    ax.set_ylabel("aggregate output tokens / s")
    ax.set_title("The latency / throughput trade-off (labels: concurrency)")
    paths.append(_save(fig, out / "tradeoff.png"))
    return paths


PLOTS = {"prompt-sweep": prompt_sweep, "output-sweep": output_sweep, "repeat": repeat,
         "batch-sweep": batch_sweep}


def draw(exp: Experiment, out: Path) -> list[Path]:
    return PLOTS[exp.name](exp, out)
