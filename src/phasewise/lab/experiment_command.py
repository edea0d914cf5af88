"""`phasewise experiment prompt-sweep | output-sweep | repeat | batch-sweep`.

Each run writes a folder with results.json (settings, machine, every measurement,
the summary), results.csv (every measurement) and one PNG per plot, and prints
the summary as a table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from phasewise.lab.experiments import Experiment

if TYPE_CHECKING:
    from rich.console import Console

    from phasewise.json_types import JsonValue
    from phasewise.lab.experiments import Progress
    from phasewise.llm import LLM

ParserT = TypeVar("ParserT", bound=argparse.ArgumentParser)   # the parser class of the CLI's subcommands


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parsers(sub: argparse._SubParsersAction[ParserT]) -> list[ParserT]:
    """The `experiment` command and its four experiments; returns the parsers that need model args."""
    exp = sub.add_parser("experiment", help="the classic experiments: prompt/output-length sweeps, repeated "
                                            "runs, batch sweep (results.json/csv and plots)")
    kinds = exp.add_subparsers(dest="experiment", required=True)
    ps = kinds.add_parser("prompt-sweep", help="prefill cost per token and decode speed as the prompt grows")
    ps.add_argument("--lengths", type=int_list, default=None,
                    help="prompt lengths, e.g. 50,100,500 (default: 10 steps, log-spaced, "
                         "--min-len..--max-len)")
    ps.add_argument("--min-len", type=int, default=50)
    ps.add_argument("--max-len", type=int, default=3500)
    ps.add_argument("--steps", type=int, default=10)
    ps.add_argument("--output-len", type=int, default=199)
    ps.add_argument("--runs", type=int, default=1, help="requests per length (the table shows medians)")
    os_ = kinds.add_parser("output-sweep", help="decode time against output length; prefill stays flat")
    os_.add_argument("--lengths", type=int_list, default=[50, 100, 200, 400, 700, 1000, 1500])
    os_.add_argument("--input-len", type=int, default=32)
    os_.add_argument("--runs", type=int, default=1, help="requests per length (the table shows medians)")
    rp = kinds.add_parser("repeat", help="the same request N times: median, p5, p95, CV, outliers")
    rp.add_argument("--runs", type=int, default=20)
    rp.add_argument("--input-len", type=int, default=128)
    rp.add_argument("--output-len", type=int, default=64)
    bs = kinds.add_parser("batch-sweep",
                          help="concurrency 1..64: aggregate tokens/s against inter-token latency")
    bs.add_argument("--max-concurrency", type=int_list, default=[1, 2, 4, 8, 16, 32, 64])
    bs.add_argument("--input-len", type=int, default=128)
    bs.add_argument("--output-len", type=int, default=64)
    parsers = [ps, os_, rp, bs]
    for p in parsers:
        g = p.add_argument_group("experiment")
        g.add_argument("--result-dir", default=None,
                       help="results folder (default: results/<experiment>-<time>)")
        g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
        g.add_argument("--trace", metavar="FILE", default=None, help="also write a Chrome/Perfetto trace")
        g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
        g.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
        g.add_argument("--prefix-caching", action="store_true",
                       help="keep prefix caching on (off by default so that repeats are not cache hits)")
        g.add_argument("--num-warmup", type=int, default=None,
                       help="tiny requests run through the engine before measuring (default: 1; 0 for "
                            "repeat, whose first run shows the cold start)")
        p.set_defaults(func=cmd_experiment)
    return parsers


def _check(args: argparse.Namespace) -> None:
    for name in ("output_len", "input_len", "runs", "min_len", "max_len", "steps",
                 "max_num_batched_tokens", "max_num_seqs"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.num_warmup is not None and args.num_warmup < 0:
        raise ValueError(f"--num-warmup must be >= 0, got {args.num_warmup}")
    if args.experiment == "prompt-sweep" and args.lengths is None:
        if args.min_len > args.max_len:
            raise ValueError(f"--min-len {args.min_len} is above --max-len {args.max_len}")
        from phasewise.lab.experiments import default_prompt_lengths

        args.lengths = default_prompt_lengths(args.min_len, args.max_len, args.steps)
    if args.experiment == "batch-sweep" and max(args.max_concurrency) > args.max_num_seqs:
        raise ValueError(f"concurrency {max(args.max_concurrency)} is above "
                         f"--max-num-seqs {args.max_num_seqs}")


def _longest(args: argparse.Namespace) -> int:
    if args.experiment == "prompt-sweep":
        return max(args.lengths) + args.output_len
    if args.experiment == "output-sweep":
        return args.input_len + max(args.lengths)
    return args.input_len + args.output_len


def _run(llm: LLM, args: argparse.Namespace, advance: Progress) -> Experiment:
    from phasewise.lab import experiments as E

    if args.experiment == "prompt-sweep":
        return E.prompt_sweep(llm, args.lengths, args.output_len, args.runs, args.seed, advance)
    if args.experiment == "output-sweep":
        return E.output_sweep(llm, args.lengths, args.input_len, args.runs, args.seed, advance)
    if args.experiment == "repeat":
        return E.repeat(llm, args.runs, args.input_len, args.output_len, args.seed, advance)
    return E.batch_sweep(llm, args.max_concurrency, args.input_len, args.output_len, args.seed, advance)


def _total(args: argparse.Namespace) -> int:
    if args.experiment in ("prompt-sweep", "output-sweep"):
        return len(args.lengths) * args.runs
    if args.experiment == "repeat":
        return args.runs
    return sum(args.max_concurrency)


def cmd_experiment(args: argparse.Namespace) -> int:
    _check(args)
    from rich.console import Console

    console = Console(stderr=True)
    out = Path(args.result_dir or f"results/{args.experiment}-{time.strftime('%Y%m%d-%H%M%S')}")
    fresh = not out.exists()
    out.mkdir(parents=True, exist_ok=True)          # early: an unwritable place fails before the run
    try:
        return _experiment(args, out, console)
    except BaseException:
        if fresh and not any(out.iterdir()):        # a failed run leaves no empty folder behind
            out.rmdir()
        raise


def _experiment(args: argparse.Namespace, out: Path, console: Console) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from phasewise import LLM
    from phasewise.engine.args import speculative_config_from_args

    warmup = args.num_warmup if args.num_warmup is not None else int(args.experiment != "repeat")
    # The pool holds the longest request (one at a time) or every request of the largest batch.
    per_request = _longest(args)
    many = max(args.max_concurrency) if args.experiment == "batch-sweep" else 1
    with console.status("loading the model"):
        llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                  kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                  enable_prefix_caching=args.prefix_caching,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, kv_dtype=args.kv_dtype, warmup=False,
                  speculative=speculative_config_from_args(args),
                  tensor_parallel_size=args.tensor_parallel_size,
                  packed_cache=args.packed_cache, threads=args.threads)
    for _ in range(warmup):
        llm.engine.warmup()
    limit = llm.engine.max_model_len
    if per_request > limit:
        raise ValueError(f"the longest request has {per_request} tokens, above the context length {limit}")
    need = many * -(-per_request // args.block_size)
    pool = llm.engine.stats().num_blocks
    if need > pool:
        console.print(f"[yellow]note: {need} KV blocks would hold every request at once, the pool has "
                      f"{pool}; expect preemptions[/]")
    started = time.perf_counter()
    with Progress(TextColumn(f"{args.experiment}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task("", total=_total(args))
        exp = _run(llm, args, lambda n: bar.advance(task, n))
    exp.settings |= {"model": str(llm.engine.model_path), "dtype": llm.engine.precision.weights,
                     "kv_dtype": llm.engine.precision.kv,
                     "isa": llm.engine.kernels.isa if llm.engine.kernels else None,
                     "device": args.device,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
                     "prefix_caching": args.prefix_caching, "num_warmup": warmup,
                     "speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}
    from phasewise.lab.plots import draw

    plots = draw(exp, out)
    write_results(exp, out, load_ms=llm.load_ms)
    if args.trace:
        from phasewise.lab.trace import write_trace

        write_trace(args.trace, [s for s in llm.engine.steps if s.record.start >= started], exp.requests)
    print_table(exp, Console())
    console.print(f"wrote {out / 'results.json'}, {out / 'results.csv'}, "
                  + ", ".join(p.name for p in plots) + (f"; trace {args.trace}" if args.trace else ""))
    return 0


def machine() -> dict[str, str | int | None]:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def write_results(exp: Experiment, out: Path, **extra: JsonValue) -> None:
    doc = {"experiment": exp.name, "settings": exp.settings, "machine": machine(), **extra,
           "summary": exp.table, "notes": exp.notes, "rows": exp.rows}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(exp.rows[0]))
        writer.writeheader()
        writer.writerows(exp.rows)


def print_table(exp: Experiment, console: Console) -> None:
    from rich.table import Table

    table = Table(title=exp.name)
    for c in exp.columns:
        table.add_column(c.header, justify="left" if c.fmt == "s" else "right")
    for row in exp.table:
        table.add_row(*(format(row[c.key], c.fmt) for c in exp.columns))
    console.print(table)
    for note in exp.notes:
        console.print(f"• {note}")
