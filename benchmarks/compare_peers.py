"""phasewise against the peers a user would pick instead, on the same prompts, in one run.

    .venv/bin/python benchmarks/compare_peers.py [--dtypes fp32,int8,q4,q4/int8] [--peers llama.cpp,transformers]
                                                 [--prompt-tokens 512] [--decode-tokens 128]
                                                 [--concurrent 32] [--concurrent-prompt 128]
                                                 [--concurrent-output 64] [--repeats 3]

Installs nothing: a peer that is not importable is skipped with a note (`make peers`
builds llama-cpp-python for this CPU). Every system runs the default model's GGUF:
phasewise at each --dtypes precision, llama.cpp on the file as it is (Q4_1, 2 threads),
transformers dequantized to fp32. A --dtypes entry "WEIGHTS/KV" also sets phasewise's KV-cache
dtype (q4/int8: 4-bit weights, int8 KV cache). Figures:

- prefill tokens/s: --prompt-tokens prompt tokens / time to the first token;
- decode tokens/s at batch 1: (--decode-tokens − 1) / time from the first to the last token;
- aggregate output tokens/s with --concurrent requests: phasewise takes them all at once
  (continuous batching), transformers as one padded batch through `generate`, llama.cpp
  one after another as a user of llama-cpp-python runs it;
- weight GB/s: the bytes of weights read per decode step × decode tokens/s, next to the
  machine's measured read bandwidth (the decode roofline; the model does not fit the L3);
- prefill and aggregate GOP/s: the model's arithmetic (`lab.roofline`: 2 per weight, logits only
  where a token is sampled, attention at the mean context) per second, and its share of the
  compute roof: the int8 dot-product peak for quantized weights (llama.cpp's included), torch's
  fp32 matmul otherwise;
- quality of each phasewise precision (unless --no-quality): perplexity of the repo's text
  (benchmarks/data/lighthouses.txt) and next-token top-1 agreement with fp32, teacher-forced,
  with the engine's own model and KV-cache dtype.

Each batch-1 figure is the median of --repeats runs after a warm-up run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_vs_hf import make_prompt  # noqa: E402


@dataclass
class Result:
    name: str
    prefill: float
    decode: float
    aggregate: float
    weight_bytes: int
    quantized: bool = True                 # its linear layers multiply int8 activations (the int8 roof)
    quality: tuple[float, torch.Tensor] | None = None   # perplexity, top-1 token per position

    @property
    def weight_gbs(self) -> float:
        return self.weight_bytes * self.decode / 1e9


def fresh(prompt: list[int], i: int) -> list[int]:
    """The prompt with its first token changed per repeat, so that no cache can serve it."""
    return [prompt[0] + 1 + i] + prompt[1:]


def prompts_for_batch(tokenizer, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of `length` tokens: windows into a repeated text, each from its own offset."""
    base = make_prompt(tokenizer, length + 7 * n)
    return [base[7 * i: 7 * i + length] for i in range(n)]


# ---- phasewise --------------------------------------------------------------------------------

def run_phasewise(spec: str, prompt, batch, args) -> Result:
    from phasewise import LLM, SamplingParams

    dtype, _, kv_dtype = spec.partition("/")
    llm = LLM(dtype=dtype, kv_dtype=kv_dtype or "auto", kv_cache_memory=1.0, enable_prefix_caching=False)
    one = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    prefill, decode = [], []
    for i in range(args.repeats + 1):
        out = llm.generate([fresh(prompt, i)], one)[0]
        if i:
            prefill.append(len(prompt) / (out.metrics.prompt_ms / 1e3))
            decode.append((len(out.token_ids) - 1) / (out.metrics.decode_ms / 1e3))
    many = SamplingParams(temperature=0, max_tokens=args.concurrent_output, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, many)
    aggregate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    from phasewise.lab.roofline import linear_params, weight_bytes_per_param

    cfg = llm.model_config
    nbytes = int(linear_params(cfg) * weight_bytes_per_param(llm.engine.model, cfg, 2 if "16" in dtype else 4))
    name = f"phasewise {dtype}" + (f" kv {kv_dtype}" if kv_dtype else "")
    quality = None if args.no_quality else teacher_forced(llm.engine.model, llm.engine.kv_cache.dtype, args.text_ids)
    return Result(name, statistics.median(prefill), statistics.median(decode), aggregate,
                  nbytes, dtype in ("int8", "q4"), quality)


