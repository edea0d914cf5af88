// The dashboard: reads /dashboard/events (server-sent events through fetch, so the API key can go in a
// header), keeps the recent steps and requests, and redraws on every snapshot, which arrive every
// "refresh" seconds (the header's choice, 5 s unless changed; kept in localStorage). Drawing waits for
// the browser's next frame, so a page in a hidden tab draws nothing until it is shown again.
// A dropped file replaces the live view until "back to live". window.phasewise exposes the state and
// what the last frame drew, for the browser tests.
"use strict";

const WINDOW_S = 30, MAX_STEPS = 4000, MAX_FINISHED = 300;
const $ = (id) => document.getElementById(id);
const fmt = (v, d = 1) => (v === null || v === undefined || !isFinite(v) ? "–" : Number(v).toFixed(d));
const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(0)}%`);

const live = { mode: "live", steps: [], requests: new Map(), engine: null, now: 0, seq: 0, itlLabel: "every gap" };
let view = live, drawn = [], stepBox = null, timelineRows = [], controller = null, pending = false;

// ---- the live feed -------------------------------------------------------------------------------

function setStatus(state, text) { $("status").dataset.state = state; $("status").textContent = text; }

async function connect() {
  const key = sessionStorage.getItem("phasewise-key");
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  let res;
  const mine = controller = new AbortController();       // aborted when the refresh choice changes
  try { res = await fetch(`/dashboard/events?after=${live.seq}&every=${$("refresh").value}`, { headers, signal: mine.signal }); }
  catch (e) { return mine.signal.aborted ? undefined : retry("cannot reach the server"); }
  if (res.status === 401) {
    setStatus("key", "API key needed");
    $("keyform").hidden = false;
    $("keyerror").textContent = key ? "that key was refused" : "";
    return;
  }
  if (!res.ok) return retry(`the server answered ${res.status}`);
  $("keyform").hidden = true;
  Replicas.state.serving = res.headers.get("x-phasewise-replica");       // behind Ray Serve: whose feed this is
  setStatus("live", Replicas.state.serving ? `live · replica ${Replicas.state.serving.split("#").pop()}` : "live");
  if (!Replicas.state.polled) { Replicas.state.polled = true; Replicas.poll(); }
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    let chunk;
    try { chunk = await reader.read(); } catch (e) { if (mine.signal.aborted) return; break; }
    if (chunk.done) break;
    buf += chunk.value;
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) { onEvent(buf.slice(0, cut)); buf = buf.slice(cut + 2); }
  }
  retry("connection lost, retrying");
}

function retry(why) { setStatus("lost", why); setTimeout(connect, 2000); }

function onEvent(block) {
  let kind = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event: ")) kind = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (!data) return;
  const msg = JSON.parse(data);
  if (kind === "hello") { $("model").textContent = `${msg.model} · phasewise ${msg.version}`; return; }
  const idle = !msg.steps.length && !msg.finished.length && !msg.live.length;
  merge(msg);
  // An idle server whose last frame was already empty: skip the redraw (an idle page costs nothing).
  if (view === live && !(idle && live.drawnEmpty)) schedule();
}

// One drawing per browser frame at most, and none while the page is hidden (no frames come).
function schedule() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => { pending = false; render(); });
}

function merge(snap) {
  Object.assign(live, { now: snap.now, seq: snap.seq, engine: snap.engine, latency: snap.latency,
    throughput: snap.throughput, prefix_hit_rate: snap.prefix_hit_rate, binding: snap.binding, roofline: snap.roofline,
    experts: snap.experts });
  live.steps.push(...snap.steps);
  if (live.steps.length > MAX_STEPS) live.steps.splice(0, live.steps.length - MAX_STEPS);
  const liveIds = new Set(snap.live.map((r) => r.id));
  for (const [id, r] of live.requests) if (r.reason === null && !liveIds.has(id)) live.requests.delete(id);
  for (const r of snap.finished) { live.requests.delete(r.id); live.requests.set(r.id, r); }
  for (const r of snap.live) live.requests.set(r.id, r);
  const finished = [...live.requests.values()].filter((r) => r.reason !== null);
  for (const r of finished.slice(0, Math.max(0, finished.length - MAX_FINISHED))) live.requests.delete(r.id);
  live.t1 = snap.now; live.t0 = snap.now - WINDOW_S;
}

// Nothing in the charts' window nor in the latency window: the frame would not change.
function empty(s) {
  const lastStep = s.steps[s.steps.length - 1];
  const lastEnd = Math.max(lastStep ? lastStep.t + lastStep.ms / 1e3 : -Infinity,
    ...[...s.requests.values()].map((r) => r.finished ?? r.last_token ?? r.arrival));
  return lastEnd < s.t0 && Object.values(s.latency || {}).every((v) => !v.n);
}

// ---- drawing -------------------------------------------------------------------------------------

function render() {
  const s = view, isLive = s.mode === "live", ref = isLive ? s.now : s.t0;
  live.drawnEmpty = isLive && empty(s);
  const t0 = s.t0 ?? 0, t1 = s.t1 ?? 1;
  cards(s);
  timeline(s, t0, t1, ref, isLive);
  const steps = s.steps.filter((x) => x.t + x.ms / 1e3 >= t0);
  stepBox = Charts.stepBars($("steps"), { t0, t1, ref, live: isLive, steps, budget: s.engine?.token_budget });
  const last = steps[steps.length - 1];
  setText($("steps-caption"), last ? `last step: ${last.prefill} prefill + ${last.decode} decode tokens` +
    `${last.draft ? ` (${last.accepted}/${last.draft} drafts accepted)` : ""}, batch ${last.batch}, ${fmt(last.ms)} ms` +
    `${last.grammar_ms ? ` (grammar masks ${fmt(last.grammar_ms)} ms)` : ""}${threads(last)}` +
    `${last.experts_read !== undefined ? `, ${last.experts_read} experts read` : ""}` +
    ` · ${steps.length} steps shown` : "no steps yet");
  kv(s, steps, t0, t1, ref, isLive);
  latency(s);
  binding(s);
  experts(s);
}

// A mixture of experts: how the last seconds' steps spread their rows over each layer's experts.
function experts(s) {
  const e = s.experts, panel = $("experts-panel");
  panel.hidden = !e;
  if (!e) return;
  Charts.heatmap($("experts"), e.share);
  setText($("experts-caption"), `${e.steps} steps in the last 5 s read ${fmt(e.read_mean, 0)} of ${e.layers * e.experts} ` +
    `experts a step (at most ${e.read_max}); darker: more of a layer's choices than an even spread`);
}

