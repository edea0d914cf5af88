"""The `phasewise` command: generate, serve, memory, cost."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from phasewise.deploy.options import RAY_EXTRA, add_ray_args, deploy_options, start_direct_ingress
from phasewise.engine.args import (add_chat_args, add_engine_args, engine_config_from_args, resolve_weights,
                                   speculative_config_from_args)

if TYPE_CHECKING:
    from phasewise.core.sampling_params import SamplingParams, StructuredOutputs
    from phasewise.engine.llm_engine import LLMEngine
    from phasewise.server.dashboard_feed import Roofline

EXIT_USAGE = 2


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=256)
    g.add_argument("--temperature", "-t", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument("--logprobs", type=int, default=None, help="return the top-N logprobs of each token")
    c = p.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", default=None,
                   help="output JSON that matches this JSON schema")
    c.add_argument("--json-object", action="store_true", help="output one JSON object")
    c.add_argument("--regex", default=None, help="output text that matches this regular expression")
    c.add_argument("--choice", action="append", default=None, help="output one of these strings (repeatable)")
    c.add_argument("--grammar", metavar="FILE", default=None,
                   help="output text of this grammar (Lark, or llama.cpp's GBNF with a root rule)")


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


def structured_outputs_from_args(args: argparse.Namespace) -> StructuredOutputs | None:
    """The constraint the flags ask for, or None."""
    from phasewise.core.sampling_params import StructuredOutputs

    if args.json_schema is not None:
        return StructuredOutputs(json=_read(args.json_schema, "--json-schema"))
    if args.grammar is not None:
        return StructuredOutputs(grammar=_read(args.grammar, "--grammar"))
    if args.json_object or args.regex is not None or args.choice:
        return StructuredOutputs(json_object=args.json_object, regex=args.regex, choice=args.choice)
    return None


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line (the usage itself is -h's), exit 2; every
    subcommand's parser is one too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"phasewise: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="phasewise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, then print where the time went")
    gen.add_argument("prompt", help="the prompt (sent through the chat template unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--trace", metavar="FILE", default=None,
                     help="write a Chrome/Perfetto trace (engine steps, the request's phases) to FILE")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    _add_serve_parser(sub)
    from phasewise.lab.commands import add_parsers as add_lab_parsers, add_roofline_parser

    add_lab_parsers(sub)
    add_engine_args(add_roofline_parser(sub))
    from phasewise.lab.experiment_command import add_parsers as add_experiment_parsers

    for p in add_experiment_parsers(sub):
        add_engine_args(p)
    from phasewise.lab.bench_command import add_parser as add_bench_parser

    add_bench_parser(sub)
    from phasewise.lab.cache_command import add_parser as add_cache_parser

    add_cache_parser(sub)
    return parser


def _add_serve_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """`phasewise serve`'s options: the server's, disaggregation's, the engine's and Ray's."""
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics)")
    s = serve.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 and the tokenizer routes; several keys: "
                        "tenants sharing no prompt-cache block")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's name in the API (default: the file's stem); more names are aliases a "
                        "request may use (e.g. a claude-... name for Claude Code)")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="queued requests past which new ones get 503 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="larger request bodies get 413")
    s.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one engine step")
    s.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    add_chat_args(s)
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C: stop accepting, let running requests finish for up to this "
                        "many seconds (then cut them), exit 0")
    s.add_argument("--trace", metavar="FILE", default=None,
                   help="on shutdown, write a Chrome/Perfetto trace of the engine steps and finished "
                        "requests")
    d = serve.add_argument_group("prefill/decode disaggregation")
    d.add_argument("--role", choices=["prefill", "decode", "proxy"], default=None,
                   help="one part of a disaggregated pair: prefill and decode instances joined by --kv-peer, "
                        "and a proxy (no model) in front of them")
    d.add_argument("--kv-peer", metavar="tcp://HOST:PORT", default=None,
                   help="prefill and decode: where the pair's KV link meets (the same address on both)")
    d.add_argument("--prefill", metavar="URL", default=None, help="proxy: the prefill instance")
    d.add_argument("--decode", metavar="URL", default=None, help="proxy: the decode instance")
    add_engine_args(serve)
    add_ray_args(serve)
    serve.set_defaults(func=cmd_serve)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    from phasewise.core.sampling_params import SamplingParams

    if args.max_tokens < 1:                    # the engine's 0 (a prompt only: a pre-warm) is the server's
        raise ValueError(f"max_tokens must be at least 1, got {args.max_tokens}")
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        structured_outputs=structured_outputs_from_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)   # validate before torch's import and the model load
    spec = speculative_config_from_args(args)
    from phasewise.llm import LLM
    from phasewise.report import perf_lines, timings_json

    llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, kv_dtype=args.kv_dtype,
              speculative=spec, tensor_parallel_size=args.tensor_parallel_size,
              packed_cache=args.packed_cache, threads=args.threads, prompt_cache_dir=args.prompt_cache_dir,
              prompt_cache_size=args.prompt_cache_size,
              prompt_cache_ttl=args.prompt_cache_ttl)
    print(f"phasewise: {llm.engine.precision.describe()}", file=sys.stderr)
    if args.raw:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                 [{"role": "user", "content": args.prompt}]
    final = None
    for delta in llm.stream(prompt, params):
        if not args.json:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        final = delta.output
    assert final is not None                   # the stream ends with its request's finished delta
    if args.trace:
        from phasewise.lab.trace import write_trace

        steps = [s for s in llm.engine.steps if s.record.start >= final.metrics.arrival]
        write_trace(args.trace, steps, [(final.request_id, final.metrics)])
    if args.json:
        print(json.dumps(timings_json(final, llm.load_ms), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print("\n" + "\n".join(perf_lines(final, llm.load_ms)), file=sys.stderr)
    llm.close()                                # the prompt cache's disk writes finish
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """Bind before the (slow) model load, so a busy port fails at once with one line."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _dashboard_roofline(engine: LLMEngine) -> Roofline | None:
    """The dashboard's roofs from the figures `phasewise roofline` kept for this machine, or None."""
    from phasewise.lab.roofline import load_machine, serving_roofline
    from phasewise.loading.loader import parse_dtype
    from phasewise.server.dashboard_feed import Roofline

    dtype = parse_dtype(engine.precision.weights)
    machine = load_machine(dtype)
    if not machine:
        return None
    return Roofline(**serving_roofline(machine, engine.model, engine.model_config, dtype))


def _check_serve_args(args: argparse.Namespace) -> None:
    """The serve options' own limits, and options that belong to another way of serving."""
    for name in ("max_waiting", "max_body_bytes", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    if args.trace and not Path(args.trace).resolve().parent.is_dir():
        raise ValueError(f"--trace: the folder of {args.trace} does not exist")
    if not args.ray and (args.ray_address or args.num_replicas or args.min_replicas or args.max_replicas):
        raise ValueError("--ray-address and the replica counts are --ray's")
    if not args.ray and args.role != "proxy" and (args.prefill or args.decode):
        raise ValueError("--prefill and --decode are the proxy's (--role proxy)")


def cmd_serve(args: argparse.Namespace) -> int:
    _check_serve_args(args)
    if args.ray:
        return _serve_ray(args)
    if args.role == "proxy":
        return _serve_proxy(args)
    config = engine_config_from_args(args, kv_role=args.role, kv_peer=args.kv_peer, threads=args.threads)
    sock = _listen(args.host, args.port)
    import uvicorn

    from phasewise.server.builder import build_server
    from phasewise.server.config import ServeOptions

    parts = build_server(config, ServeOptions.from_args(args), _dashboard_roofline)
    async_engine, engine, app = parts.async_engine, parts.engine, parts.app
    recorder = None
    if args.trace:
        from phasewise.lab.trace import RequestRecorder
        from phasewise.server.observer import Observers

        recorder = RequestRecorder()
        async_engine.observer = Observers(async_engine.observer, recorder)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"phasewise: {engine.precision.describe()}", file=sys.stderr)
    base = f"http://{host}:{sock.getsockname()[1]}"
    hint = "" if parts.roofline else \
        " (to see which resource binds, measure this machine once: phasewise roofline --model ...)"
    print(f"phasewise: dashboard at {base}/dashboard{hint}", file=sys.stderr)
    print(f"phasewise: serving {parts.config.served_model_name} on {base}/v1 "
          f"(loaded in {engine.load_ms:.0f} ms)", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=not args.no_access_log,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    app.state.stopping = lambda: server.should_exit          # ends the dashboard's event streams
    # uvicorn drains (no new connections; running requests finish within the timeout), then re-raises
    # SIGTERM: a shutdown asked for is a clean exit, through `finally` rather than dying mid-way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.run(sockets=[sock])
    finally:
        async_engine.shutdown()
        engine.close_prompt_cache()            # its queued disk writes finish
        sock.close()
        if recorder is not None:
            from phasewise.lab.trace import write_trace

            write_trace(args.trace, engine.steps, list(recorder.requests))
            print(f"phasewise: wrote the trace of {len(recorder.requests)} requests to {args.trace}",
                  file=sys.stderr)
    return 0


def _serve_ray(args: argparse.Namespace) -> int:
    """Ray Serve replicas (deploy/ray.py); without Ray installed, how to install it (exit 2)."""
    options = deploy_options(args)          # checked before anything starts
    start_direct_ingress(options.ray)       # before Ray Serve is imported: it reads its switches then
    try:
        from phasewise.deploy import ray as ray_deploy
    except ImportError as e:
        if not (e.name or "").startswith("ray"):
            raise
        raise ValueError(f"--ray needs Ray Serve: {RAY_EXTRA}") from None
    return ray_deploy.run(options)


def _serve_proxy(args: argparse.Namespace) -> int:
    """The disaggregated pair's entry: no model, every request to the prefill then the decode instance."""
    if not (args.prefill and args.decode):
        raise ValueError("--role proxy needs --prefill URL and --decode URL")
    sock = _listen(args.host, args.port)
    import uvicorn

    from phasewise.server.proxy import create_proxy

    print(f"phasewise: proxy on http://{args.host}:{sock.getsockname()[1]} -> prefill {args.prefill}, "
          f"decode {args.decode}", file=sys.stderr)
    uvicorn.Server(uvicorn.Config(create_proxy(args.prefill, args.decode), log_level="info",
                                  access_log=not args.no_access_log)).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)

    try:
        if hasattr(args, "quantization"):
            resolve_weights(args)
        if getattr(args, "tensor_parallel_size", 1) > 1 and int(os.environ.get("RANK", "0")) > 0:
            from phasewise.runner.tp_worker import serve_launched_rank

            # torchrun's other ranks: steps until rank 0 stops
            serve_launched_rank(args.tensor_parallel_size, args.device)
            return 0
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input (ModelLoadError is one): one line, no traceback
        print(f"phasewise: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nphasewise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
