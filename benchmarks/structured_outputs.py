"""What a grammar costs at serving speed: decode tokens/s with and without a JSON schema, in one process.

    .venv/bin/python benchmarks/structured_outputs.py [--model M] [--batch 1 32] [--output-len 128] [--rounds 3]
                                                      [--json docs/results/structured_outputs.json]

Each round runs, for every batch size, the same prompts plain and constrained (alternating, so the
machine's drift hits both); each constrained request has its own schema (an array of at least 50
records whose field names differ per request), which keeps it generating for all --output-len tokens.
Also: the first constrained request's extra time (the tokenizer view and the compile), and the
compile of a typical schema (10 fields, nested 2 deep), new and cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

def schema(i: int) -> dict:
    """Request i's schema: at least 50 records, with field names of its own."""
    return {"type": "object", "additionalProperties": False, "required": ["people"],
            "properties": {"people": {"type": "array", "minItems": 50, "items": {
                "type": "object", "additionalProperties": False, "required": [f"name{i}", f"age{i}", f"city{i}"],
                "properties": {f"name{i}": {"type": "string", "maxLength": 24}, f"age{i}": {"type": "integer"},
                               f"city{i}": {"type": "string", "maxLength": 24}}}}}}


def typical_schema(tag: str) -> dict:
    """10 fields, nested 2 deep: an order with a customer and items (tag makes it new to the cache)."""
    address = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
               "required": ["street", "city"]}
    customer = {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                                 "address": address}, "required": ["name"]}
    item = {"type": "object", "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                                             "price": {"type": "number"}}, "required": ["sku", "quantity"]}
    return {"title": tag, "type": "object", "required": ["id", "customer", "items"], "properties": {
        "id": {"type": "string"}, "customer": customer, "items": {"type": "array", "items": item},
        "status": {"enum": ["new", "paid", "shipped"]}, "note": {"type": "string", "maxLength": 200}}}
ASK = "List fifty people with their name, age and city as JSON."


def run(llm, batch: int, tokens: int, constrained: bool) -> tuple[float, int, float]:
    """(output tokens per second, output tokens, the grammar masks' share of the steps' time) of `batch`
    chats decoded together."""
    from phasewise import SamplingParams, StructuredOutputs

    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True,
                             structured_outputs=StructuredOutputs(json=schema(i)) if constrained else None)
              for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": f"{ASK} ({i})"}] for i in range(batch)], params)
    wall = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    steps = [s for s in llm.engine.steps if s.record.start >= t0]   # the records' clock is perf_counter's
    grammar_ms = sum(s.extras.grammar_ms for s in steps)
    return n / wall, n, grammar_ms / max(sum(s.record.duration_ms for s in steps), 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    from phasewise import LLM, SamplingParams, StructuredOutputs

    llm = LLM(args.model, kv_cache_memory=1.0)
    t0 = time.perf_counter()
    llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputs(
        json={"type": "object"})))
    first_ms = (time.perf_counter() - t0) * 1e3
    compile_ms, cached_ms = [], []
    for k in range(5):
        typical = StructuredOutputs(json=typical_schema(f"order {k}"))
        t0 = time.perf_counter()
        llm.engine.grammars.compile(typical)
        t1 = time.perf_counter()
        llm.engine.grammars.compile(typical)
        compile_ms.append((t1 - t0) * 1e3)
        cached_ms.append((time.perf_counter() - t1) * 1e3)
    compile_ms, cached_ms = sorted(compile_ms)[2], sorted(cached_ms)[2]   # medians of 5
    rates: dict[tuple[int, bool], list[float]] = {}
    shares: dict[int, list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batch:
            for constrained in (False, True):
                rate, n, share = run(llm, b, args.output_len, constrained)
                assert n == b * args.output_len, f"{n} tokens: a constrained request ended early"
                llm.engine.grammars._cache.clear()        # every round compiles its schemas anew
                rates.setdefault((b, constrained), []).append(rate)
                if constrained:
                    shares.setdefault(b, []).append(share)
    rows = []
    print(f"{llm.engine.model_path.name}: first constrained request {first_ms:.0f} ms (tokenizer view + compile + "
          f"one token); a typical schema (10 fields, nesting 2) compiles in {compile_ms:.1f} ms, "
          f"{cached_ms:.2f} ms cached (medians of 5)")
    print(f"{'batch':>5} {'plain tok/s':>18} {'a schema each, tok/s':>22} {'best/best':>10} {'median/median':>14} {'grammar share':>14}")
    for b in args.batch:
        plain, con = rates[(b, False)], rates[(b, True)]
        best, median = max(con) / max(plain), statistics.median(con) / statistics.median(plain)
        share = statistics.median(shares[b])
        rows.append({"batch": b, "plain_tok_s": plain, "schema_tok_s": con, "ratio_best": best,
                     "ratio_median": median, "grammar_share": share})
        print(f"{b:>5} {min(plain):>8.1f}-{max(plain):<8.1f} {min(con):>10.1f}-{max(con):<10.1f} {best:>10.2f} "
              f"{median:>14.2f} {share:>13.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": llm.engine.model_path.name, "tokens": args.output_len, "first_request_ms": first_ms,
                       "compile_ms": compile_ms, "cached_compile_ms": cached_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
