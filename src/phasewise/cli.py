"""The `phasewise` command: generate, memory, cost."""

from __future__ import annotations

import argparse
import json
import sys

EXIT_USAGE = 2


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", default=None,
                   help="a .gguf file or a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weight precision")
    g.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV-cache pool size in GiB")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasewise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt, then print where the time went")
    gen.add_argument("prompt", help="the prompt (sent through the chat template unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    from phasewise.lab.commands import add_parsers as add_lab_parsers

    add_lab_parsers(sub)
    return parser


def sampling_params_from_args(args: argparse.Namespace):
    from phasewise.sampling.params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def cmd_generate(args: argparse.Namespace) -> int:
    from phasewise.llm import LLM
    from phasewise.report import perf_lines, timings_json

    params = sampling_params_from_args(args)   # validate before the (slow) model load
    llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
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
    if args.json:
        print(json.dumps(timings_json(final, llm.load_ms), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print("\n" + "\n".join(perf_lines(final, llm.load_ms)), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from phasewise.loading.gguf import ModelLoadError

    try:
        return args.func(args)
    except (ValueError, ModelLoadError, FileNotFoundError) as e:  # bad input: one line, no traceback
        print(f"phasewise: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nphasewise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
