"""phasewise against the peers a user would pick instead, on the same model, in one run.

    .venv/bin/python benchmarks/compare_peers.py [--model gemma-3-270m] [--dtypes auto,fp32,q4/int8]
                                                 [--peers llama.cpp,transformers]
                                                 [--llama-cpp .peers/native/bin] [--input-len 512]
                                                 [--output-len 128] [--concurrent 32]
                                                 [--concurrent-prompt 128] [--concurrent-output 64] [--repeats 3]
                                                 [--json docs/results/compare_peers_<model>_<isa>.json]
    PHASEWISE_ISA=avx2 .venv/bin/python benchmarks/compare_peers.py --llama-cpp .peers/avx2/bin ...

Installs nothing: a peer that is missing is skipped with a note (`make peers` builds llama.cpp's
llama-bench and llama-server for this CPU, `make peers-avx2` for the AVX2 level, `make peers-avx512`
for AVX-512 without AMX: pass `--llama-cpp .peers/avx512/bin` on an AMX CPU where the native build
crashes with weight repacking on, as on one Sapphire Rapids-class VM here). Every system
runs the same GGUF (the default model's, or --model's: a .gguf file or a packaged model's name):
phasewise at each --dtypes precision ("WEIGHTS/KV", e.g. q4/int8; auto = what the engine picks),
on the kernels of PHASEWISE_ISA's level (default: the CPU's best); llama.cpp on the file as it is;
transformers dequantized to fp32. Figures:

- prefill tokens/s at batch 1: --input-len prompt tokens / time to the first token
  (llama.cpp: llama-bench's pp<input-len>);
- decode tokens/s at batch 1: (--output-len − 1) / time from the first to the last token, at
  two depths: "decode" from a one-token prompt (llama.cpp: llama-bench's tg<output-len>, which
  starts from an empty context) and "decode@N" after the --input-len prompt (llama.cpp:
  tg<output-len> @ d<input-len>); every step reads the whole context, so the two differ;
- served output tokens/s: --concurrent streamed completions at once through HTTP, measured by
  `phasewise bench serve` against `phasewise serve` and against `llama-server -np <concurrent>`
  (transformers: one padded batch through `generate`, no server);
- weight GB/s: the bytes of weights read per decode step × decode tokens/s, next to the
  machine's measured read bandwidth (the decode roofline; the model does not fit the L3);
- prefill and served GOP/s: the model's arithmetic (`lab.roofline`) per second, and its share of
  the compute roof: the int8 dot-product peak of the kernels' level for quantized weights
  (llama.cpp's included), torch's fp32 matmul otherwise;
- quality of each phasewise precision (unless --no-quality): perplexity of the repo's text
  (benchmarks/data/lighthouses.txt) and next-token top-1 agreement with fp32, teacher-forced,
  with the engine's own model and KV-cache dtype.

Each batch-1 figure of phasewise is the median of --repeats runs after a warm-up run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import serving  # noqa: E402
from decode_vs_hf import make_prompt  # noqa: E402


@dataclass
class Result:
    name: str
    prefill: float
    decode: float                          # from an (almost) empty context
    decode_deep: float                     # after the prompt
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
    weights = {"quantization": dtype} if dtype in ("int8", "q4") else {"dtype": dtype}
    llm = LLM(str(args.path), **weights, kv_dtype=kv_dtype or "auto", kv_cache_memory=1.0,
              enable_prefix_caching=False)
    one = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prefill, decode, deep = [], [], []
    for i in range(args.repeats + 1):
        out = llm.generate([fresh(prompt, i)], one)[0]
        short = llm.generate([fresh(prompt[:1], i)], one)[0]
        if i:
            prefill.append(len(prompt) / (out.metrics.prompt_ms / 1e3))
            deep.append((len(out.token_ids) - 1) / (out.metrics.decode_ms / 1e3))
            decode.append((len(short.token_ids) - 1) / (short.metrics.decode_ms / 1e3))
    from phasewise.lab.roofline import linear_params, weight_bytes_per_param

    cfg, precision = llm.model_config, llm.engine.precision
    nbytes = int(linear_params(cfg) * weight_bytes_per_param(llm.engine.model, cfg, 2 if "16" in dtype else 4))
    isa = llm.engine.kernels.isa if llm.engine.kernels is not None else "torch"
    name = f"phasewise {precision.weights}" + (" kv int8" if precision.kv == "int8" else "") + f" {isa}"
    quality = None if args.no_quality else teacher_forced(llm.engine.model, llm.engine.kv_cache.dtype, args.text_ids)
    del llm                                     # the server below loads its own copy
    server = serving.phasewise_server(precision.weights, precision.kv, args.threads, args.concurrent, str(args.path))
    aggregate = serving.served(server, args.load)["output_token_throughput"]
    return Result(name, statistics.median(prefill), statistics.median(decode), statistics.median(deep), aggregate,
                  nbytes, precision.weights in ("int8", "q4"), quality)


def teacher_forced(model, kv_dtype: torch.dtype, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Perplexity of `ids` and the top-1 token at each position (quality.py's runner)."""
    import math

    from quality import Runner

    nll, top, _ = Runner(model, kv_dtype, len(ids)).teacher_forced(ids, 512)
    return math.exp(nll.mean().item()), top