function cards(s) {
  const e = s.engine, t = s.throughput || {}, l = s.latency || {};
  const items = [
    ["running", e ? e.running : "–", e ? `of ${e.max_num_seqs} seats` : s.name],
    ["waiting", e ? e.waiting : "–", "in the queue"],
    ["kv", e ? e.used : "–", e ? `of ${e.blocks} KV blocks in use` : "KV blocks in use"],
    ["prompt", fmt(t.prompt_tok_s, 0), "prompt tokens/s"],
    ["output", fmt(t.output_tok_s, 0), "output tokens/s"],
    ["busy", pct(t.busy), "of the time stepping"],
    ["hits", pct(s.prefix_hit_rate), "prompt tokens from the prefix cache"],
    ["ttft", fmt(l.ttft_ms?.p50, 0), "TTFT p50, ms"],
  ];
  const box = $("cards");
  if (box.children.length !== items.length) {
    box.innerHTML = items.map(([k]) => `<div class="card" data-card="${k}"><b></b><span></span></div>`).join("");
  }
  items.forEach(([, v, label], i) => { setText(box.children[i].firstChild, v); setText(box.children[i].lastChild, label); });
}

// Touch the DOM only when the text changes: every write costs the browser a layout.
function setText(el, text) { text = String(text); if (el.textContent !== text) el.textContent = text; }
function setHTML(el, html) { if (el.lastHTML !== html) { el.innerHTML = html; el.lastHTML = html; } }

