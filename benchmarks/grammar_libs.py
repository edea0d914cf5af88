"""Compare the constrained-decoding libraries llguidance and xgrammar on one CPU thread.

Per tokenizer folder and library: tokenizer-info build time; grammar compile time, cold (median
of 3, caches cleared) and cached (xgrammar: compiler cache hit; llguidance: deep_copy of a ready
matcher), for JSON schemas, any-JSON, regex, choice, GBNF and Lark, plus the first mask; per-token
mask time stepping through a valid JSON document at batch 1 and batch B (B matchers filling rows of
one int32 bitmask, sequentially); applying a [B, vocab] bitmask to float32 logits; and whether
special tokens are allowed inside a JSON string and padding rows (vocab > tokenizer) are masked.

Usage (venv with torch, transformers, llguidance, xgrammar):
    python benchmarks/grammar_libs.py --tokenizer DIR[:VOCAB] [--tokenizer ...] [--batch 32] [--json OUT]
VOCAB is the model's logits width (default: the tokenizer's length).
"""
import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

for _v in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
    os.environ.setdefault(_v, "false" if _v == "TOKENIZERS_PARALLELISM" else "1")

import torch
import transformers
import llguidance
import llguidance.hf
import llguidance.numpy as llg_np
import llguidance.torch as llg_torch
import xgrammar as xgr

torch.set_num_threads(1)
S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def obj(required, **props):
    return {"type": "object", "properties": props, "required": required}


SMALL = obj(["name", "age", "tags"], name=S, age=I, tags={"type": "array", "items": S})
LARGE = obj(["name", "arguments"], name={"enum": ["get_weather", "search_hotels", "book_hotel"]}, arguments=obj(
    ["location", "dates", "guests", "room_type", "budget"],
    location=obj(["city", "country"], city=S, country={"type": "string", "minLength": 2, "maxLength": 2}, lat=N, lon=N),
    dates=obj(["start", "end"], start={"type": "string", "format": "date"}, end={"type": "string", "format": "date"}),
    guests={"type": "integer", "minimum": 1, "maximum": 10}, room_type={"enum": ["single", "double", "suite"]},
    amenities={"type": "array", "items": {"enum": ["wifi", "pool", "gym", "parking"]}},
    budget=obj(["currency", "max_per_night"], currency={"enum": ["USD", "EUR", "GBP"]},
               max_per_night={"type": "number", "minimum": 0}),
    notes={"anyOf": [S, {"type": "null"}]}, loyalty_id={"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
    flexible={"type": "boolean"}, contacts={"type": "array", "minItems": 1, "maxItems": 3, "items": obj(
        ["name", "email"], name=S, email={"type": "string", "format": "email"}, phone=S)}))
for _o in (SMALL, LARGE, LARGE["properties"]["arguments"]):
    _o["additionalProperties"] = False
SMALL_DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}
LARGE_DOC = {"name": "book_hotel", "arguments": {
    "location": {"city": "Lisbon", "country": "PT", "lat": 38.7223, "lon": -9.1393},
    "dates": {"start": "2025-06-01", "end": "2025-06-05"}, "guests": 2, "room_type": "double",
    "amenities": ["wifi", "pool"], "budget": {"currency": "EUR", "max_per_night": 180.5},
    "notes": "Late check-in, around 11pm.", "loyalty_id": "AB123456", "flexible": False,
    "contacts": [{"name": "Jo Smith", "email": "jo@example.com", "phone": "+351 555 0100"}]}}
REGEX, CHOICES = r"\d{3}-\d{4}", ["positive", "negative", "neutral"]
GBNF = 'root ::= "answer: " verdict " because " reason "."\nverdict ::= "yes" | "no"\nreason ::= [a-z ]+\n'
LARK = 'start: "answer: " verdict " because " REASON "."\nverdict: "yes" | "no"\nREASON: /[a-z ]+/\n'
CASES = {"small_schema": ("schema", SMALL), "large_schema": ("schema", LARGE), "json_object": ("any_json", None),
         "regex": ("regex", REGEX), "choice": ("choice", CHOICES), "gbnf": ("gbnf", GBNF), "lark": ("lark", LARK)}
