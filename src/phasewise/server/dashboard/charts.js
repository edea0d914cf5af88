// Plain canvas charts for the dashboard: a time axis, line/area series, stacked step bars.
"use strict";

const Charts = (() => {
  // The theme's colours, read once (each getComputedStyle can force a style recalculation).
  const colours = {};
  const css = (name) => (colours[name] ??= getComputedStyle(document.documentElement).getPropertyValue(name).trim());

  // Size the canvas to its box at the device's pixel ratio (its backing store is only reallocated when
  // that changes); returns a context in CSS pixels, filled with the panel's colour. The box's width is
  // kept by a ResizeObserver: reading clientWidth after the page's text changed would force a layout
  // every frame. The canvas is opaque (cheaper to composite).
  function setup(canvas) {
    const dpr = window.devicePixelRatio || 1;
    if (canvas.plotWidth === undefined) {
      canvas.plotHeight = Number(canvas.getAttribute("height")) || 200;
      canvas.plotWidth = canvas.clientWidth || 600;
      new ResizeObserver((entries) => {
        const width = Math.round(entries[0].contentRect.width);
        if (width && width !== canvas.plotWidth) { canvas.plotWidth = width; canvas.onresized?.(); }
      }).observe(canvas);
    }
    const w = canvas.plotWidth, h = canvas.plotHeight;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
      canvas.style.height = h + "px";
    }
    const ctx = canvas.getContext("2d", { alpha: false });
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = css("--panel"); ctx.fillRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }

  // Plot area inside margins, and the maps from time and value to pixels. A square-root value scale
  // keeps a handful of decode tokens visible under a budget of hundreds (and a few KV blocks of a pool).
  function frame(w, h, t0, t1, ymax, left = 44, sqrt = false) {
    const box = { x: left, y: 8, w: w - left - 10, h: h - 30, sqrt };
    const span = Math.max(t1 - t0, 1e-6), f = sqrt ? Math.sqrt : (v) => v;
    box.x_of = (t) => box.x + ((t - t0) / span) * box.w;
    box.y_of = (v) => box.y + box.h - (f(Math.max(0, Math.min(v, ymax))) / f(Math.max(ymax, 1e-9))) * box.h;
    box.t_of = (x) => t0 + ((x - box.x) / box.w) * span;
    return box;
  }

  function niceStep(span, n) {
    const raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  }

  // Time ticks along the bottom: seconds relative to `ref` (live: "-10 s"; files: from the start).
  function timeAxis(ctx, box, t0, t1, ref, live) {
    ctx.fillStyle = css("--muted"); ctx.strokeStyle = css("--grid"); ctx.textAlign = "center";
    const step = niceStep(t1 - t0, 6);
    for (let s = Math.ceil((t0 - ref) / step) * step; ref + s <= t1 + 1e-9; s += step) {
      const x = box.x_of(ref + s);
      ctx.beginPath(); ctx.moveTo(x, box.y); ctx.lineTo(x, box.y + box.h); ctx.stroke();
      const label = Math.abs(s) < 1e-9 ? (live ? "now" : "0 s") : `${+s.toFixed(2)} s`;
      ctx.fillText(label, x, box.y + box.h + 14);
    }
  }

  function valueAxis(ctx, box, ymax, fmt = (v) => `${v}`) {
    ctx.fillStyle = css("--muted"); ctx.strokeStyle = css("--grid"); ctx.textAlign = "right";
    const step = niceStep(ymax || 1, 4), ticks = [];
    if (box.sqrt) {
      for (let m = 1; m <= ymax; m *= 10) ticks.push(...[m, 2 * m, 5 * m].filter((v) => v <= ymax));
      ticks.unshift(0);
    } else for (let v = 0; v <= ymax + 1e-9; v += step) ticks.push(v);
    let lastY = Infinity;
    for (const v of ticks) {
      const y = box.y_of(v);
      if (lastY - y < 14) continue;
      lastY = y;
      ctx.beginPath(); ctx.moveTo(box.x, y); ctx.lineTo(box.x + box.w, y); ctx.stroke();
      ctx.fillText(fmt(+v.toFixed(6)), box.x - 4, y + 4);
    }
  }

  // series: [{color, points: [[t, v]], fill}] as steps (each value holds until the next).
  function lines(canvas, { t0, t1, ref, live, ymax, series, fmt, sqrt }) {
    const { ctx, w, h } = setup(canvas);
    const box = frame(w, h, t0, t1, ymax, 44, sqrt);
    valueAxis(ctx, box, ymax, fmt);
    timeAxis(ctx, box, t0, t1, ref, live);
    for (const s of series) {
      if (!s.points.length) continue;
      ctx.beginPath();
      let last = null, lastX = -1;
      for (const [t, v] of s.points) {
        // Several points in one pixel column draw as one: the column's last value.
        const x = Math.round(Math.max(box.x, box.x_of(t))), y = box.y_of(v);
        if (last === null) ctx.moveTo(x, y);
        else if (x === lastX) { last = y; continue; }
        else { ctx.lineTo(lastX, last); ctx.lineTo(x, last); }
        lastX = x; last = y;
      }
      ctx.lineTo(lastX, last);
      ctx.lineTo(box.x_of(t1), last);
      ctx.strokeStyle = s.color; ctx.lineWidth = 2; ctx.stroke(); ctx.lineWidth = 1;
      if (s.fill) {
        ctx.lineTo(box.x_of(t1), box.y_of(0)); ctx.lineTo(Math.max(box.x, box.x_of(s.points[0][0])), box.y_of(0));
        ctx.globalAlpha = 0.15; ctx.fillStyle = s.color; ctx.fill(); ctx.globalAlpha = 1;
      }
    }
    return box;
  }

  // One bar per step, as wide as the step took: prefill tokens under decode tokens, budget dashed.
  function stepBars(canvas, { t0, t1, ref, live, steps, budget }) {
    const { ctx, w, h } = setup(canvas);
    const top = Math.max(budget || 0, ...steps.map((s) => s.prefill + s.decode + s.draft), 1);
    const box = frame(w, h, t0, t1, top, 44, true);
    valueAxis(ctx, box, top);
    timeAxis(ctx, box, t0, t1, ref, live);
    // Steps narrower than a pixel share their column: it shows the tallest of them.
    const cols = [];
    for (const s of steps) {
      if (s.t + s.ms / 1e3 < t0) continue;
      const x0 = Math.floor(box.x_of(Math.max(s.t, t0))), x1 = Math.max(x0 + 1, Math.round(box.x_of(s.t + s.ms / 1e3)));
      const c = cols[cols.length - 1], pre = s.prefill, all = s.prefill + s.decode + s.draft;
      if (c && c.x0 === x0) { c.x1 = Math.max(c.x1, x1); c.pre = Math.max(c.pre, pre); c.all = Math.max(c.all, all); }
      else cols.push({ x0, x1, pre, all });
    }
    const base = box.y_of(0);
    ctx.fillStyle = css("--prefill");
    for (const c of cols) if (c.pre) ctx.fillRect(c.x0, box.y_of(c.pre), c.x1 - c.x0, base - box.y_of(c.pre));
    ctx.fillStyle = css("--decode");
    for (const c of cols) {
      const yPre = box.y_of(c.pre), yAll = box.y_of(c.all);
      if (yPre > yAll) ctx.fillRect(c.x0, yAll, c.x1 - c.x0, yPre - yAll);
    }
    if (budget) {
      ctx.setLineDash([5, 4]); ctx.strokeStyle = css("--ink");
      ctx.beginPath(); ctx.moveTo(box.x, box.y_of(budget)); ctx.lineTo(box.x + box.w, box.y_of(budget)); ctx.stroke();
      ctx.setLineDash([]); ctx.fillStyle = css("--ink"); ctx.textAlign = "left";
      ctx.fillText(`budget ${budget}`, box.x + 4, box.y_of(budget) + 12);
    }
    return box;
  }

  // Rows (layers) of shares (experts): a cell's colour is its expert's load against an even spread
  // (share x experts: 0 blank, 1 light, 3 and above full), so hot and idle experts stand out.
  function heatmap(canvas, share) {
    const { ctx, w, h } = setup(canvas);
    const rows = share.length, cols = rows ? share[0].length : 0;
    if (!rows || !cols) return;
    const left = 44, top = 4, cw = (w - left - 10) / cols, ch = (h - top - 18) / rows;
    ctx.fillStyle = css("--decode");
    for (let r = 0; r < rows; r++)
      for (let c = 0; c < cols; c++) {
        const load = share[r][c] * cols;
        if (load <= 0) continue;
        ctx.globalAlpha = Math.min(1, 0.12 + load / 3);
        ctx.fillRect(left + c * cw, top + r * ch, Math.max(cw - (cw > 4 ? 1 : 0), 1), Math.max(ch - (ch > 4 ? 1 : 0), 1));
      }
    ctx.globalAlpha = 1;
    ctx.fillStyle = css("--muted");
    ctx.fillText("layer", 4, top + 10);
    ctx.fillText(`${rows}`, 4, top + rows * ch);
    ctx.fillText(`experts 0..${cols - 1}`, left, h - 4);
  }

  return { css, setup, frame, timeAxis, valueAxis, lines, stepBars, heatmap };
})();
