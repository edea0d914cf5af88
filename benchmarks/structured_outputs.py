"""What a grammar costs at serving speed: decode tokens/s with and without a JSON schema, in one process.

    .venv/bin/python benchmarks/structured_outputs.py [--model M] [--batch 1 32] [--tokens 128] [--rounds 3]
                                                      [--json docs/results/structured_outputs.json]

Each round runs, for every batch size, the same prompts plain and constrained (alternating, so the
machine's drift hits both); the schema (an array of at least 50 records) keeps every constrained
request generating for all --tokens tokens. Also: the first constrained request's extra time (the
tokenizer view and the compile) and a cached compile.
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["people"],
          "properties": {"people": {"type": "array", "minItems": 50, "items": {
              "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                             "city": {"type": "string", "maxLength": 24}}}}}}
ASK = "List fifty people with their name, age and city as JSON."


def run(llm, batch: int, tokens: int, constrained: bool) -> tuple[float, int]:
    """(output tokens per second, output tokens) of `batch` chats decoded together."""
    from phasewise import SamplingParams, StructuredOutputs

    so = StructuredOutputs(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
              for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": f"{ASK} ({i})"}] for i in range(batch)], params)
    wall = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return n / wall, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    from phasewise import LLM, SamplingParams, StructuredOutputs

    llm = LLM(args.model, kv_cache_memory=1.0)
    t0 = time.perf_counter()
    llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputs(
        json={"type": "object"})))
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    llm.engine.grammars.compile(StructuredOutputs(json=SCHEMA))
    compile_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    llm.engine.grammars.compile(StructuredOutputs(json=SCHEMA))
    cached_ms = (time.perf_counter() - t0) * 1e3
    rates: dict[tuple[int, bool], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batch:
            for constrained in (False, True):
                rate, n = run(llm, b, args.tokens, constrained)
                assert n == b * args.tokens, f"{n} tokens: a constrained request ended early"
                rates.setdefault((b, constrained), []).append(rate)
    rows = []
    print(f"{llm.engine.model_path.name}: first constrained request {first_ms:.0f} ms (tokenizer view + compile + "
          f"one token), a new schema {compile_ms:.1f} ms, the same schema again {cached_ms:.2f} ms")
    print(f"{'batch':>5} {'plain tok/s':>18} {'JSON schema tok/s':>20} {'ratio (best)':>13}")
    for b in args.batch:
        plain, con = rates[(b, False)], rates[(b, True)]
        rows.append({"batch": b, "plain_tok_s": plain, "schema_tok_s": con, "ratio_best": max(con) / max(plain)})
        print(f"{b:>5} {min(plain):>8.1f}-{max(plain):<8.1f} {min(con):>9.1f}-{max(con):<9.1f} "
              f"{max(con) / max(plain):>13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": llm.engine.model_path.name, "tokens": args.tokens, "first_request_ms": first_ms,
                       "compile_ms": compile_ms, "cached_compile_ms": cached_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
