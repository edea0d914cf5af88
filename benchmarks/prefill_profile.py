"""Where a long prompt's prefill time goes (issue 56), by part, on one model:

    .venv/bin/python benchmarks/prefill_profile.py [--model qwen2.5-coder-1.5b] [--lengths 512,4096]

Each prompt (N random ids, the engine's chunks of 512 tokens) is prefilled twice in one process: once
as the engine runs it (the C++ decoder stack: one call per step), then with the model's Python layers,
which call the same kernels op by op, each op's wall time taken around it (CPU kernels return when
done): the projections (qkv, o, gate_up, down: activation quantization and the int8 GEMM), attention
(RoPE and the cache write, the attention kernel), RMSNorms, SiLU·mul, and the rest of the step (the
output head on the last row, sampling, the scheduler, Python). Each projection's rate is shown against
the int8 dot-product peak `phasewise roofline` measured. The stack's time is the real one; the split
is the Python path's (its op-by-op calls cost a few percent more). Writes
docs/results/prefill_profile.json. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_record import run_record                                           # noqa: E402

from phasewise import LLM, SamplingParams                                   # noqa: E402
from phasewise.lab.roofline import load_machine                             # noqa: E402

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def timed(parts: dict[str, float], name: str, module: torch.nn.Module) -> None:
    """Add `module`'s forward wall time to parts[name] on every call."""
    started: list[float] = []
    module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    module.register_forward_hook(lambda *_: parts.__setitem__(name, parts[name] + time.perf_counter() - started.pop()))


def prefill_s(llm: LLM, n: int, rng: random.Random, vocab: int) -> float:
    out = llm.generate([[rng.randrange(1000, vocab - 1000) for _ in range(n)]],
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
    return out.metrics.prompt_ms / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent.parent / "docs/results/prefill_profile.json")
    args = ap.parse_args()
    machine = load_machine(torch.float32)
    peak = machine.int8_gops if machine is not None else None
    lengths = [int(x) for x in args.lengths.split(",")]
    llm = LLM(model=args.model, max_model_len=max(lengths) + 16)
    cfg, decoder = llm.model_config, llm.engine.model.model
    rng = random.Random(0)
    prefill_s(llm, 64, rng, cfg.vocab_size)                     # warm-up
    stack = {n: prefill_s(llm, n, rng, cfg.vocab_size) for n in lengths}

    parts: dict[str, float] = defaultdict(float)
    for layer in decoder.layers:
        for name in PROJECTIONS:
            owner = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
            timed(parts, name, getattr(owner, name))
        timed(parts, "attention block", layer.self_attn)
        timed(parts, "mlp block", layer.mlp)
        timed(parts, "rmsnorm", layer.input_layernorm)
        timed(parts, "rmsnorm", layer.post_attention_layernorm)
    timed(parts, "decoder", decoder)
    saved, decoder.stack = decoder.stack, None
    rows = []
    for n in lengths:
        parts.clear()
        total = prefill_s(llm, n, rng, cfg.vocab_size)
        split = {name: parts[name] for name in PROJECTIONS}
        split["attention (RoPE, cache write, kernel)"] = parts["attention block"] - parts["qkv_proj"] - parts["o_proj"]
        split["SiLU·mul"] = parts["mlp block"] - parts["gate_up_proj"] - parts["down_proj"]
        split["rmsnorm"] = parts["rmsnorm"]
        split["the rest of the decoder (embedding, residuals, final norm, Python)"] = (
            parts["decoder"] - parts["attention block"] - parts["mlp block"] - parts["rmsnorm"])
        split["outside the decoder (head, sampling, scheduler)"] = total - parts["decoder"]
        h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
        shapes = {"qkv_proj": h * (cfg.q_size + 2 * cfg.kv_size), "o_proj": cfg.q_size * h,
                  "gate_up_proj": 2 * h * i, "down_proj": h * i}
        gops = {name: 2 * shapes[name] * L * n / split[name] / 1e9 for name in PROJECTIONS}
        row = {"tokens": n, "stack_s": stack[n], "stack_tps": n / stack[n], "python_layers_s": total,
               "parts_s": split, "projection_gops": gops,
               "projection_share_of_int8_peak": {k: v / peak for k, v in gops.items()} if peak else None}
        rows.append(row)
        print(f"\n{args.model}, {n} tokens: the stack {stack[n]:.2f} s ({n / stack[n]:.0f} tok/s); "
              f"the Python layers {total:.2f} s, of which:")
        for name, secs in split.items():
            extra = f"  {gops[name]:6.0f} GOP/s" + (f" ({gops[name] / peak:.0%} of the int8 peak)" if peak else "") \
                if name in gops else ""
            print(f"  {name:<68} {secs:7.3f} s {secs / total:6.1%}{extra}")
    decoder.stack = saved
    report = {**run_record("prefill_profile", torch.get_num_threads()), "model": args.model,
              "int8_peak_gops": peak, "rows": rows}
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
