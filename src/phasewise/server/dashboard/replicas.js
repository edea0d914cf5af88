// The replicas of a Ray Serve deployment (`phasewise serve --ray`). Its /metrics answers for every replica,
// each sample labelled replica="<Serve replica id>" (deploy/replica_metrics.py); this panel reads that
// text every refresh period and shows one row per replica: requests running and waiting, KV cache in use,
// output and prompt tokens/s since the last read, and the share of prompt tokens from the prefix cache.
// The row of the replica whose feed this page shows (the events' x-phasewise-replica header) is marked.
// On a single server /metrics has no replica label: the panel stays hidden and the page stops asking.
"use strict";

const Replicas = (() => {
  const SAMPLE = /^(phasewise:[a-z_]+)\{replica="([^"]+)"[^}]*\} (\S+)$/;
  let last = null, timer = null;
  const state = { serving: null, rows: [], polled: false };   // polled: the first read asked

  // Prometheus text -> Map(replica -> {metric name: value summed over the other labels})
  function parse(text) {
    const out = new Map();
    for (const line of text.split("\n")) {
      const m = SAMPLE.exec(line);
      if (!m) continue;
      const row = out.get(m[2]) ?? out.set(m[2], {}).get(m[2]);
      row[m[1]] = (row[m[1]] ?? 0) + Number(m[3]);
    }
    return out;
  }

  function rows(now, seen) {
    const dt = last ? (now - last.at) / 1e3 : 0;
    const rate = (id, name) => {
      const before = last?.seen.get(id)?.[name];
      return dt > 0 && before !== undefined ? ((seen.get(id)[name] ?? 0) - before) / dt : null;
    };
    return [...seen.keys()].sort().map((id) => {
      const m = seen.get(id), prompt = m["phasewise:prompt_tokens_total"] ?? 0;
      return {
        id, running: m["phasewise:num_requests_running"] ?? 0, waiting: m["phasewise:num_requests_waiting"] ?? 0,
        kv: m["phasewise:kv_cache_usage_perc"] ?? null,
        output_tok_s: rate(id, "phasewise:generation_tokens_total"), prompt_tok_s: rate(id, "phasewise:prompt_tokens_total"),
        cached: prompt > 0 ? (m["phasewise:prefix_cache_hit_tokens_total"] ?? 0) / prompt : null,
      };
    });
  }

  function draw() {
    const short = (id) => id.split("#").pop();
    const head = "<tr><th>replica</th><th>running</th><th>waiting</th><th>KV in use</th><th>output tok/s</th>" +
      "<th>prompt tok/s</th><th>from cache</th></tr>";
    const body = state.rows.map((r) => `<tr data-replica="${short(r.id)}"><td>${short(r.id)}` +
      `${r.id === state.serving ? " <small class=\"muted\">(this feed)</small>" : ""}</td><td>${r.running}</td>` +
      `<td>${r.waiting}</td><td>${pct(r.kv)}</td><td>${fmt(r.output_tok_s, 0)}</td><td>${fmt(r.prompt_tok_s, 0)}</td>` +
      `<td>${pct(r.cached)}</td></tr>`).join("");
    $("replicas").innerHTML = head + body;
    $("replicas-caption").textContent = `${state.rows.length} replicas, from /metrics`;
    $("replicas-panel").hidden = false;
  }

  async function poll() {
    const key = sessionStorage.getItem("phasewise-key");
    let res;
    try { res = await fetch("/metrics", { headers: key ? { Authorization: `Bearer ${key}` } : {} }); }
    catch (e) { return later(); }
    if (!res.ok) return later();
    const seen = parse(await res.text()), now = performance.now();
    if (!seen.size) { $("replicas-panel").hidden = true; return; }     // one server: nothing to show
    state.rows = rows(now, seen);
    last = { at: now, seen };
    draw();
    later();
  }

  function later() { clearTimeout(timer); timer = setTimeout(poll, 1000 * Math.max(2, Number($("refresh").value))); }

  return { poll, state };
})();
