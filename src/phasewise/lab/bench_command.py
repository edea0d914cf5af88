"""`phasewise bench serve --base-url URL`: load any OpenAI-compatible server and report where latency goes."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from phasewise.lab.experiment_command import int_list
from phasewise.lab.load_stats import LATENCIES, Latency, LoadSummary, RequestRecord, parse_goodput, summarize

if TYPE_CHECKING:
    from rich.console import Console

    # imported when a benchmark runs: httpx stays out of other commands
    from phasewise.lab import load_gen as G

ParserT = TypeVar("ParserT", bound=argparse.ArgumentParser)   # the parser class of the CLI's subcommands


def add_parser(sub: argparse._SubParsersAction[ParserT]) -> None:
    bench = sub.add_parser("bench", help="load generators")
    kinds = bench.add_subparsers(dest="bench", required=True)
    s = kinds.add_parser("serve", help="load an OpenAI-compatible server: TTFT, TPOT, ITL, latency, "
                                       "throughput, goodput")
    s.add_argument("--base-url", required=True,
                   help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    s.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--api-key", default=None)
    d = s.add_argument_group("dataset")
    d.add_argument("--dataset", choices=["random", "shared-prefix", "file"], default="random")
    d.add_argument("--num-prompts", type=int, default=64)
    d.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    d.add_argument("--output-len", type=int, default=64, help="output tokens asked for (max_tokens)")
    d.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by ± this fraction")
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    d.add_argument("--suffixes-per-prefix", type=int, default=8, help="shared-prefix: prompts per prefix")
    d.add_argument("--prefix-len", type=int, default=256)
    d.add_argument("--suffix-len", type=int, default=32)
    d.add_argument("--dataset-path", default=None, help="file: a text file, one prompt per paragraph")
    d.add_argument("--text-prompts", action="store_true",
                   help="random words instead of token ids (always so for --endpoint chat)")
    d.add_argument("--vocab-size", type=int, default=32000, help="random token ids are drawn below this")
    d.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict servers)")
    lo = s.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests/s (default: all at once)")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    lo.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    lo.add_argument("--sweep", type=int_list, default=None,
                    help="run once per max-concurrency value (e.g. 1,2,4,8) and plot the trade-off")
    lo.add_argument("--num-warmup", type=int, default=2, help="requests sent first and not counted")
    lo.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                    help="SLOs for goodput, e.g. ttft:500 tpot:50 e2e:5000")
    lo.add_argument("--seed", type=int, default=0)
    s.add_argument("--result-dir", default=None, help="write results.json, requests.csv (and sweep.png) here")
    s.set_defaults(func=cmd_bench_serve)


def _check(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len", "num_prefixes", "suffixes_per_prefix",
                 "prefix_len", "suffix_len", "vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.num_warmup < 0:
        raise ValueError(f"--num-warmup must be >= 0, got {args.num_warmup}")
    if args.dataset == "file" and not args.dataset_path:
        raise ValueError("--dataset file needs --dataset-path")


def prompts_for(args: argparse.Namespace, n: int, seed: int) -> list[G.Prompt]:
    from phasewise.lab import load_gen as G

    ids = not args.text_prompts and args.endpoint == "completions"
    if args.dataset == "random":
        return G.random_prompts(n, args.input_len, args.output_len, args.range_ratio, seed,
                                ids, args.vocab_size)
    if args.dataset == "shared-prefix":
        return G.shared_prefix_prompts(args.num_prefixes, args.suffixes_per_prefix, args.prefix_len,
                                       args.suffix_len, args.output_len, seed, ids, args.vocab_size)
    return G.file_prompts(args.dataset_path, n, args.output_len)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from phasewise.lab import load_gen as G

    _check(args)
    slos = parse_goodput(args.goodput)
    base = args.base_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    target = G.Target(base_url=base, model=args.model or G.first_model(base, args.api_key),
                      endpoint=args.endpoint, api_key=args.api_key, ignore_eos=not args.no_ignore_eos)
    prompts = prompts_for(args, args.num_prompts, args.seed)
    if args.num_warmup:
        warm = prompts_for(args, args.num_warmup, args.seed + 1)[: args.num_warmup]
        records, _ = asyncio.run(G.run(target, warm))
        if not any(r.ok for r in records):
            raise ValueError(f"every warm-up request failed: {records[0].error}")
    points = []
    for concurrency in args.sweep or [args.max_concurrency]:
        records, duration = _run_with_progress(target, prompts, args, concurrency)
        summary = summarize(records, duration, slos)
        summary["max_concurrency"] = concurrency
        points.append((summary, records))
    from rich.console import Console

    console = Console()
    print_summary(console, target, args, [s for s, _ in points])
    if args.result_dir:
        write_results(Path(args.result_dir), target, args, points)
        console.print(f"wrote {args.result_dir}/results.json, requests.csv"
                      + (", sweep.png" if args.sweep else ""))
    return 0 if any(s["completed"] for s, _ in points) else 1


def _run_with_progress(target: G.Target, prompts: list[G.Prompt], args: argparse.Namespace,
                       concurrency: int | None) -> tuple[list[RequestRecord], float]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from phasewise.lab import load_gen as G

    label = f"concurrency {concurrency}" if concurrency else "requests"
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=len(prompts))
        return asyncio.run(G.run(target, prompts, args.request_rate, args.burstiness, concurrency, args.seed,
                                 lambda r: bar.advance(task)))


def print_summary(console: Console, target: G.Target, args: argparse.Namespace,
                  summaries: list[LoadSummary]) -> None:
    from rich.table import Table

    table = Table(title=f"{target.model} at {target.base_url} ({args.dataset}, {args.num_prompts} requests)")
    table.add_column("")
    for s in summaries:
        table.add_column(f"c={s['max_concurrency'] or 'all'}", justify="right")
    rows: list[tuple[str, Callable[[LoadSummary], str]]] = [
        ("completed / failed", lambda s: f"{s['completed']} / {s['failed']}"),
        ("duration s", lambda s: f"{s['duration_s']:.1f}"),
        ("requests/s", lambda s: f"{s['request_throughput']:.2f}"),
        ("output tok/s", lambda s: f"{s['output_token_throughput']:.1f}"),
        ("total tok/s", lambda s: f"{s['total_token_throughput']:.1f}")]
    for metric in LATENCIES:
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{metric[:-3].upper()} {stat} ms", _latency_cell(metric, stat)))
    if "goodput" in summaries[0]:
        rows.append(("goodput req/s", lambda s: f"{s['goodput']['requests_per_s']:.2f}"))
    for name, fmt in rows:
        table.add_row(name, *(fmt(s) for s in summaries))
    console.print(table)
    for s in summaries:
        if not s["usage_reported"]:
            console.print("[yellow]the server sent no usage: output tokens counted as content chunks[/]")
        for e in s["errors"][:3]:
            console.print(f"[red]error:[/] {e}")


def _latency_cell(metric: Latency, stat: str) -> Callable[[LoadSummary], str]:
    return lambda s: f"{s[metric][stat]:.1f}"


def write_results(out: Path, target: G.Target, args: argparse.Namespace,
                  points: list[tuple[LoadSummary, list[RequestRecord]]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"}
    settings["request_rate"] = str(settings["request_rate"])
    doc = {"target": {"base_url": target.base_url, "model": target.model, "endpoint": target.endpoint},
           "settings": settings, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": [s for s, _ in points]}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["max_concurrency", "ok", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_ms",
                    "tpot_ms", "e2e_ms", "error"])
        for s, records in points:
            for r in records:
                w.writerow([s["max_concurrency"], r.ok, r.prompt_tokens, r.cached_tokens, r.output_tokens,
                            "" if r.ttft is None else f"{r.ttft * 1e3:.2f}",
                            "" if r.tpot is None else f"{r.tpot * 1e3:.2f}", f"{r.e2e * 1e3:.2f}", r.error])
    if args.sweep:
        plot_sweep([s for s, _ in points], out / "sweep.png", target.model)


def plot_sweep(summaries: list[LoadSummary], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    panels: tuple[tuple[Latency, str], ...] = (("tpot_ms", "median time per output token, ms"),
                                               ("ttft_ms", "median time to first token, ms"))
    for ax, (metric, label) in zip((left, right), panels):
        x = [s[metric]["median"] for s in summaries]
        y = [s["output_token_throughput"] for s in summaries]
        ax.plot(x, y, "o-")
        for s, xi, yi in zip(summaries, x, y):
            ax.annotate(f"c={s['max_concurrency']}", (xi, yi), textcoords="offset points", xytext=(5, -10),
                        fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("output tokens / s (all requests)")
    fig.suptitle(f"Throughput against latency as concurrency grows ({model})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
