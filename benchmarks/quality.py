"""Quality and speed of each weight precision on a text the repo ships, in one process.

    .venv/bin/python benchmarks/quality.py [--dtypes fp32,int8,q4,q4/int8] [--kernels auto|torch]
                                           [--text benchmarks/data/lighthouses.txt] [--chunk 512] [--window N]
                                           [--output-len 64] [--repeats 3] [--threads N] [--record] [--json OUT]

For each --dtypes precision of the default model (or --model); "WEIGHTS/KV" also sets the KV-cache
dtype (q4/int8: 4-bit weights and an int8 KV cache; fp32/int4: fp32 weights and an int4 KV cache):
- perplexity of the text, teacher-forced, in prefill chunks of --chunk tokens over the paged KV cache
  (one sequence, or independent --window-token sequences);
- top-1 agreement: the share of positions whose most likely next token equals fp32's;
- prefill tokens/s of that pass, and decode tokens/s at batch 1 (--output-len greedy tokens
  after a 128-token prompt), the model alone (no engine, no sampling), with the kernels the engine
  uses (--kernels auto: linear kernels and the fused CPU ops); medians of --repeats.
Speeds are only comparable within one run on a machine nobody else is using. --record keeps each
precision's perplexity against fp32 in the cache, where the engine's default precision reads it
(phasewise.engine.precision.measured: the KV cache beside q4 weights is int8 only where that pair holds 0.5%).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from phasewise.kernels import build
from phasewise.layers.attention import AttentionMetadata
from phasewise.loading.loader import load_prepared
from phasewise.loading.loader import default_model_path, parse_dtype
from phasewise.engine.precision import INT4_KV_SCHEME, INT8_KV_SCHEME, measured, record_path
from phasewise.runner.kv_cache import INT4, KVCache, key_group
from phasewise.tokenization.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "lighthouses.txt"


class Runner:
    """One sequence through the model over a paged KV cache."""

    def __init__(self, model, dtype: torch.dtype, max_tokens: int, block_size: int = 16) -> None:
        self.model, self.block_size = model, block_size
        blocks = -(-max_tokens // block_size) + 1
        self.cache = KVCache(model.config, blocks, block_size, dtype, "cpu", grouped=False)   # one table
        self.table = list(range(blocks))

    @torch.inference_mode()
    def hidden(self, ids: list[int], start: int) -> torch.Tensor:
        n = len(ids)
        meta = AttentionMetadata.build([n], [start + n], [self.table], self.block_size, torch.device("cpu"))
        return self.model(torch.tensor(ids), torch.arange(start, start + n), meta, self.cache.layers)

    @torch.inference_mode()
    def teacher_forced(self, ids: list[int], chunk: int, window: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Per position t < len-1: -log p(ids[t+1]) and the argmax; and the seconds it took. With a
        `window`, the text is cut into independent sequences of that many tokens, each from position 0."""
        nll, top = [], []
        t0 = time.perf_counter()
        for w in range(0, len(ids) - 1, window or len(ids)):
            seq = ids[w:w + window + 1] if window else ids
            for s in range(0, len(seq) - 1, chunk):
                part = seq[s: min(s + chunk, len(seq) - 1)]
                logits = self.model.compute_logits(self.hidden(part, s)).float()
                target = torch.tensor(seq[s + 1: s + 1 + len(part)])
                nll.append(torch.nn.functional.cross_entropy(logits, target, reduction="none"))
                top.append(logits.argmax(-1))
        return torch.cat(nll), torch.cat(top), time.perf_counter() - t0

    @torch.inference_mode()
    def decode(self, prompt: list[int], n: int) -> float:
        """Seconds per greedy token after the prompt (first token excluded)."""
        logits = self.model.compute_logits(self.hidden(prompt, 0)[-1:])
        tok, pos = int(logits.argmax()), len(prompt)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(self.model.compute_logits(self.hidden([tok], pos)).argmax())
            pos += 1
        return (time.perf_counter() - t0) / n


def _write_json(args: argparse.Namespace, path: Path, tokens: int, rows: list[dict]) -> None:
    """The run's record (benchmarks/run_record.py) and each precision's row."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from run_record import run_record

    report = {**run_record("quality", torch.get_num_threads()), "model": path.name, "text": str(args.text),
              "tokens": tokens, "window": args.window, "chunk": args.chunk, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="fp32,int8,q4")
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch"])
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--window", type=int, default=0,
                    help="score independent windows of this many tokens (0: the whole text as one sequence)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--record", action="store_true", help="keep the figures for the engine's default precision")
    ap.add_argument("--json", type=Path, default=None, help="also write each precision's perplexity here (docs/results/; speeds left out)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model_path()
    tok = Tokenizer.load(path)
    ids = tok.encode(args.text.read_text())
    print(f"{args.text.name}: {len(ids)} tokens; kernels={args.kernels}; {torch.get_num_threads()} threads")
    print(f"{'dtype':>8} {'ppl':>8} {'Δppl':>7} {'top1=fp32':>9} | {'prefill tok/s':>13} {'decode tok/s':>12}")
    base_top, base_ppl, deltas, rows = None, None, {}, []
    dtypes = args.dtypes.split(",")
    if "fp32" in dtypes:   # the reference for the agreement comes first
        dtypes.remove("fp32")
        dtypes.insert(0, "fp32")
    for spec in dtypes:
        dtype, _, kv = spec.partition("/")
        # as the engine does: the ISA level's kernels (PHASEWISE_ISA), or plain PyTorch with --kernels torch
        kernels = build.load() if args.kernels == "auto" else None
        model, _ = load_prepared(path, dtype, "cpu", kernels, plain=args.kernels == "torch")
        model.build_stack(kernels)              # the C++ decoder stack, as the engine builds it
        kv_dtype = {"int8": torch.int8, "int4": INT4}.get(kv) or parse_dtype(dtype)
        runner = Runner(model, kv_dtype, len(ids) + args.output_len, max(16, key_group(kv_dtype)))
        prefill, decode = [], []
        for _ in range(args.repeats):
            nll, top, seconds = runner.teacher_forced(ids, args.chunk, args.window)
            prefill.append((len(ids) - 1) / seconds)
            decode.append(1 / runner.decode(ids[:128], args.output_len))
        ppl = math.exp(nll.mean().item())
        if spec == "fp32":
            base_top, base_ppl = top, ppl
        agree = f"{(top == base_top).float().mean().item():9.2%}" if base_top is not None else f"{'-':>9}"
        delta = f"{ppl / base_ppl - 1:+7.2%}" if base_ppl else f"{'-':>7}"
        if base_ppl and spec != "fp32":
            deltas[spec] = round(ppl / base_ppl - 1, 5)
        rows.append({"dtype": spec, "ppl": round(ppl, 5), "vs_fp32": deltas.get(spec),
                     "top1_fp32": round((top == base_top).float().mean().item(), 5) if base_top is not None else None})
        print(f"{spec:>8} {ppl:8.4f} {delta} {agree} | {statistics.median(prefill):13.1f} "
              f"{statistics.median(decode):12.1f}", flush=True)
        del model, runner
    if args.json:
        _write_json(args, path, len(ids), rows)
    if args.record:
        if not deltas:
            raise SystemExit("--record needs fp32 and at least one other precision in --dtypes")
        target = record_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({**measured(path), **deltas, "int8_kv": INT8_KV_SCHEME, "int4_kv": INT4_KV_SCHEME},
                                      indent=1))
        print(f"recorded in {target}")


if __name__ == "__main__":
    main()
