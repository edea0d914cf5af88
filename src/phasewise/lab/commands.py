"""`phasewise memory` and `phasewise cost`: the lab's calculators on the command line."""

from __future__ import annotations

import argparse
from typing import TypeVar

from phasewise.config import PROCESS_OVERHEAD
from phasewise.lab.cost import Prices, Workload, cost_with_caching, cost_without_caching
from phasewise.lab.memory import KV_DTYPES, MIB, ModelShape, hybrid_comparison, report

ParserT = TypeVar("ParserT", bound=argparse.ArgumentParser)   # the parser class of the CLI's subcommands


def add_parsers(sub: argparse._SubParsersAction[ParserT]) -> None:
    mem = sub.add_parser("memory",
                         help="KV-cache and weight memory of a model, from its file or from numbers")
    mem.add_argument("--model", "-m", default=None,
                     help="a .gguf file or HF folder (default: the default model unless --layers is given)")
    mem.add_argument("--layers", type=int, help="number of layers (instead of a model)")
    mem.add_argument("--kv-heads", type=int, help="number of KV heads (instead of a model)")
    mem.add_argument("--head-dim", type=int, help="head size (instead of a model)")
    mem.add_argument("--params", type=float, default=None,
                     help="parameter count, e.g. 7e9 (instead of a model)")
    mem.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    mem.add_argument("--memory", type=float, default=24.0, help="memory for the KV cache, GiB")
    mem.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPES),
                     help="the engine's KV cache (auto: int8 where its kernels run, model: fp32) or a float "
                          "width for comparison (bf16, fp16)")
    mem.set_defaults(func=cmd_memory)

    cost = sub.add_parser("cost",
                          help="cost of a workload (or of a recorded run: --from-run) from per-million-token "
                               "prices, with and without prompt caching")
    cost.add_argument("--requests", type=int, help="requests of the workload (not with --from-run)")
    cost.add_argument("--input-len", type=int, help="per request, shared prefix included")
    cost.add_argument("--output-len", type=int, help="per request")
    cost.add_argument("--prefix-len", type=int, default=0, help="input tokens every request shares")
    cost.add_argument("--input-price", type=float, required=True, help="per million input tokens")
    cost.add_argument("--output-price", type=float, required=True, help="per million output tokens")
    cost.add_argument("--cache-write-price", type=float, default=None, help="default: the input price")
    cost.add_argument("--cache-read-price", type=float, default=None,
                      help="default: a tenth of the input price")
    cost.add_argument("--from-run", metavar="FILE", default=None,
                      help="price a recorded run instead: bench serve's requests.csv (or its folder), or a "
                           "JSON Lines file of API usage objects; writes 1.25x the input price at 5m, "
                           "2x at 1h, reads 0.1x")
    cost.add_argument("--unmarked-writes", default="none", choices=("none", "5m", "1h"),
                      help="--from-run: how a request whose usage reports no cache writes (OpenAI's shapes) "
                           "pays for its prompt tokens not read from the cache: as input, or "
                           "as writes at this ttl")
    cost.add_argument("--json-out", metavar="FILE", default=None,
                      help="--from-run: where the JSON goes (default: cost.json beside the run)")
    cost.set_defaults(func=cmd_cost)


def add_roofline_parser(sub: argparse._SubParsersAction[ParserT]) -> ParserT:
    roof = sub.add_parser("roofline", help="measure this machine, run the model, and say which resource "
                                           "binds prefill and decode")
    roof.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    roof.add_argument("--output-len", type=int, default=32, help="generated tokens")
    roof.set_defaults(func=cmd_roofline)
    return roof


def cmd_roofline(args: argparse.Namespace) -> int:
    import random

    from phasewise import LLM, SamplingParams
    from phasewise.lab.roofline import analyse, measure_machine, model_weights, report, save_machine
    from phasewise.loading.loader import parse_dtype

    if args.input_len < 2 or args.output_len < 2:
        raise ValueError("--input-len and --output-len must be at least 2")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              kv_dtype=args.kv_dtype, packed_cache=args.packed_cache, threads=args.threads)
    weights = llm.engine.precision.weights
    dtype = parse_dtype(weights)
    cfg = llm.model_config
    rng = random.Random(0)
    prompt = [rng.randrange(100, cfg.vocab_size) for _ in range(args.input_len)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt[: min(32, len(prompt))]], params)          # warm-up
    out = llm.generate([prompt], params)[0]
    machine = measure_machine(dtype)
    saved = save_machine(machine, dtype)
    per_weight, quantized = model_weights(llm.engine.model, cfg, dtype)
    kv = llm.engine.kv_cache.bytes_per_token
    phases = analyse(cfg, machine, per_weight, kv, len(prompt), out.metrics.prompt_ms / 1e3,
                     len(out.token_ids) - 1, out.metrics.decode_ms / 1e3, quantized)
    print("\n".join(report(machine, phases)))
    print(f"weights: {per_weight:.3f} bytes per parameter ({weights}); KV: {kv} bytes per token")
    print(f"machine figures kept in {saved} (the server's dashboard uses them)")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    numbers = (args.layers, args.kv_heads, args.head_dim)
    q4, all_layers = None, 0
    if any(n is not None for n in numbers):
        if any(n is None or n < 1 for n in numbers):
            raise ValueError("give --layers, --kv-heads and --head-dim together, each at least 1")
        shape = ModelShape(*numbers, params=int(args.params) if args.params else None)
    else:
        from phasewise.loading.loader import load_config, q4_weight_bytes, resolve_model_path

        path = resolve_model_path(args.model)
        cfg = load_config(path)
        shape, all_layers = ModelShape.from_config(cfg), cfg.num_layers
        q4 = q4_weight_bytes(path)
    if args.context < 1 or args.memory <= 0:
        raise ValueError("--context must be at least 1 and --memory positive")
    print("\n".join(report(shape, args.context, args.memory, KV_DTYPES[args.kv_dtype])))
    if shape.state_bytes:
        print("\n".join(hybrid_comparison(shape, all_layers, KV_DTYPES[args.kv_dtype])))
    if q4 is not None and q4[1]:
        packed, stored = q4
        params = shape.params or 1
        print(f"q4 weights (the file's own blocks, what phasewise holds): {packed / MIB:,.0f} MiB, "
              f"{packed * 8 / params:.3f} bits a parameter ({packed / stored - 1:+.1%} against the file's "
              f"{stored / MIB:,.0f} MiB)")
        print(f"peak memory serving it: {packed / MIB:,.0f} MiB of weights + the KV pool (--kv-cache-memory, "
              f"default 2 GiB) + about {PROCESS_OVERHEAD / MIB:,.0f} MiB")
    return 0