def fp32_reference(path: Path, ids: list[int]) -> tuple[float, torch.Tensor]:
    """The fp32 model's perplexity and top-1 tokens, with the kernels the engine would use."""
    from phasewise.kernels import build
    from phasewise.loading.loader import load_prepared

    model, _ = load_prepared(path, "fp32", "cpu", build.load())
    return teacher_forced(model, torch.float32, ids)


# ---- llama.cpp --------------------------------------------------------------------------------

def run_llama_cpp(path: Path, prompt, batch, args) -> Result:
    """llama-bench for batch 1, llama-server with a slot per concurrent request for serving."""
    pp, tg, tg_deep = serving.llama_bench(args.llama_cpp, path, args.threads, args.input_len,
                                          args.output_len, args.repeats)
    ctx = args.concurrent_prompt + args.concurrent_output + 64
    server = serving.llama_server(args.llama_cpp, path, args.threads, args.concurrent, ctx)
    aggregate = serving.served(server, args.load)["output_token_throughput"]
    from phasewise.loading.gguf import GGUFFile

    ftype = {2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 15: "Q4_K_M", 17: "Q5_K_M", 18: "Q6_K"}.get(
        GGUFFile(path).fields.get("general.file_type"), "GGUF")
    from scaling import describe                 # what a token reads: a mixture of experts' active experts

    return Result(f"llama.cpp {ftype} {args.llama_cpp.parent.name}", pp, tg, tg_deep, aggregate,
                  int(describe(path)["bytes_per_token"]))   # int8 dot products (Q8_1 activations): the int8 roof


# ---- transformers -------------------------------------------------------------------------------