DOCS = {"small_schema": SMALL_DOC, "large_schema": LARGE_DOC, "json_object": LARGE_DOC}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab):
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)

    def compile(self, kind, spec):
        c = self.compiler
        return {"schema": lambda: c.compile_json_schema(json.dumps(spec)),
                "any_json": lambda: c.compile_json_schema('{"type": "object"}'),  # like OpenAI json_object
                "regex": lambda: c.compile_regex(spec),  # no choice API: EBNF alternation of literals
                "choice": lambda: c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec)),
                "gbnf": lambda: c.compile_grammar(spec),  # GBNF is xgrammar's native EBNF
                "lark": lambda: c.compile_grammar(xgr.Grammar.from_lark(spec))}[kind]()

    def cached(self, kind, spec, _compiled):  # same input again: a compiler-cache hit
        return self.compile(kind, spec)

    def clear(self):
        self.compiler.clear_cache()

    matcher = staticmethod(xgr.GrammarMatcher)
    fill = staticmethod(lambda m, bitmask, row: m.fill_next_token_bitmask(bitmask, row))
    accept = staticmethod(lambda m, t: m.accept_token(t))


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab):
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)

    def compile(self, kind, spec):
        if kind in ("schema", "any_json"):
            fmt, text = "json_schema", json.dumps(spec or {"type": "object"})
        else:  # "gbnf" goes through llguidance's GBNF-to-Lark converter; "choice" becomes a Lark alternation
            fmt, text = kind, json.dumps(spec) if kind == "choice" else spec
        m = llguidance.LLMatcher(self.tok, llguidance.grammar_from(fmt, text))
        if m.is_error():  # the constructor does not raise on a bad grammar
            raise RuntimeError(m.get_error())
        return m

    def cached(self, kind, spec, compiled):  # no compile cache: keep a template matcher and copy it
        return compiled.deep_copy()

    clear = staticmethod(lambda: None)
    matcher = staticmethod(lambda compiled: compiled.deep_copy())
    fill = staticmethod(llg_torch.fill_next_token_bitmask)
    accept = staticmethod(lambda m, t: m.consume_token(t))


def ms(ns):
    return round(ns / 1e6, 4)


def timed(fn, *a):
    t0 = time.perf_counter_ns()
    out = fn(*a)
    return out, time.perf_counter_ns() - t0