function state(r) {
  if (r.reason !== null || r.done) return "finished";      // files: done, the reason unknown
  if (r.first_token !== null) return "decode";
  return r.chunks.length ? "prefill" : "queued";
}

function timeline(s, t0, t1, ref, isLive) {
  const canvas = $("timeline"), { ctx, w, h } = Charts.setup(canvas);
  const all = [...s.requests.values()].filter((r) => (r.finished ?? r.last_token ?? t1) >= t0 || r.reason === null);
  all.sort((a, b) => a.arrival - b.arrival);
  const box = Charts.frame(w, h, t0, t1, 1, 10);
  const rowH = Math.max(5, Math.min(16, box.h / Math.max(all.length, 1)));
  const rows = all.slice(-Math.floor(box.h / rowH));
  Charts.timeAxis(ctx, box, t0, t1, ref, isLive);
  const c = (n) => Charts.css(n), x = (t) => Math.min(box.x + box.w, Math.max(box.x, box.x_of(t)));
  const bar = (a, b, y, color) => { ctx.fillStyle = color; ctx.fillRect(x(a), y, Math.max(1, x(b) - x(a)), rowH - 2); };
  drawn = [];
  rows.forEach((r, i) => {
    const y = box.y + i * rowH, now = isLive ? t1 : r.finished ?? r.last_token ?? t1;
    const firstWork = r.chunks.length ? r.chunks[0][0] : r.scheduled;
    bar(r.arrival, firstWork ?? (r.reason === null && !r.done ? now : r.finished ?? now), y, c("--queued"));
    for (const [a, b] of r.chunks) bar(a, b, y, c("--prefill"));
    const ended = r.reason !== null || r.done;
    if (r.first_token !== null) {             // a reply that thought: the thinking phase, then the answer
      const end = ended ? r.last_token ?? r.first_token : now;
      const answer = r.thinking_tokens ? r.answer_at ?? end : r.first_token;
      if (answer > r.first_token) bar(r.first_token, answer, y, c("--thinking"));
      if (!r.thinking_tokens || r.answer_at != null) bar(answer, end, y, c("--decode"));
    }
    for (const p of r.preempted) bar(p, p + (t1 - t0) / box.w * 2, y, c("--preempt"));
    if (r.reason) { ctx.fillStyle = c(`--${r.reason}`) || c("--ink"); ctx.fillRect(x(r.finished ?? now) - 1, y - 1, 3, rowH); }
    drawn.push({ id: r.id, state: state(r), reason: r.reason });
  });
  timelineRows = rows.map((r, i) => ({ r, y0: box.y + i * rowH, y1: box.y + (i + 1) * rowH }));
  const live = all.filter((r) => r.reason === null).length;
  setText($("timeline-caption"), s.mode === "live" ? `${live} live, ${all.length - live} finished in the last ${WINDOW_S} s`
    : `${s.name}: ${all.length} requests${s.note ? ` · ${s.note}` : ""}`);
}

// ", 2 threads (0.9 CPUs busy elsewhere)": how many threads ran a step, and what other programs took.
function threads(step) {
  if (!step.threads) return "";
  const others = step.others >= 0.1 ? ` (${fmt(step.others, 1)} CPUs busy elsewhere)` : "";
  return `, ${step.threads} thread${step.threads > 1 ? "s" : ""}${others}`;
}

function kv(s, steps, t0, t1, ref, isLive) {
  const e = s.engine, series = [];
  if (steps.length && steps[0].used !== undefined) {
    const tail = e ? [[t1, e.used, e.cached, e.free]] : [];
    const pts = steps.map((x) => [x.t + x.ms / 1e3, x.used, x.cached, x.free]).concat(tail);
    series.push({ color: Charts.css("--decode"), fill: true, points: pts.map((p) => [p[0], p[1]]) });
    series.push({ color: Charts.css("--cached"), points: pts.map((p) => [p[0], p[2]]) });
    series.push({ color: Charts.css("--stop"), points: pts.map((p) => [p[0], p[3]]) });
  }
  Charts.lines($("kv"), { t0, t1, ref, live: isLive, ymax: e ? e.blocks : 1, series, sqrt: true });
  setHTML($("kv-caption"), e ? `<b style="color:var(--decode)">in use ${e.used}</b> · <b style="color:var(--cached)">` +
    `cached ${e.cached}</b> · <b style="color:var(--stop)">free ${e.free}</b> of ${e.blocks} blocks` +
    ` · prefix hit rate ${pct(s.prefix_hit_rate)}` + (e.state_slots ? ` · recurrent state: ${e.state_used} of ` +
    `${e.state_slots} slots in use, ${e.checkpoints} checkpoints` : "") : "this file holds no KV-cache figures");
}