@torch.inference_mode()
def run_transformers(path: Path, prompt, batch, args) -> Result:
    from transformers import AutoModelForCausalLM

    from decode_vs_hf import bench_hf

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prefill, deep = bench_hf(model, prompt, args.output_len, args.repeats)
    _, decode = bench_hf(model, prompt[:1], args.output_len, args.repeats)
    ids = torch.tensor(batch)                   # equal lengths: no padding needed
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=args.concurrent_output, min_new_tokens=args.concurrent_output,
                         pad_token_id=0)
    aggregate = (out.shape[1] - ids.shape[1]) * len(batch) / (time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Result("transformers fp32", prefill, decode, deep, aggregate, nbytes, quantized=False)


# ---- the tables -----------------------------------------------------------------------------------

def print_roofline_and_quality(results: list[Result], machine, path: Path, args) -> None:
    from phasewise.lab.roofline import request_flops
    from phasewise.loading.loader import load_config

    cfg = load_config(path)
    prefill_ops = request_flops(cfg, args.input_len, 1)          # the prompt and its first token
    agg_ops_per_token = request_flops(cfg, args.concurrent_prompt, args.concurrent_output) / args.concurrent_output
    base = None
    if not args.no_quality and any(r.quality for r in results):
        base = next((r.quality for r in results if r.name.startswith("phasewise fp32")), None)
        base = base or fp32_reference(path, args.text_ids)
    print(f"\n{'':32}{'prefill GOP/s':>14}{'of roof':>8}{'srv GOP/s':>11}{'of roof':>8}"
          + (f"{'ppl':>9}{'Δppl':>8}{'top1=fp32':>10}" if base else ""))
    for r in results:
        roof = machine.compute_roof(r.quantized)
        pre, agg = r.prefill * prefill_ops / args.input_len / 1e9, r.aggregate * agg_ops_per_token / 1e9
        line = f"{r.name:32}{pre:14.1f}{pre / roof:8.0%}{agg:11.1f}{agg / roof:8.0%}"
        if base and r.quality:
            ppl, top = r.quality
            line += f"{ppl:9.4f}{ppl / base[0] - 1:+8.2%}{(top == base[1]).float().mean().item():10.2%}"
        print(line)
    print(f"roof: int8 dot products for quantized weights ({machine.int8_gops or 0:.0f} GOP/s), else the fp32 "
          f"matmul ({machine.matmul_gflops:.0f} GFLOP/s); quality on {len(args.text_ids)} tokens of "
          f"lighthouses.txt" + (f", fp32 perplexity {base[0]:.4f}" if base else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or a packaged model (gemma-3-270m); default: "
                                                  "SmolLM2-135M-Instruct")
    ap.add_argument("--dtypes", default="auto", help="phasewise precisions, comma-separated (WEIGHTS/KV)")
    ap.add_argument("--peers", default="llama.cpp,transformers")
    ap.add_argument("--llama-cpp", type=Path, default=None,
                    help="the folder of llama-bench and llama-server (default: .peers/avx2/bin with "
                         "PHASEWISE_ISA=avx2, else .peers/native/bin)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for every system")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--concurrent-prompt", type=int, default=128)
    ap.add_argument("--concurrent-output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-quality", action="store_true", help="skip the perplexity and agreement pass")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here (docs/results/...)")
    args = ap.parse_args()
    if args.llama_cpp is None:
        level = "avx2" if os.environ.get("PHASEWISE_ISA") == "avx2" else "native"
        args.llama_cpp = Path(__file__).parent.parent / ".peers" / level / "bin"
    args.load = dict(num_prompts=args.concurrent, input_len=args.concurrent_prompt,
                     output_len=args.concurrent_output, concurrency=args.concurrent)
    torch.set_num_threads(args.threads)

    from phasewise.kernels import build
    from phasewise.lab.roofline import measure_machine
    from phasewise.loading.loader import resolve_model_path
    from phasewise.tokenization.tokenizer import Tokenizer

    path = args.path = resolve_model_path(args.model)
    tokenizer = Tokenizer.load(path)
    prompt = make_prompt(tokenizer, args.input_len)
    batch = prompts_for_batch(tokenizer, args.concurrent, args.concurrent_prompt)
    from quality import TEXT

    args.text_ids = tokenizer.encode(TEXT.read_text())
    kernels = build.load()
    print(f"model {path.name}, {args.threads} threads, phasewise kernels: {kernels.isa if kernels else 'none'}; "
          f"prefill and decode: {len(prompt)} prompt tokens, {args.output_len} decoded, median of "
          f"{args.repeats}; served: {args.concurrent} streamed requests at once × ({args.concurrent_prompt} "
          f"prompt + {args.concurrent_output} output tokens)", flush=True)
    from run_record import run_record

    record = run_record("compare_peers", args.threads)     # before anything runs: its load average
    machine = measure_machine(torch.float32)          # first: the roofs, before any system has run
    results: list[Result] = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        results.append(run_phasewise(dtype, prompt, batch, args))
        print(f"  done: {results[-1].name}", flush=True)
    peers = {"llama.cpp": run_llama_cpp, "transformers": run_transformers}
    for name in [p for p in args.peers.split(",") if p]:
        run = peers[name]
        if name == "llama.cpp" and not (args.llama_cpp / "llama-server").exists():
            print(f"  skipped llama.cpp: no llama-server in {args.llama_cpp} (make peers)", flush=True)
            continue
        results.append(run(path, prompt, batch, args))
        print(f"  done: {results[-1].name}", flush=True)
    print(f"\nmeasured read bandwidth: {machine.dram_gbs:.1f} GB/s from memory, {machine.cache_gbs:.1f} GB/s "
          f"from a buffer that fits the last-level cache; compute peaks: fp32 matmul {machine.matmul_gflops:.0f} "
          f"GFLOP/s" + (f", int8 dot products {machine.int8_gops:.0f} GOP/s" if machine.int8_gops else ""))
    deep = f"decode@{args.input_len}"
    head = f"{'':32}{'prefill tok/s':>14}{'decode tok/s':>14}{deep:>13}{f'served@{args.concurrent}':>15}" \
           f"{'weights MB':>12}{'weight GB/s':>13}{'of DRAM bw':>11}"
    print(head)
    for r in results:
        print(f"{r.name:32}{r.prefill:14.1f}{r.decode:14.1f}{r.decode_deep:13.1f}{r.aggregate:15.1f}"
              f"{r.weight_bytes / 1e6:12.0f}{r.weight_gbs:13.1f}{r.weight_gbs / machine.dram_gbs:11.0%}")
    print_roofline_and_quality(results, machine, path, args)
    if args.json:
        rows = [{"name": r.name, "prefill_tps": r.prefill, "decode_tps": r.decode, "decode_deep_tps": r.decode_deep,
                 "served_tps": r.aggregate, "weight_bytes": r.weight_bytes, "weight_gbs": r.weight_gbs}
                for r in results]
        args.json.write_text(json.dumps({**record, "model": args.model or path.name, "input_len": args.input_len,
                                         "output_len": args.output_len, "concurrent": args.concurrent,
                                         "llama_cpp": str(args.llama_cpp), "machine": dataclasses.asdict(machine),
                                         "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    ref = next((r for r in results if r.name.startswith("llama.cpp")), None)
    if ref is not None:
        print(f"\nratios to {ref.name}:")
        for r in results:
            if r is not ref:
                print(f"{r.name:32}{r.prefill / ref.prefill:13.2f}x{r.decode / ref.decode:13.2f}x"
                      f"{r.decode_deep / ref.decode_deep:12.2f}x{r.aggregate / ref.aggregate:14.2f}x")


if __name__ == "__main__":
    main()