def allowed(bitmask_row, t):  # bit t%32 of int32 word t//32; bits past the vocab are 0
    return bool((int(bitmask_row[t // 32]) >> (t % 32)) & 1)


def cold_compile(lib, kind, spec, reps=3):
    """Median of `reps` compiles with the library cache cleared before each."""
    times = []
    for _ in range(reps):
        lib.clear()
        compiled, dt = timed(lib.compile, kind, spec)
        times.append(dt)
    return compiled, statistics.median(times)


def step_doc(lib, compiled, ids, vocab, batch, eos):
    """Per-token mask timings (ns) for batch 1 and for `batch` matchers into one bitmask."""
    bm, m, one, steps = xgr.allocate_token_bitmask(batch, vocab), lib.matcher(compiled), [], []
    for t in ids:
        one.append(timed(lib.fill, m, bm, 0)[1])
        assert allowed(bm[0], t) and lib.accept(m, t), f"{lib.name} rejected token {t}"
    lib.fill(m, bm, 0)
    eos_ok = allowed(bm[0], eos)
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    for t in ids:
        t0 = time.perf_counter_ns()
        for i, mi in enumerate(matchers):
            lib.fill(mi, bm, i)
        steps.append(time.perf_counter_ns() - t0)
        assert all(lib.accept(mi, t) for mi in matchers)
    return one, steps, eos_ok


def stats(xs):
    xs = sorted(xs)
    return {"mean_ms": ms(statistics.fmean(xs)), "p99_ms": ms(xs[min(len(xs) - 1, int(0.99 * len(xs)))])}


def probe_tokens(lib, compiled, tok, vocab):
    """Inside a JSON string: count allowed special tokens; are padding rows masked?"""
    bm, m = xgr.allocate_token_bitmask(1, vocab), lib.matcher(compiled)
    for t in tok.encode('{"name": "A', add_special_tokens=False):
        assert lib.accept(m, t)
    lib.fill(m, bm, 0)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
    special -= {tok.eos_token_id}
    pads = range(len(tok), vocab)
    return {"special_allowed_in_string": sum(allowed(bm[0], i) for i in special),
            "special_checked": len(special),
            "pad_rows_masked": None if not pads else not any(allowed(bm[0], i) for i in pads)}


def apply_bench(vocab, batch, bitmask, reps=20):
    """Median time to mask [batch, vocab] float32 logits in place (the logits copy is not timed)."""
    out, ref, logits, shifts = {}, None, torch.randn(batch, vocab), torch.arange(32, dtype=torch.int32)

    def plain(lg, bmk):
        bits = ((bmk.unsqueeze(-1) >> shifts) & 1).reshape(batch, -1)[:, :vocab]
        lg.masked_fill_(bits == 0, float("-inf"))

    np_bitmask = bitmask.numpy()
    impls = {"xgrammar.apply_token_bitmask_inplace(cpu)": (False, lambda lg: xgr.apply_token_bitmask_inplace(lg, bitmask)),
             "llguidance.torch.apply_token_bitmask_inplace": (False, lambda lg: llg_torch.apply_token_bitmask_inplace(lg, bitmask)),
             "llguidance.numpy.apply_token_bitmask_inplace": (True, lambda lg: llg_np.apply_token_bitmask_inplace(lg, np_bitmask)),
             "torch masked_fill (unpack+fill)": (False, lambda lg: plain(lg, bitmask))}
    for name, (use_np, fn) in impls.items():
        fresh = (lambda: logits.numpy().copy()) if use_np else logits.clone
        lg = fresh()
        try:
            _, first = timed(fn, lg)
        except Exception as e:  # e.g. torch.compile without a C compiler
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            continue
        res = torch.as_tensor(lg)
        ref = res if ref is None else ref
        ts = [timed(fn, lg)[1] for lg in [fresh() for _ in range(reps)]]
        out[name] = {"first_ms": ms(first), "median_ms": ms(statistics.median(ts)), "same_as_first": bool(torch.equal(res, ref))}
    return out


def bench(spec, batch):
    tok_dir, _, vocab = spec.partition(":")
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    vocab = int(vocab or len(tok))
    res = {"tokenizer": tok_dir, "tokenizer_len": len(tok), "vocab_size": vocab, "libs": {}}
    for cls in (XGrammar, LLGuidance):
        lib, t_info = timed(cls, tok, vocab)
        r = res["libs"][cls.name] = {"tokenizer_info_ms": ms(t_info), "cases": {}}
        r["warmup_compile_ms"] = ms(timed(lib.compile, "regex", "warm[0-9]+")[1])  # one-time lazy init
        for case, (kind, spec) in CASES.items():
            c = r["cases"][case] = {}
            try:
                compiled, cold = cold_compile(lib, kind, spec)
            except Exception as e:
                c["error"] = f"{type(e).__name__}: {str(e).strip()[:160]}"
                continue
            c["compile_cold_ms"] = ms(cold)
            c["compile_cached_ms"] = ms(timed(lib.cached, kind, spec, compiled)[1])
            bm = xgr.allocate_token_bitmask(1, vocab)
            c["first_mask_ms"] = ms(timed(lib.fill, lib.matcher(compiled), bm, 0)[1])
            if case in DOCS:
                ids = tok.encode(json.dumps(DOCS[case]), add_special_tokens=False)
                one, steps, eos_ok = step_doc(lib, compiled, ids, vocab, batch, tok.eos_token_id)
                c.update(tokens=len(ids), eos_allowed_at_end=eos_ok, mask_b1=stats(one), **{f"mask_b{batch}_step": stats(steps)})
            if case == "small_schema":
                r.update(probe_tokens(lib, compiled, tok, vocab))
    bm = xgr.allocate_token_bitmask(batch, vocab)
    bm[:, 1::3] = 0x0F0F0F0F  # deterministic partially-masked pattern
    res["apply_bitmask"] = apply_bench(vocab, batch, bm)
    return res


def table(all_res, batch):
    lines = []
    for res in all_res:
        lines.append(f"\n== {os.path.basename(res['tokenizer'].rstrip('/'))}  tokenizer_len={res['tokenizer_len']} "
                     f"vocab={res['vocab_size']}")
        for name, r in res["libs"].items():
            lines.append(f"{name}: tokenizer_info {r['tokenizer_info_ms']:.1f} ms, first compile "
                         f"{r['warmup_compile_ms']:.1f} ms, special tokens allowed in JSON string "
                         f"{r['special_allowed_in_string']}/{r['special_checked']}, pad rows masked {r['pad_rows_masked']}")
        lines.append(f"{'case':14} {'lib':11} {'cold':>9} {'cached':>8} {'1st mask':>8} {'tok':>4} "
                     f"{'b1 mean':>8} {'b1 p99':>8} {f'b{batch} mean':>9} {f'b{batch} p99':>9}  (ms)")
        for case in CASES:
            for name, r in res["libs"].items():
                c = r["cases"][case]
                if "error" in c:
                    lines.append(f"{case:14} {name:11} ERROR {c['error'][:70]}")
                    continue
                row = f"{case:14} {name:11} {c['compile_cold_ms']:9.2f} {c['compile_cached_ms']:8.3f} {c['first_mask_ms']:8.3f}"
                if "mask_b1" in c:
                    b, s = c["mask_b1"], c[f"mask_b{batch}_step"]
                    row += f" {c['tokens']:4d} {b['mean_ms']:8.4f} {b['p99_ms']:8.4f} {s['mean_ms']:9.3f} {s['p99_ms']:9.3f}"
                lines.append(row)
        lines.append(f"apply bitmask to float32 logits [{batch}, {res['vocab_size']}] (median ms):")
        for k, v in res["apply_bitmask"].items():
            lines.append(f"  {k:46} " + (v["error"] if "error" in v else f"{v['median_ms']:8.3f}  (first call {v['first_ms']:.1f})"))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", action="append", required=True, metavar="DIR[:VOCAB]",
                    help="HF tokenizer folder, optionally with the model's logits width (repeatable)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()
    versions = {p: importlib.metadata.version(p) for p in ("llguidance", "xgrammar", "torch", "transformers", "numpy")}
    all_res = [bench(d, a.batch) for d in a.tokenizer]
    print("versions:", versions, "python", platform.python_version(), "threads: 1")
    print(table(all_res, a.batch))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"versions": versions, "python": sys.version.split()[0], "machine": platform.machine(),
                       "batch": a.batch, "results": all_res}, f, indent=1)


if __name__ == "__main__":
    main()
