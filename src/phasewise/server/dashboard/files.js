// Saved runs opened by dropping a file: a Chrome/Perfetto trace (phasewise's --trace), an experiment's
// results.json (rows of per-request timings) or `phasewise bench serve`'s results.json (summaries).
// Each becomes the same store the live feed fills, so the page draws it the same way.
"use strict";

const Files = (() => {
  function percentile(values, q) {        // linear interpolation, as phasewise/report.py's percentile
    if (!values.length) return 0;
    const s = [...values].sort((a, b) => a - b), pos = (s.length - 1) * q / 100, lo = Math.floor(pos);
    const hi = Math.min(lo + 1, s.length - 1);
    return s[lo] + (s[hi] - s[lo]) * (pos - lo);
  }

  const stats = (v) => ({ n: v.length, p50: percentile(v, 50), p90: percentile(v, 90), p99: percentile(v, 99) });

  // The figures the live feed computes on the server, from what a file holds.
  function summarise(store, itlLabel) {
    const reqs = [...store.requests.values()];
    const pick = (f) => reqs.map(f).filter((v) => v !== null && v !== undefined && isFinite(v));
    store.latency = {
      ttft_ms: stats(pick((r) => r.ttft_ms)), itl_ms: stats(pick((r) => r.itl_mean_ms)),
      e2e_ms: stats(pick((r) => (r.finished !== null ? (r.finished - r.arrival) * 1e3 : null))),
    };
    store.itlLabel = itlLabel;
    const steps = store.steps, kinds = {};
    const total = steps.reduce((a, s) => a + s.ms, 0);
    for (const kind of ["prefill", "decode"]) {
      const g = steps.filter((s) => (s.prefill > 0) === (kind === "prefill"));
      const secs = g.reduce((a, s) => a + s.ms, 0) / 1e3;
      if (g.length && secs > 0) {
        kinds[kind] = { steps: g.length, time_share: (secs * 1e3) / total,
                        tokens_per_s: g.reduce((a, s) => a + s.prefill + s.decode + s.draft, 0) / secs };
      }
    }
    store.binding = { kinds };
    if (Object.keys(kinds).length) store.binding.dominant = Object.keys(kinds).sort((a, b) => kinds[b].time_share - kinds[a].time_share)[0];
    const span = steps.length ? steps[steps.length - 1].t + steps[steps.length - 1].ms / 1e3 - steps[0].t : 0;
    store.throughput = span > 0 ? {
      prompt_tok_s: steps.reduce((a, s) => a + s.prefill, 0) / span,
      output_tok_s: steps.reduce((a, s) => a + s.decode + s.accepted, 0) / span,
      busy: total / 1e3 / span } : null;
    const prompt = reqs.reduce((a, r) => a + (r.prompt_tokens || 0), 0);
    store.prefix_hit_rate = prompt ? reqs.reduce((a, r) => a + (r.cached_tokens || 0), 0) / prompt : null;
    const ends = reqs.map((r) => r.finished ?? r.last_token ?? r.arrival).concat(steps.map((s) => s.t + s.ms / 1e3));
    const starts = reqs.map((r) => r.arrival).concat(steps.map((s) => s.t));
    store.t0 = Math.min(...starts); store.t1 = Math.max(...ends);
    return store;
  }

  function emptyStore(name, kind) {
    return { mode: "file", name, kind, steps: [], requests: new Map(), engine: null, roofline: null, table: null };
  }

  function fromTrace(name, doc) {
    const store = emptyStore(name, "trace"), names = {}, byTid = {};
    for (const e of doc.traceEvents) {
      if (e.ph === "M" && e.name === "thread_name" && e.pid === 2) names[e.tid] = e.args.name;
    }
    for (const e of doc.traceEvents) {
      const t = e.ts / 1e6, end = (e.ts + (e.dur || 0)) / 1e6, a = e.args || {};
      if (e.pid === 1 && e.ph === "X") {
        store.steps.push({ t, ms: e.dur / 1e3, prefill: a.prefill_tokens || 0, decode: a.decode_tokens || 0,
                           batch: a.batch_size || 0, draft: a.draft_tokens || 0, accepted: a.accepted_tokens || 0,
                           grammar_ms: a.grammar_ms || 0, threads: a.threads || 0 });
      } else if (e.pid === 2 && (e.ph === "X" || e.ph === "i")) {
        const r = byTid[e.tid] ??= { id: names[e.tid] || `request ${e.tid}`, arrival: null, scheduled: null, chunks: [],
          first_token: null, last_token: null, tokens: 0, preempted: [], finished: null, reason: null,
          prompt_tokens: 0, cached_tokens: 0 };
        if (e.name === "queued") { r.arrival = t; r.scheduled = end; }
        else if (e.name === "prefill chunk") { r.chunks.push([t, end, a.tokens || 0]); r.prompt_tokens += a.tokens || 0; }
        else if (e.name === "decode") { r.first_token = t; r.last_token = end; r.tokens = (a.tokens || 0) + 1; }
        else if (e.name === "preempted") r.preempted.push(t);
      }
    }
    for (const r of Object.values(byTid)) {
      const chunkEnd = r.chunks.length ? Math.max(...r.chunks.map((c) => c[1])) : null;
      r.arrival ??= r.chunks.length ? r.chunks[0][0] : r.first_token;
      r.first_token ??= chunkEnd; r.last_token ??= r.first_token;
      r.finished = r.last_token; r.done = true;
      r.ttft_ms = r.first_token !== null ? (r.first_token - r.arrival) * 1e3 : null;
      r.itl_mean_ms = r.tokens > 1 ? ((r.last_token - r.first_token) * 1e3) / (r.tokens - 1) : null;
      store.requests.set(r.id, r);
    }
    store.steps.sort((a, b) => a.t - b.t);
    return summarise(store, "mean per request");
  }

  function fromExperiment(name, doc) {
    const store = emptyStore(name, "experiment");
    const keys = Object.keys(doc.rows[0] || {});
    const label = keys.find((k) => /_len$|concurrency|^prompt_tokens$/.test(k)) || keys[0];
    doc.rows.forEach((row, i) => {
      const q = (row.queue_ms || 0) / 1e3, ft = (row.ttft_ms || 0) / 1e3, e2e = (row.e2e_ms || 0) / 1e3;
      const r = { id: `${label} ${row[label]}${"run" in row ? ` · run ${row.run}` : ""} (#${i + 1})`, arrival: 0,
        scheduled: q, chunks: [[q, ft, row.prompt_tokens || 0]], first_token: ft,
        last_token: ft + (row.decode_ms || 0) / 1e3, tokens: row.output_tokens || 0, preempted: [], finished: e2e,
        reason: null, done: true, prompt_tokens: row.prompt_tokens || 0, cached_tokens: row.cached_tokens || 0,
        ttft_ms: row.ttft_ms, itl_mean_ms: row.ms_per_output_token ?? row.itl_median_ms ?? null,
        itl_max_ms: row.itl_p90_ms ?? null, preemptions: row.preemptions || 0 };
      store.requests.set(r.id, r);
    });
    store.note = `${doc.experiment}: every request drawn from its own start (the rows hold durations, not times)`;
    return summarise(store, "per request");
  }

  function fromBench(name, doc) {
    const store = emptyStore(name, "bench");
    const cols = doc.runs.map((r) => `c=${r.max_concurrency ?? "all"}`);
    const rows = [];
    for (const m of ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"]) {
      for (const q of ["median", "p90", "p99"]) rows.push([`${m.slice(0, -3).toUpperCase()} ${q} ms`, ...doc.runs.map((r) => r[m]?.[q])]);
    }
    rows.push(["output tok/s", ...doc.runs.map((r) => r.output_token_throughput)]);
    store.table = { cols, rows };
    store.note = `${doc.target?.model ?? ""} at ${doc.target?.base_url ?? "?"}: summaries only (no per-request times)`;
    return summarise(store, "");
  }

  // Which kind of file this is, or an Error naming what was expected.
  function load(name, text) {
    let doc;
    try { doc = JSON.parse(text); } catch (e) { throw new Error(`${name} is not JSON: ${e.message}`); }
    if (doc && Array.isArray(doc.traceEvents)) return fromTrace(name, doc);
    if (doc && Array.isArray(doc.rows) && doc.rows.length) return fromExperiment(name, doc);
    if (doc && Array.isArray(doc.runs)) return fromBench(name, doc);
    throw new Error(`${name}: not a phasewise trace (traceEvents) or results.json (rows or runs)`);
  }

  return { load };
})();