def cmd_cost(args: argparse.Namespace) -> int:
    if args.from_run is not None:
        return cmd_cost_run(args)
    if args.requests is None or args.input_len is None or args.output_len is None:
        raise ValueError("give --requests, --input-len and --output-len (or --from-run FILE)")
    prices = Prices(args.input_price, args.output_price, args.cache_write_price, args.cache_read_price)
    if min(prices.input, prices.output, prices.write, prices.read) < 0:
        raise ValueError("prices must be >= 0")
    w = Workload(args.requests, args.input_len, args.output_len, args.prefix_len)
    plain, cached = cost_without_caching(w, prices), cost_with_caching(w, prices)
    print(f"{'':22}{'input':>10}{'cache write':>13}{'cache read':>12}{'output':>10}{'total':>11}")
    for name, c in (("without prompt caching", plain), ("with prompt caching", cached)):
        print(f"{name:22}{c.input:>10.4f}{c.cache_write:>13.4f}{c.cache_read:>12.4f}{c.output:>10.4f}"
              f"{c.total:>11.4f}")
    if plain.total > 0:
        print(f"prompt caching saves {plain.total - cached.total:.4f} ({1 - cached.total / plain.total:.1%})")
    return 0


def cmd_cost_run(args: argparse.Namespace) -> int:
    """`phasewise cost --from-run FILE`: a recorded run priced as the seeds price caching (lab/run_cost.py):
    a table of what it cost with and without the prompt cache, the caching ROI, and the same as JSON."""
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from phasewise.lab.run_cost import READ, WRITE_1H, WRITE_5M, RunPricing, read_run

    if args.cache_write_price is not None or args.cache_read_price is not None or args.requests is not None:
        raise ValueError("--from-run prices writes and reads as the seeds do (1.25x or 2x the input price, "
                         "0.1x), and takes its requests from the run")
    if min(args.input_price, args.output_price) < 0:
        raise ValueError("prices must be >= 0")
    run = Path(args.from_run)
    if not run.exists():
        raise ValueError(f"--from-run: no such file or folder: {run}")
    pricing = RunPricing(read_run(run, args.unmarked_writes), args.input_price, args.output_price)
    t = pricing.tokens
    table = Table(title=f"{run}: {t.requests} requests ({t.unreported} with no cache writes reported: "
                        f"--unmarked-writes {args.unmarked_writes})")
    for name in ("", "input", f"write 5m ({WRITE_5M:g}x)", f"write 1h ({WRITE_1H:g}x)", f"read ({READ:g}x)",
                 "output", "total"):
        table.add_column(name, justify="left" if not name else "right")
    table.add_row("tokens as served",
                  *(f"{n:,}" for n in (t.input, t.write_5m, t.write_1h, t.read, t.output)), "")
    for label, c in (("without caching", pricing.without_cache), ("with caching", pricing.with_cache)):
        table.add_row(label,
                      *(f"{v:.4f}" for v in (c.input, c.write_5m, c.write_1h, c.read, c.output, c.total)))
    console = Console()
    console.print(table)
    plain = pricing.without_cache.total
    roi = "no write premium paid" if pricing.roi is None else f"caching ROI {pricing.roi:.0%}"
    console.print(f"read from the cache: {t.read / t.prompt if t.prompt else 0:.1%} of prompt tokens; the "
                  f"reads saved {pricing.read_savings:.4f}, the writes cost {pricing.premium:.4f} beyond "
                  f"input: saved {pricing.saved:.4f} ({pricing.saved / plain if plain else 0:.1%}), {roi}")
    out = Path(args.json_out) if args.json_out else (run if run.is_dir() else run.parent) / "cost.json"
    out.write_text(json.dumps({"run": str(run), "unmarked_writes": args.unmarked_writes, **pricing.as_json()},
                              indent=2))
    console.print(f"wrote {out}")
    return 0