def teacher_forced(model, kv_dtype: torch.dtype, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Perplexity of `ids` and the top-1 token at each position (quality.py's runner)."""
    import math

    from quality import Runner

    nll, top, _ = Runner(model, kv_dtype, len(ids)).teacher_forced(ids, 512)
    return math.exp(nll.mean().item()), top


def fp32_reference(path: Path, ids: list[int]) -> tuple[float, torch.Tensor]:
    """The fp32 model's perplexity and top-1 tokens, with the kernels the engine would use."""
    from phasewise.kernels import build
    from phasewise.llm_engine import load_prepared

    model, _ = load_prepared(path, "fp32", "cpu", build.load())
    return teacher_forced(model, torch.float32, ids)


# ---- llama.cpp --------------------------------------------------------------------------------

def run_llama_cpp(path: Path, prompt, batch, args) -> Result:
    from llama_cpp import Llama

    n_ctx = max(len(prompt) + args.decode_tokens, len(batch[0]) + args.concurrent_output) + 16
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=torch.get_num_threads(), n_batch=512,
                verbose=False)

    def generate(ids: list[int], n: int) -> tuple[float, float]:
        """Greedy, never stopping at eos: (seconds to the first token, seconds for the other n − 1).
        reset() first: llama-cpp-python would otherwise reuse the cached prefix of the last prompt."""
        llm.reset()
        t0 = time.perf_counter()
        t1 = None
        for i, _ in enumerate(llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True)):
            if i == 0:
                t1 = time.perf_counter()
            if i == n - 1:
                break
        return t1 - t0, time.perf_counter() - t1

    prefill, decode = [], []
    for i in range(args.repeats + 1):
        ttft, rest = generate(fresh(prompt, i), args.decode_tokens)
        if i:
            prefill.append(len(prompt) / ttft)
            decode.append((args.decode_tokens - 1) / rest)
    t0 = time.perf_counter()
    for ids in batch:
        generate(ids, args.concurrent_output)
    aggregate = len(batch) * args.concurrent_output / (time.perf_counter() - t0)
    return Result("llama.cpp (Q4_1)", statistics.median(prefill), statistics.median(decode), aggregate,
                  path.stat().st_size)             # Q4_1 x Q8_1 dot products: the int8 roof


# ---- transformers -------------------------------------------------------------------------------

