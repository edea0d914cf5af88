"""Linear-layer kernels at the default model's shapes: fp32 oneDNN against the int8 and q4 kernels.

    .venv/bin/python benchmarks/kernels.py [--rows 1,4,32,512] [--repeats 5] [--min-time 0.2] [--threads N] [--cold]
        [--shapes qkv,o,...] [--formats int8,q4 | any of q4,q8,q5,k4,q6k,k6,k8,i8]

For each weight shape (N, K) of SmolLM2-135M (or Gemma 3 270M: --shapes gemma_qkv,gemma_o,
gemma_gate_up,gemma_down; Qwen2.5-1.5B's: qwen15_qkv,qwen15_o,qwen15_gate_up,qwen15_down) and each number of activation rows M, prints the median time of one
call, the weight bytes read per second (GB/s, what bounds decode) and the arithmetic rate
(GFLOP/s, what bounds prefill). q4 is GGUF Q4_1 except the output head, which the default file
stores as Q8_0; --formats names packed formats (kernels/quant.py) to compare them on one shape.
Random weights; the kernels' speed does not depend on the values.
Run it alone: another process on this 2-core machine changes the numbers several-fold.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from phasewise.kernels import build, quant
from phasewise.layers.linear import Linear, onednn_available

L3_BYTES = 32 << 20
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576),
          "gemma_qkv": (1536, 640), "gemma_o": (640, 1024), "gemma_gate_up": (4096, 640), "gemma_down": (640, 2048),
          "qwen15_qkv": (2048, 1536), "qwen15_o": (1536, 1536), "qwen15_gate_up": (17920, 1536),
          "qwen15_down": (1536, 8960)}


def random_packed(fmt: str, n: int, k: int) -> quant.PackedWeight:
    kb = k // quant.QK
    d = (torch.rand(n, kb) * 0.01).half()
    if fmt == "q4":
        qs = torch.randint(0, 256, (n, kb, 16), dtype=torch.uint8)
        return quant.pack("q4", torch.cat([qs & 0x0F, qs >> 4], dim=-1), [d, (-torch.rand(n, kb) * 0.05).half()])
    if fmt in ("q8", "q5"):
        lo, hi = (-127, 127) if fmt == "q8" else (-16, 15)
        return quant.pack(fmt, torch.randint(lo, hi + 1, (n, kb, 32)), [d])
    if fmt in ("k4", "q6k"):         # sub-block scales as integers, fp16 super-block scales (K % 256 == 0)
        sb = [(torch.rand(n, kb // quant.SUPER) * 1e-3).half().float()
              for _ in range(quant.FORMATS[fmt].super_scales)]
        if fmt == "k4":
            return quant.pack("k4", torch.randint(0, 16, (n, kb, 32)), [torch.randint(0, 64, (n, kb)) for _ in "sm"], sb)
        return quant.pack("q6k", torch.randint(-32, 32, (n, kb, 32)), [*torch.randint(-128, 128, (2, n, kb))], sb)
    lo, hi = {"k6": (-32, 31), "k8": (-127, 127)}[fmt]
    scales = [torch.rand(n, kb) * 0.01 for _ in range(2)] + [-torch.rand(n, kb) * 0.05]
    if fmt == "k6":                 # d, each half's integer sc (Q6_K's int8), m
        scales = [scales[0] * 0.02, *torch.randint(-128, 128, (2, n, kb)).float(), scales[2]]
    return quant.pack(fmt, torch.randint(lo, hi + 1, (n, kb, 32)), scales)


def clone(w: quant.PackedWeight) -> quant.PackedWeight:
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return quant.PackedWeight(fmt=w.fmt, n=w.n, k=w.k, blocks=c(w.blocks), scale=c(w.scale), u5_tiles=w.u5_tiles)


def with_kernels(layer: Linear, kernels) -> Linear:
    layer.bind_kernels(kernels)
    return layer


def dense(w: torch.Tensor, onednn: bool) -> Linear:
    """An fp32 layer holding w, packed for oneDNN where it runs."""
    layer = Linear(w.shape[1], w.shape[0])
    layer.weight.data = w
    if onednn:
        layer.pack_for_onednn()
    return layer


def timeit(fns: list, x: torch.Tensor, repeats: int, min_time: float) -> float:
    """Median seconds per call, cycling through copies of the layer (more than the L3 holds: --cold)."""
    def run(n: int) -> None:
        for i in range(n):
            fns[i % len(fns)](x)
    run(len(fns))
    n, t0 = 1, time.perf_counter()
    while time.perf_counter() - t0 < min_time / 4:
        run(1)
        n += 1
    n = max(n, len(fns))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(n)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,32,512")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--formats", default="int8,q4",
                    help="int8 (per channel from the fp32 weight), q4 (the default file's blocks) or packed formats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--cold", action="store_true",
                    help="cycle through copies of each layer worth 3x the L3 cache (weights come from DRAM, "
                         "as in decode); default: one copy, warm in cache")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ext = build.load()                    # PHASEWISE_ISA picks a lower level
    if ext is None:
        print("note: the C++ kernels are unavailable; int8/q4 run their PyTorch reference")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernels: {ext.isa if ext else 'none'}")
    print(f"{'shape':>8} {'N x K':>11} {'M':>4} | {'kernel':>6} {'us':>9} {'GB/s':>6} {'GFLOP/s':>8} {'vs fp32':>7}")
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            w = torch.randn(n, k) * 0.05
            onednn = onednn_available(torch.device("cpu"), torch.float32)
            packed = {f: quant.quantize_i8(w) if f in ("int8", "i8") else
                      random_packed("q8" if f == "q4" and name == "lm_head" else f, n, k) for f in args.formats.split(",")}
            factories = {"fp32": (lambda: dense(w, onednn), 4 * n * k)}
            for fmt, pw in packed.items():
                factories[fmt] = (lambda pw=pw: with_kernels(Linear.from_blocks(clone(pw)), ext), pw.nbytes())
            kernels = {}
            for kname, (make, nbytes) in factories.items():
                copies = -(-L3_BYTES * 3 // nbytes) if args.cold else 1
                kernels[kname] = ([make() for _ in range(copies)], nbytes)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                base = None
                for kname, (mods, nbytes) in kernels.items():
                    t = timeit(mods, x, args.repeats, args.min_time)
                    base = base or t
                    print(f"{name:>8} {f'{n}x{k}':>11} {m:>4} | {kname:>6} {t * 1e6:9.1f} {nbytes / t / 1e9:6.1f} "
                          f"{2 * m * n * k / t / 1e9:8.1f} {base / t:6.2f}x")


if __name__ == "__main__":
    main()