function latency(s) {
  const table = $("latency");
  if (s.table) {
    setHTML(table, `<tr><th></th>${s.table.cols.map((c) => `<th>${c}</th>`).join("")}</tr>` +
      s.table.rows.map((r) => `<tr><td>${r[0]}</td>${r.slice(1).map((v) => `<td>${fmt(v)}</td>`).join("")}</tr>`).join(""));
    setText($("latency-caption"), s.name);
    return;
  }
  const l = s.latency || {}, names = { ttft_ms: "TTFT", itl_ms: `ITL (${s.itlLabel})`, e2e_ms: "end to end" };
  // The rows are built once per kind of view; a new snapshot rewrites only the cells that changed.
  setHTML(table, "<tr><th>ms</th><th>p50</th><th>p90</th><th>p99</th><th>samples</th></tr>" +
    Object.entries(names).map(([k, label]) => `<tr data-metric="${k}"><td>${label}</td><td></td><td></td><td></td><td></td></tr>`).join(""));
  for (const k of Object.keys(names)) {
    const v = l[k] || {}, cells = table.querySelector(`tr[data-metric="${k}"]`).children;
    [fmt(v.p50), fmt(v.p90), fmt(v.p99), v.n ?? 0].forEach((text, i) => setText(cells[i + 1], text));
  }
  setText($("latency-caption"), s.mode === "live" ? `the last ${s.window_s ?? 60} s` : s.name);
}

function binding(s) {
  const b = s.binding || { kinds: {} }, roof = s.roofline, out = [];
  const kinds = Object.entries(b.kinds);
  if (!kinds.length) { setHTML($("binding"), `<p class="muted">no steps ${s.mode === "live" ? "in the last 5 s" : "in this file"}</p>`); return; }
  if (b.dominant) {
    const d = b.kinds[b.dominant];
    const verdict = !d.binds ? "." : d.binds === "neither roof"
      ? `; they are near <b>neither roof</b> (${pct(Math.max(d.bandwidth_share, d.compute_share))} at most): the time goes to ` +
        "what the roofs leave out (attention, sampling, the Python between kernels)."
      : `; they are bound by <b>${d.binds}</b>.`;
    out.push(`<p class="verdict" data-binds="${d.binds ?? ""}">Now: ${b.dominant} steps take ${pct(d.time_share)} of the stepping time${verdict}</p>`);
  }
  for (const [kind, k] of kinds) {
    let lines = `<b>${kind}</b>: ${k.steps} steps, ${pct(k.time_share)} of the time, ${fmt(k.tokens_per_s, 0)} tokens/s`;
    if (k.binds) {
      const row = (label, share, color) => `<div>${label}</div><div class="bar"><div style="width:${Math.min(100, 100 * share)}%;background:${color}"></div></div>`;
      lines += row(`weights read: ${fmt(k.gbs)} GB/s, ${pct(k.bandwidth_share)} of ${fmt(roof.dram_gbs)} GB/s DRAM`, k.bandwidth_share, Charts.css("--decode"));
      lines += row(`compute: ${fmt(k.gops, 0)} GOP/s, ${pct(k.compute_share)} of ${fmt(roof.compute_gops, 0)} GOP/s (${roof.compute_name})`, k.compute_share, Charts.css("--prefill"));
    }
    out.push(`<div class="bind">${lines}</div>`);
  }
  if (!roof) out.push(`<p class="muted">${s.mode === "live" ? "This machine's roofs are not measured: run <code>phasewise roofline --model …</code> once, then restart the server." : "A file holds no roofs: shares of time and tokens/s only."}</p>`);
  else out.push(`<p class="muted">Weights are read once a step; attention and the KV cache are not counted.</p>`);
  setHTML($("binding"), out.join(""));
}