@torch.inference_mode()
def run_transformers(path: Path, prompt, batch, args) -> Result:
    from transformers import AutoModelForCausalLM

    from decode_vs_hf import bench_hf

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prefill, decode = bench_hf(model, prompt, args.decode_tokens, args.repeats)
    ids = torch.tensor(batch)                   # equal lengths: no padding needed
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=args.concurrent_output, min_new_tokens=args.concurrent_output,
                         pad_token_id=0)
    aggregate = (out.shape[1] - ids.shape[1]) * len(batch) / (time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Result("transformers fp32", prefill, decode, aggregate, nbytes, quantized=False)


# ---- the tables -----------------------------------------------------------------------------------

def print_roofline_and_quality(results: list[Result], machine, path: Path, args) -> None:
    from phasewise.lab.roofline import request_flops
    from phasewise.loading.loader import load_config

    cfg = load_config(path)
    prefill_ops = request_flops(cfg, args.prompt_tokens, 1)          # the prompt and its first token
    agg_ops_per_token = request_flops(cfg, args.concurrent_prompt, args.concurrent_output) / args.concurrent_output
    base = None
    if not args.no_quality and any(r.quality for r in results):
        base = next((r.quality for r in results if r.name == "phasewise fp32"), None)
        base = base or fp32_reference(path, args.text_ids)
    print(f"\n{'':24}{'prefill GOP/s':>14}{'of roof':>8}{'agg GOP/s':>11}{'of roof':>8}"
          + (f"{'ppl':>9}{'Δppl':>8}{'top1=fp32':>10}" if base else ""))
    for r in results:
        roof = machine.compute_roof(r.quantized)
        pre, agg = r.prefill * prefill_ops / args.prompt_tokens / 1e9, r.aggregate * agg_ops_per_token / 1e9
        line = f"{r.name:24}{pre:14.1f}{pre / roof:8.0%}{agg:11.1f}{agg / roof:8.0%}"
        if base and r.quality:
            ppl, top = r.quality
            line += f"{ppl:9.4f}{ppl / base[0] - 1:+8.2%}{(top == base[1]).float().mean().item():10.2%}"
        print(line)
    print(f"roof: int8 dot products for quantized weights ({machine.int8_gops or 0:.0f} GOP/s), else the fp32 "
          f"matmul ({machine.matmul_gflops:.0f} GFLOP/s); quality on {len(args.text_ids)} tokens of "
          f"lighthouses.txt" + (f", fp32 perplexity {base[0]:.4f}" if base else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32", help="phasewise precisions, comma-separated")
    ap.add_argument("--peers", default="llama.cpp,transformers")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--concurrent-prompt", type=int, default=128)
    ap.add_argument("--concurrent-output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-quality", action="store_true", help="skip the perplexity and agreement pass")
    args = ap.parse_args()

    from phasewise.lab.roofline import measure_machine
    from phasewise.loading.loader import default_model_path
    from phasewise.tokenizer import Tokenizer

    path = default_model_path()
    tokenizer = Tokenizer.load(path)
    prompt = make_prompt(tokenizer, args.prompt_tokens)
    batch = prompts_for_batch(tokenizer, args.concurrent, args.concurrent_prompt)
    from quality import TEXT

    args.text_ids = tokenizer.encode(TEXT.read_text())
    print(f"model {path.name}, {torch.get_num_threads()} threads; prefill and decode: {len(prompt)} prompt "
          f"tokens, {args.decode_tokens} decoded, median of {args.repeats}; aggregate: {args.concurrent} "
          f"requests × ({args.concurrent_prompt} prompt + {args.concurrent_output} output tokens)", flush=True)
    machine = measure_machine(torch.float32)          # first: the roofs, before any system has run
    results: list[Result] = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        results.append(run_phasewise(dtype, prompt, batch, args))
        print(f"  done: {results[-1].name}", flush=True)
    peers = {"llama.cpp": ("llama_cpp", run_llama_cpp), "transformers": ("transformers", run_transformers)}
    for name in [p for p in args.peers.split(",") if p]:
        module, run = peers[name]
        try:
            __import__(module)
        except ImportError:
            print(f"  skipped {name}: `{module}` is not installed (make peers)", flush=True)
            continue
        results.append(run(path, prompt, batch, args))
        print(f"  done: {results[-1].name}", flush=True)
    print(f"\nmeasured read bandwidth: {machine.dram_gbs:.1f} GB/s from memory, {machine.cache_gbs:.1f} GB/s "
          f"from a buffer that fits the last-level cache; compute peaks: fp32 matmul {machine.matmul_gflops:.0f} "
          f"GFLOP/s" + (f", int8 dot products {machine.int8_gops:.0f} GOP/s" if machine.int8_gops else ""))
    head = f"{'':24}{'prefill tok/s':>14}{'decode tok/s':>14}{f'agg@{args.concurrent} tok/s':>15}" \
           f"{'weights MB':>12}{'weight GB/s':>13}{'of DRAM bw':>11}"
    print(head)
    for r in results:
        print(f"{r.name:24}{r.prefill:14.1f}{r.decode:14.1f}{r.aggregate:15.1f}{r.weight_bytes / 1e6:12.0f}"
              f"{r.weight_gbs:13.1f}{r.weight_gbs / machine.dram_gbs:11.0%}")
    print_roofline_and_quality(results, machine, path, args)
    ref = next((r for r in results if r.name.startswith("llama.cpp")), None)
    if ref is not None:
        print(f"\nratios to {ref.name}:")
        for r in results:
            if r is not ref:
                print(f"{r.name:24}{r.prefill / ref.prefill:13.2f}x{r.decode / ref.decode:13.2f}x"
                      f"{r.aggregate / ref.aggregate:14.2f}x")


if __name__ == "__main__":
    main()
