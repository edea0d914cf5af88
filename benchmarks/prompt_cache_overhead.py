"""Does the prompt cache's disk tier slow the engine down? Prefill and decode throughput with it on and
off, in one process (issue 68's targets: at most 5% slower prefill, 2% slower decode):

    .venv/bin/python benchmarks/prompt_cache_overhead.py [--model M] [--rounds 6] [--prompt-len 1024]
        [--prompts 4] [--batch 8] [--output-len 128] [--dir DIR] [--json FILE]

Two engines of the model (`LLM`, its default precision; --model: the default model otherwise), one
with `prompt_cache_dir` (a fresh folder, or --dir) and one without, the same in all else. Each round
runs both, one after the other, the order swapped every round (A B, B A, ...): prefill, --prompts
prompts of --prompt-len distinct random ids one at a time (max_tokens 1), prompt tokens over their wall
time; then decode, --batch prompts of 16 random ids together, --output-len tokens each (ignore_eos),
the tokens after each one's first over the time from the first first token to the last finish. Every
prompt is new (no hit in RAM or on disk): the disk tier's engine writes each prompt's and reply's
blocks as it runs (its writer thread beside it) and looks each prompt up on disk first. After its
turn, its writer is flushed (untimed: the other engine runs on a quiet disk), the wait printed.
Reported: each kind's median over the rounds per engine with the rounds' spread, and the slowdown:
1 - the median over rounds of on / off within the round (a pair runs back to back, so a machine
whose speed drifts between rounds moves both of it); the disk tier's counters (blocks written, dropped: the writer fell behind). Run it
alone on a quiet machine: another process changes every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ID_RANGE = (1000, 20_000)         # random prompt ids: within every real vocabulary


def prefill_tps(llm, rng: random.Random, prompts: int, length: int) -> float:
    """Prompt tokens per second of wall time, prompts one at a time (each new)."""
    from phasewise.core.sampling_params import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1)
    tokens, wall = 0, 0.0
    for _ in range(prompts):
        ids = [rng.randrange(*ID_RANGE) for _ in range(length)]
        started = time.perf_counter()
        llm.generate(ids, one)
        wall += time.perf_counter() - started
        tokens += length
    return tokens / wall


def decode_tps(llm, rng: random.Random, batch: int, output_len: int) -> float:
    """Output tokens after each request's first, per second from the first first token to the last finish."""
    from phasewise.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    outs = llm.generate([[rng.randrange(*ID_RANGE) for _ in range(16)] for _ in range(batch)], params)
    start = min(o.metrics.first_token for o in outs)
    end = max(o.metrics.finished for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / (end - start)


def spread(values: list[float], fmt: str = ",.1f") -> str:
    return f"{min(values):{fmt}} .. {max(values):{fmt}}"


def measure(args: argparse.Namespace, cache_dir: Path) -> dict:
    from phasewise import LLM

    common = dict(model=args.model, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=max(args.prompt_len, 16 + args.output_len) + 16)
    engines = {"on": LLM(**common, prompt_cache_dir=str(cache_dir)), "off": LLM(**common)}
    rng = random.Random(args.seed)
    figures: dict[str, dict[str, list[float]]] = {k: {"prefill_tps": [], "decode_tps": []} for k in engines}
    flush_s: list[float] = []
    try:
        for name, llm in engines.items():                   # warm-up: a round of each, not counted
            prefill_tps(llm, rng, 1, min(args.prompt_len, 64))
            decode_tps(llm, rng, args.batch, 4)
        for r in range(args.rounds):
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                llm = engines[name]
                figures[name]["prefill_tps"].append(prefill_tps(llm, rng, args.prompts, args.prompt_len))
                figures[name]["decode_tps"].append(decode_tps(llm, rng, args.batch, args.output_len))
                if name == "on":
                    started = time.perf_counter()
                    llm.engine.core.disk.flush()
                    flush_s.append(time.perf_counter() - started)
                print(f"round {r + 1} disk tier {name:3}: prefill {figures[name]['prefill_tps'][-1]:8.1f} tok/s, "
                      f"decode {figures[name]['decode_tps'][-1]:7.1f} tok/s"
                      + (f" (writer flushed in {flush_s[-1]:.2f} s)" if name == "on" else ""), flush=True)
        disk = engines["on"].engine.stats().disk
        counters = {"blocks_written": disk.blocks_written, "bytes_written": disk.bytes_written,
                    "dropped": disk.dropped, "write_errors": disk.write_errors, "blocks_read": disk.blocks_read}
        precision = str(engines["on"].engine.precision)
        model = str(engines["on"].engine.model_path)
        threads = engines["on"].engine.thread_stats().threads
    finally:
        for llm in engines.values():
            llm.close()
    summary = {}
    for kind in ("prefill_tps", "decode_tps"):
        on, off = (statistics.median(figures[k][kind]) for k in ("on", "off"))
        ratios = [a / b for a, b in zip(figures["on"][kind], figures["off"][kind])]   # each round's pair
        summary[kind] = {"on": on, "off": off, "ratios": ratios, "slowdown": 1 - statistics.median(ratios)}
    return {"model": model, "precision": precision, "threads": threads, "figures": figures, "summary": summary,
            "disk": counters, "flush_s": flush_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the default model unless given")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4, help="prefill prompts per round and engine")
    ap.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=float, default=1.0)
    ap.add_argument("--dir", type=Path, default=None, help="the disk tier's folder (default: a fresh temporary one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="phasewise-cache-overhead-") as tmp:
        result = measure(args, args.dir or Path(tmp))
    for kind, target in (("prefill_tps", 0.05), ("decode_tps", 0.02)):
        s, f = result["summary"][kind], result["figures"]
        print(f"{kind[:-4]:8} median: off {s['off']:8.1f} tok/s ({spread(f['off'][kind])}), on {s['on']:8.1f} tok/s "
              f"({spread(f['on'][kind])}); on/off within a round {spread(s['ratios'], '.3f')}: {s['slowdown']:+.1%} slower "
              f"(median; target <= {target:.0%})")
    d = result["disk"]
    print(f"disk tier: {d['blocks_written']} blocks ({d['bytes_written'] / 2**20:.0f} MiB) written, {d['dropped']} "
          f"dropped, {d['write_errors']} failed; {result['model']} ({result['precision']})")
    if args.json:
        from run_record import run_record

        record = run_record("prompt_cache_overhead", result["threads"])
        args.json.write_text(json.dumps({**record, **result, "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
