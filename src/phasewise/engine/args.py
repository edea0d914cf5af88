"""The engine options the commands share (generate, serve, roofline, the experiments): one
argparse group, and the conversion of what it parsed. The CLI and the lab both build on it, so
neither imports the other."""

from __future__ import annotations

import argparse
from pathlib import Path

from phasewise.config import CacheConfig, EngineConfig, KVRole, SchedulerConfig, SpeculativeConfig
from phasewise.reasoning import PARSERS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and engine options (their group): generate, serve, roofline and the experiments."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", default=None,
                   help="a .gguf file or a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="the float type of the weights and activations")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "q4"],
                   help="the weight format: int8 per channel, or q4 (the GGUF file's own 4-bit blocks), or "
                        "none; auto: the fastest within 0.5%% perplexity of fp32 on this machine (q4 for "
                        "GGUF files with kernels) when --dtype is auto too, else none")
    g.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV-cache block (an int4 cache takes 64 for 16 or 32: its key groups' "
                        "size)")
    g.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV-cache pool size in GiB")
    g.add_argument("--kv-dtype", default="auto", choices=["auto", "model", "int8", "int4"],
                   help="KV-cache precision: int8 (keys per channel over 16 tokens, values per token), "
                        "int4 (4.5 bits a value: keys per channel over 64 tokens, values per 32), or the "
                        "weights' float type (model); auto: int8 where the compiled kernels run, --dtype is "
                        "auto and the model's family was measured to hold it (int4 only where measured to "
                        "hold)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    g.add_argument("--prompt-cache-dir", metavar="DIR", default=None,
                   help="keep the prefix cache's full blocks on disk too, in DIR (they survive restarts; "
                        "several processes may share DIR); a prompt seen before then loads its KV "
                        "instead of computing it")
    g.add_argument("--prompt-cache-size", type=float, default=10.0, metavar="GiB",
                   help="the size limit of --prompt-cache-dir (expired blocks go first, then the "
                        "least recently used)")
    g.add_argument("--prompt-cache-ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="how long a block stays on disk after its last use, for requests that set no TTL")
    g.add_argument("--no-packed-cache", dest="packed_cache", action="store_false",
                   help="repack a GGUF's weights at every load instead of mapping them from the "
                        "packed-weight cache (<cache>/packed, written by the first load)")
    g.add_argument("--threads", type=threads_arg, default=None, metavar="auto|N",
                   help="CPU threads for the model's kernels. auto (default): one per core while the machine "
                        "is free, fewer while other programs keep cores busy; N pins the count (on a small "
                        "machine, `serve --threads <cores - 1>` leaves a core to the HTTP "
                        "side and its clients)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="split the model over this many processes on this machine (torch.distributed, gloo "
                        "on CPUs); each gets an equal share of the threads")
    _add_speculative_args(g)


def _add_speculative_args(g: argparse._ArgumentGroup) -> None:
    """Speculative decoding's options, in the engine's group."""
    g.add_argument("--speculative", default=None, metavar="ngram|draft[:MODEL]|mtp",
                   help="speculative decoding: 'ngram' (prompt lookup), 'draft:MODEL' (a draft model with "
                        "the same tokenizer; plain 'draft' = this model at --draft-quantization) or 'mtp' "
                        "(the model's own multi-token-prediction layer: Qwen3.5, Qwen3-Next folders); "
                        "outputs are unchanged")
    g.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="the most draft tokens verified per step: each request's count adapts to its "
                        "measured acceptance and this machine's measured draft and verify costs")
    g.add_argument("--fixed-speculative-tokens", dest="adaptive_speculation", action="store_false",
                   help="always draft --num-speculative-tokens (no adaptation)")
    g.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram matched by --speculative ngram")
    g.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched by --speculative ngram")
    g.add_argument("--draft-quantization", default="q4", choices=["none", "int8", "q4"],
                   help="the draft model's weight format (none: fp32)")


def add_chat_args(g: argparse._ArgumentGroup) -> None:
    """serve's chat options (a server's, and each Ray replica's): the template and how thinking is read."""
    g.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template to use in place of the model's own")
    g.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *PARSERS],
                   help="how replies' thinking (<think>...</think>) is split from the answer: qwen3 (Qwen3, "
                        "Qwen3.5), deepseek_r1 (the R1 distills, whose prompt opens the block), none; auto "
                        "(default): the chat template's own, none when it writes no thinking")
    g.add_argument("--reasoning-budget", type=budget_arg, default=-1, metavar="N",
                   help="thinking tokens a reply may write when its request sets no budget (llama-server's "
                        "flag): -1 (default) unrestricted, 0 no thinking (the template's switch off, an "
                        "empty block), N then the block is closed and the answer follows")


def budget_arg(text: str) -> int:
    """--reasoning-budget: -1 or a count of tokens."""
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise argparse.ArgumentTypeError(f"-1 (unrestricted) or a count of tokens, got {text!r}")
    return value


def threads_arg(text: str) -> int | None:
    """--threads: "auto" (None) or a positive count."""
    if text == "auto":
        return None
    try:
        return positive_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"auto or a count of threads, got {text!r}") from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """The SpeculativeConfig the speculative options of add_engine_args ask for."""
    draft_dtype = "fp32" if args.draft_quantization == "none" else args.draft_quantization
    return SpeculativeConfig.parse(args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                                   ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                                   draft_dtype=draft_dtype, adaptive=args.adaptive_speculation)


def engine_config_from_args(args: argparse.Namespace, *, kv_role: KVRole | None, kv_peer: str | None,
                            threads: int | None) -> EngineConfig:
    """The EngineConfig a server's options ask for (add_engine_args' and add_chat_args' flags, weights
    resolved): `phasewise serve`'s and a Ray replica's, each giving its own role, KV peer and threads."""
    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).expanduser().read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {args.chat_template}: {e.strerror or e}") from None
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_memory,
                          kv_dtype=args.kv_dtype, prompt_cache_dir=args.prompt_cache_dir,
                          prompt_cache_size_gib=args.prompt_cache_size,
                          prompt_cache_ttl=args.prompt_cache_ttl),
        scheduler=SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len),
        speculative=speculative_config_from_args(args), tensor_parallel_size=args.tensor_parallel_size,
        kv_role=kv_role, kv_peer=kv_peer, packed_cache=args.packed_cache, threads=threads,
        chat_template=template)


def resolve_weights(args: argparse.Namespace) -> None:
    """Fold --dtype (the float type) and --quantization (the weight format) into args.dtype, the one
    weights setting the engine takes (precision.weights_setting). ValueError when the two disagree."""
    from phasewise.engine.precision import weights_setting

    args.dtype = weights_setting(args.dtype, args.quantization)
