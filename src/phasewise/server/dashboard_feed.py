"""What the dashboard shows, gathered as the engine runs (server/dashboard_routes.py serves it).

The engine thread calls the hooks (`Observer`): each one appends a few numbers under a
lock and returns. The event loop asks for a `snapshot` every second per open page:
the steps and finished requests since the page's cursors, every live request in brief,
latency percentiles and throughput over a sliding window, which resource the recent
steps bind (from the machine's roofline figures, when `phasewise roofline` measured them), and
for a mixture of experts how the recent steps' routers spread their rows over the experts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from phasewise.core.request import Request
from phasewise.engine.step_event import StepEvent
from phasewise.outputs import StreamDelta
from phasewise.server.dashboard_json import (BindingJson, ExpertsJson, FinishedJson,
                                             KindJson, PercentilesJson,
                                               RequestJson, RooflineJson, SnapshotJson, StepJson, WindowJson)
from phasewise.server.observer import Observer
from phasewise.server.server_stats import ServerStats

MAX_LIVE_SHOWN = 200           # live requests sent in a snapshot (the oldest first)
# below this share of both roofs, a step is bound by neither: by what they leave out
NEAR_ROOF = 0.25
EXPERTS_WINDOW_S = 5.0         # the experts' spread: over the steps of the last seconds


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """The machine's roofs and the model's per-token costs, for 'which phase binds now'."""
    dram_gbs: float                   # streaming read bandwidth
    compute_gops: float               # the compute roof of the weights' kernels
    compute_name: str                 # "int8 dot products" or "matmul"
    weight_bytes: float               # linear weights a step reads once, whatever its batch
    flops_per_token: float            # 2 per linear weight except the output head
    head_flops: float                 # the output head, once per sampling row

    def to_json(self) -> RooflineJson:
        return {"dram_gbs": self.dram_gbs, "compute_gops": self.compute_gops,
                "compute_name": self.compute_name}


def binding(steps: list[StepJson], roof: Roofline | None) -> BindingJson:
    """Per kind of step (prefill: any prompt tokens; decode: none), its share of the steps' time,
    the bandwidth and compute it achieved (weights read once a step; attention not counted) as
    shares of the roofs, and which is nearer exhaustion ("neither roof" when both shares are under
    NEAR_ROOF: attention, sampling and the Python between kernels take the time). Also which kind
    takes most of the time."""
    out: BindingJson = {"kinds": {}}
    total = sum(s["ms"] for s in steps)
    for kind in ("prefill", "decode"):
        group = [s for s in steps if (s["prefill"] > 0) == (kind == "prefill")]
        secs = sum(s["ms"] for s in group) / 1e3
        if not group or secs <= 0:
            continue
        tokens = sum(s["prefill"] + s["decode"] + s["draft"] for s in group)
        info: KindJson = {"steps": len(group), "time_share": secs * 1e3 / total,
                          "tokens_per_s": tokens / secs}
        if roof is not None:
            gbs = roof.weight_bytes * len(group) / secs / 1e9
            rows = sum(s["batch"] for s in group)
            gops = (roof.flops_per_token * tokens + roof.head_flops * rows) / secs / 1e9
            bw, comp = gbs / roof.dram_gbs, gops / roof.compute_gops
            nearer = "memory bandwidth" if bw >= comp else "compute"
            info |= {"gbs": gbs, "gops": gops, "bandwidth_share": bw, "compute_share": comp,
                     "binds": nearer if max(bw, comp) >= NEAR_ROOF else "neither roof"}
        out["kinds"][kind] = info
    if out["kinds"]:
        out["dominant"] = max(out["kinds"], key=lambda k: out["kinds"][k]["time_share"])
    return out


def request_summary(request: Request, reason: str | None) -> RequestJson:
    """A request's life in brief, times in perf_counter seconds (the page shifts them). The mean gap
    needs only the ends; the largest gap is looked for once, when the request has ended (a live
    request's summary is rebuilt every second for every open page)."""
    m = request.metrics
    times = m.token_times
    n = len(times)
    longest = max((b - a for a, b in zip(times, times[1:])), default=None) if reason is not None else None
    return {"id": request.request_id, "arrival": m.arrival, "scheduled": m.first_scheduled,
            "chunks": [list(c) for c in m.prefill_chunks], "first_token": m.first_token,
            "last_token": times[-1] if n else None, "tokens": n, "prompt_tokens": request.num_prompt_tokens,
            "cached_tokens": request.num_cached_tokens or 0, "preempted": list(m.preempted_at),
            "finished": m.finished, "reason": reason,
            "ttft_ms": m.ttft_ms if m.first_token is not None else None,
            "itl_mean_ms": (times[-1] - times[0]) * 1e3 / (n - 1) if n > 1 else None,
            "itl_max_ms": longest * 1e3 if longest is not None else None,
            "grammar_compile_ms": m.grammar_compile_ms, "thinking_tokens": m.thinking_tokens,
            "answer_at": times[m.answer_start] if m.answer_start is not None and m.answer_start < n else None,
            "ttfa_ms": m.ttfa_ms}


def expert_spread(choices: list[np.ndarray]) -> ExpertsJson | None:
    """Steps' router choices ([sparse layers, E] each) → each layer's share of choices per expert over
    them, and how many of all layers' experts a step read (mean, largest): the weights a mixture of
    experts reads grow with the union of its rows' choices."""
    if not choices:
        return None
    total = np.sum(choices, axis=0)
    per_layer = total.sum(axis=1, keepdims=True)
    read = [int(np.count_nonzero(c)) for c in choices]
    share = np.divide(total, per_layer, out=np.zeros(total.shape), where=per_layer > 0)
    return {"layers": total.shape[0], "experts": total.shape[1], "steps": len(choices),
            "share": np.round(share, 4).tolist(), "read_mean": float(np.mean(read)), "read_max": max(read)}


class _Samples:
    """(time, value) samples of a sliding window, in two columns so that numpy can read the values."""

    def __init__(self, maxlen: int = 200_000) -> None:
        self.times: deque[float] = deque(maxlen=maxlen)
        self.values: deque[float] = deque(maxlen=maxlen)

    def append(self, t: float, v: float) -> None:
        self.times.append(t)
        self.values.append(v)

    def prune(self, since: float) -> np.ndarray:
        """Drop what is older than `since`; the rest's values."""
        while self.times and self.times[0] < since:
            self.times.popleft()
            self.values.popleft()
        return np.fromiter(self.values, dtype=np.float64, count=len(self.values))


class DashboardFeed(Observer):
    """Engine-thread hooks in, snapshots out. `window_s`: the latency and throughput window."""

    def __init__(self, *, token_budget: int, max_num_seqs: int, num_blocks: int,
                 roofline: Roofline | None = None, window_s: float = 60.0, max_steps: int = 4000,
                 max_finished: int = 500, clock: Callable[[], float] = time.perf_counter) -> None:
        self.token_budget, self.max_num_seqs, self.num_blocks = token_budget, max_num_seqs, num_blocks
        self.roofline, self.window_s, self.clock = roofline, window_s, clock
        self._lock = threading.Lock()
        self._live: dict[str, Request] = {}                  # request id → the engine's Request
        self._steps: deque[StepJson] = deque(maxlen=max_steps)
        self._finished: deque[FinishedJson] = deque(maxlen=max_finished)
        self._ttft, self._itl, self._e2e = _Samples(), _Samples(), _Samples()     # (when, ms)
        self._prompts, self._cached = _Samples(), _Samples()                       # (when, tokens)
        # (when, a step's router choices)
        self._experts: deque[tuple[float, np.ndarray]] = deque(maxlen=2000)
        self._seq = 0
        self._windowed: WindowJson | None = None
        self._windowed_at = 0.0

    # ---- the engine thread -------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        with self._lock:
            self._live[request.request_id] = request

    def on_delta(self, delta: StreamDelta) -> None:
        n = len(delta.token_ids)
        times = delta.output.metrics.token_times
        if not n or not times:
            return
        first = len(times) - n
        with self._lock:
            if first == 0:
                m = delta.output.metrics
                self._ttft.append(times[0], m.ttft_ms)
                self._prompts.append(times[0], len(delta.output.prompt_token_ids))
                self._cached.append(times[0], delta.output.cached_tokens)
            for i in range(max(first, 1), len(times)):
                self._itl.append(times[i], (times[i] - times[i - 1]) * 1e3)

    def on_finish(self, request: Request, reason: str) -> None:
        summary = request_summary(request, reason)
        with self._lock:
            self._live.pop(request.request_id, None)
            self._seq += 1
            self._finished.append({**summary, "seq": self._seq})
            if request.metrics.finished is not None:
                self._e2e.append(request.metrics.finished, request.metrics.e2e_ms)

    def on_step(self, event: StepEvent, stats: ServerStats) -> None:
        record, extras, engine = event.record, event.extras, stats.engine
        choices = None if extras.expert_choices is None else np.asarray(extras.expert_choices, dtype=np.int64)
        with self._lock:
            self._seq += 1
            step: StepJson = {
                "t": record.start, "ms": record.duration_ms, "prefill": record.num_prefill_tokens,
                "decode": record.num_decode_tokens, "batch": record.batch_size,
                "draft": record.num_draft_tokens, "accepted": record.num_accepted_tokens,
                "grammar_ms": extras.grammar_ms, "threads": extras.threads,
                "others": round(stats.threads.cpus_busy_elsewhere, 2),
                "used": engine.num_blocks - engine.num_free_blocks,
                "cached": engine.num_cached_blocks, "free": engine.num_free_blocks,
                "running": engine.num_running, "waiting": engine.num_waiting, "seq": self._seq}
            if choices is not None:
                step["experts_read"] = int(np.count_nonzero(choices))
                self._experts.append((record.start, choices))
            self._steps.append(step)

    # ---- the event loop ------------------------------------------------------------------

    def snapshot(self, after: int, server_stats: ServerStats) -> SnapshotJson:
        """Everything with a sequence number past `after` (the page's cursor), the live requests, the
        engine's counts now, and the windowed figures (computed at most twice a second, shared by
        every open page: they read a minute of inter-token gaps while holding the GIL the engine
        thread needs, hence numpy)."""
        now = self.clock()
        with self._lock:
            steps = [s for s in self._steps if s["seq"] > after] if after < self._seq else []
            finished = [r for r in self._finished if r["seq"] > after] if after < self._seq else []
            live = list(self._live.values())[:MAX_LIVE_SHOWN]
            seq = self._seq
        windowed, stats = self._windowed, server_stats.engine
        if windowed is None or now - self._windowed_at >= 0.45:
            windowed = self._window(now)
            self._windowed, self._windowed_at = windowed, now
        return {
            "now": now, "seq": seq, "steps": steps, "finished": finished,
            "live": [request_summary(r, None) for r in live],
            "engine": {"running": stats.num_running, "waiting": stats.num_waiting, "blocks": stats.num_blocks,
                       "used": stats.num_blocks - stats.num_free_blocks, "cached": stats.num_cached_blocks,
                       "free": stats.num_free_blocks, "token_budget": self.token_budget,
                       "max_num_seqs": self.max_num_seqs, "state_slots": stats.num_state_slots,
                       "state_used": stats.num_state_slots - stats.num_free_state_slots,
                       "checkpoints": stats.num_state_checkpoints},
            "window_s": self.window_s, **windowed,
            "roofline": self.roofline.to_json() if self.roofline else None,
        }

    def _window(self, now: float) -> WindowJson:
        since = now - self.window_s
        with self._lock:
            ttft, itl, e2e, prompts, cached = (d.prune(since) for d in (self._ttft, self._itl, self._e2e,
                                                                        self._prompts, self._cached))
            window = [s for s in self._steps if s["t"] >= since]
            choices = [c for t, c in self._experts if t >= now - EXPERTS_WINDOW_S]
        recent = [s for s in window if s["t"] >= now - 5.0]
        span = min(self.window_s, now - window[0]["t"]) if window else 0.0
        prompt_tokens = prompts.sum()

        def rate(n: float) -> float:
            return n / span if span > 0 else 0.0

        return {
            "latency": {"ttft_ms": _stats(ttft), "itl_ms": _stats(itl), "e2e_ms": _stats(e2e)},
            "throughput": {"prompt_tok_s": rate(sum(s["prefill"] for s in window)),
                           "output_tok_s": rate(sum(s["decode"] + s["accepted"] for s in window)),
                           "busy": rate(sum(s["ms"] for s in window) / 1e3)},
            "prefix_hit_rate": float(cached.sum() / prompt_tokens) if prompt_tokens else None,
            "binding": binding(recent, self.roofline),
            "experts": expert_spread(choices),
        }


def _stats(values: np.ndarray) -> PercentilesJson:
    """Percentiles interpolated linearly, as phasewise.report.percentile does (numpy's default method)."""
    if not len(values):
        return {"n": 0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"n": len(values), "p50": p50, "p90": p90, "p99": p99}