// ---- hover, files, key -----------------------------------------------------------------------

function tooltip(ev, text) {
  const tip = $("tooltip");
  if (!text) { tip.hidden = true; return; }
  tip.textContent = text; tip.hidden = false;
  tip.style.left = `${ev.clientX + 14}px`; tip.style.top = `${ev.clientY + 10}px`;
}

$("timeline").addEventListener("mousemove", (ev) => {
  const y = ev.offsetY, row = timelineRows.find((x) => y >= x.y0 && y < x.y1);
  if (!row) return tooltip(ev, null);
  const r = row.r;
  tooltip(ev, [`${r.id}  (${r.reason ?? state(r)})`, `prompt ${r.prompt_tokens} tokens` + (r.cached_tokens ? `, ${r.cached_tokens} cached` : ""),
    `${r.chunks.length} prefill chunk(s), ${r.tokens} output tokens`, `TTFT ${fmt(r.ttft_ms)} ms`,
    ...(r.thinking_tokens ? [`thinking: ${r.thinking_tokens} tokens, first answer token at ` +
      (r.ttfa_ms != null ? `${fmt(r.ttfa_ms)} ms` : "none yet")] : []),
    `ITL mean ${fmt(r.itl_mean_ms)} ms, max ${fmt(r.itl_max_ms)} ms`,
    ...(r.preempted.length ? [`preempted ${r.preempted.length}×`] : []),
    ...(r.grammar_compile_ms != null ? [`structured output: grammar ready in ${fmt(r.grammar_compile_ms)} ms`] : [])
  ].join("\n"));
});
$("steps").addEventListener("mousemove", (ev) => {
  if (!stepBox) return;
  const t = stepBox.t_of(ev.offsetX), s = view.steps.find((x) => t >= x.t && t <= x.t + x.ms / 1e3);
  tooltip(ev, s && `${s.prefill} prefill + ${s.decode} decode tokens, batch ${s.batch}\n${fmt(s.ms)} ms` +
    (s.draft ? `\ndrafts ${s.accepted}/${s.draft} accepted` : "") +
    (s.grammar_ms ? `\ngrammar masks ${fmt(s.grammar_ms)} ms` : "") + (s.threads ? `\n${threads(s).slice(2)}` : ""));
});
for (const id of ["timeline", "steps"]) $(id).addEventListener("mouseleave", (ev) => tooltip(ev, null));

function openFile(file) {
  file.text().then((text) => {
    view = Files.load(file.name, text);
    $("live").hidden = false;
    setStatus("file", `viewing ${file.name}`);
    schedule();
  }).catch((e) => { setStatus("lost", e.message); });
}

addEventListener("dragover", (ev) => { ev.preventDefault(); $("drop").hidden = false; });
addEventListener("dragleave", (ev) => { if (!ev.relatedTarget) $("drop").hidden = true; });
addEventListener("drop", (ev) => {
  ev.preventDefault(); $("drop").hidden = true;
  if (ev.dataTransfer.files.length) openFile(ev.dataTransfer.files[0]);
});
$("live").addEventListener("click", () => { view = live; $("live").hidden = true; setStatus("live", "live"); schedule(); });
$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("phasewise-key", $("key").value.trim());
  connect();
});
for (const id of ["timeline", "steps", "kv"]) $(id).onresized = schedule;
$("refresh").value = localStorage.getItem("phasewise-refresh") || "5";
$("refresh").addEventListener("change", () => {
  localStorage.setItem("phasewise-refresh", $("refresh").value);
  controller?.abort();
  connect();
});

window.phasewise = { live, view: () => view, bars: () => drawn, openText: (name, text) => openFile(new File([text], name)) };
connect();
