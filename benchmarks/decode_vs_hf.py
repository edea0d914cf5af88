"""Batch-1 prefill and decode speed: phasewise next to Hugging Face transformers, same model, same run.

    .venv/bin/python benchmarks/decode_vs_hf.py [--input-len 512] [--output-len 128] [--repeats 3]

Both run the default model's GGUF dequantized to fp32 on the CPU, greedy, ignoring eos.
Prefill tokens/s = prompt tokens / time to the first token; decode tokens/s =
(generated tokens - 1) / time from the first token to the last. Each figure is
the median of --repeats runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

TEXT = (
    "The history of computing is a story of layers. At the bottom sit transistors, switching on and off "
    "billions of times a second; above them, logic gates; above those, processors that fetch, decode and "
    "execute instructions. Operating systems share the machine among programs, compilers translate human "
    "intentions into instructions, and libraries package solutions to common problems so that nobody has to "
    "solve them twice. Each layer hides the details of the one beneath it, and each brings its own costs. "
)


def make_prompt(tokenizer, n_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer.encode(TEXT, add_special_tokens=False)
    return ids[:n_tokens]


def bench_phasewise(llm, prompt: list[int], n_decode: int, repeats: int) -> tuple[float, float]:
    from phasewise import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n_decode, ignore_eos=True)
    prefill, decode = [], []
    for i in range(repeats + 1):
        out = llm.generate([prompt], params)[0]
        m = out.metrics
        if i:  # the first run warms up
            prefill.append(len(prompt) / (m.prompt_ms / 1e3))
            decode.append((len(out.token_ids) - 1) / (m.decode_ms / 1e3))
    return statistics.median(prefill), statistics.median(decode)


@torch.inference_mode()
def bench_hf(model, prompt: list[int], n_decode: int, repeats: int) -> tuple[float, float]:
    """A plain greedy loop on transformers' own KV cache (what `generate` does, minus its extras)."""
    prefill, decode = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        step = model(torch.tensor([prompt]), use_cache=True)
        token = step.logits[0, -1].argmax()
        t1 = time.perf_counter()
        for _ in range(n_decode - 1):
            step = model(token.view(1, 1), past_key_values=step.past_key_values, use_cache=True)
            token = step.logits[0, -1].argmax()
        t2 = time.perf_counter()
        if i:
            prefill.append(len(prompt) / (t1 - t0))
            decode.append((n_decode - 1) / (t2 - t1))
    return statistics.median(prefill), statistics.median(decode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from phasewise import LLM

    llm = LLM()
    path = llm.engine.model_path
    prompt = make_prompt(llm.tokenizer, args.input_len)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    print(f"model {path.name}, fp32, {torch.get_num_threads()} threads, "
          f"{len(prompt)} prompt tokens, {args.output_len} decoded, median of {args.repeats}")
    ours = bench_phasewise(llm, prompt, args.output_len, args.repeats)
    theirs = bench_hf(hf, prompt, args.output_len, args.repeats)
    print(f"{'':14}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'phasewise':14}{ours[0]:15.1f}{ours[1]:15.1f}")
    print(f"{'transformers':14}{theirs[0]:15.1f}{theirs[1]:15.1f}")
    print(f"{'ratio':14}{ours[0] / theirs[0]:14.2f}x{ours[1] / theirs[1]:14.2f}x")


if __name__ == "__main__":
    main()
