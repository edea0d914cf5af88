"""Does watching slow the engine? Decode throughput and ITL with /dashboard open and closed, in one run.

    .venv/bin/python benchmarks/dashboard_overhead.py [--rounds 4] [--streams 8] [--output-len 128] [--refresh 5]
                                                       [--viewer chromium|sse] [--screenshot docs/dashboard.png]
                                                       [--browser-nice N | --browser-idle]

One `phasewise serve` (the default model, its default precision). Each round sends --streams
concurrent streamed chats of --output-len tokens (ignore_eos) through the openai client, and rounds
alternate: page closed (the browser on about:blank), page open (headless chromium showing /dashboard,
redrawing every --refresh seconds, 5 as the page's default). The browser, the clients and the server share this machine's cores, as
they would on a user's laptop. Output tokens/s = tokens / the round's wall time; ITL = gaps between
a stream's chunks as the client receives them once every stream has its first token (steady
decode: the prompts' prefill steps are not counted as ITL), pooled over the rounds of each kind; throughput is
their median. Whether a difference is more than noise: the same ratios over other splits of the
rounds into two halves (every one, or 2,000 at random: a permutation test), whose central 95% is
printed beside them.
--viewer sse replaces the browser by a thread reading /dashboard/events (the server's share
of the cost alone). For chromium, each open round also prints the CPU its processes used (from
/proc), as a share of one core. --screenshot keeps a picture of the page under load (the third
open round's middle). Needs playwright and Debian's chromium (make test-browser installs both).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai

FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "serve", "--port", str(port), "--no-access-log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    for _ in range(480):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def one_round(url: str, model: str, streams: int, tokens: int, during=None) -> tuple[float, list[float]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    times: list[list[float]] = [[] for _ in range(streams)]
    counts = [0] * streams

    def run(i: int) -> None:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write a long story, number {i}."}],
            max_tokens=tokens, stream=True, extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                counts[i] = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                times[i].append(time.perf_counter())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start), steady_gaps(times)


def steady_gaps(times: list[list[float]]) -> list[float]:
    """The gaps (ms) between a stream's chunks once every stream has its first one: before that, the
    prompts' prefill steps sit between some streams' tokens, and those few long gaps would be the p99."""
    everyone = max((ts[0] for ts in times if ts), default=0.0)
    return [(b - a) * 1e3 for ts in times for a, b in zip(ts, ts[1:]) if a >= everyone]


def cpu_seconds(pattern: str) -> float:
    total = 0
    for pid in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split():
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])          # utime + stime
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


class SSEViewer:
    """A thread reading the dashboard's event stream while the round runs (no browser)."""

    def __init__(self, url: str, every: str) -> None:
        self.url, self.every, self.stop, self.thread = url, every, threading.Event(), None

    def open(self) -> None:
        self.stop.clear()
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join()
            self.thread = None

    def _read(self) -> None:
        with httpx.stream("GET", f"{self.url}/dashboard/events?every={self.every}", timeout=600) as resp:
            for _ in resp.iter_lines():
                if self.stop.is_set():
                    return


def lower_priority(niceness: int, idle: bool) -> None:
    """Every chromium process and thread (the renderer of a new page included): a niceness, or Linux's
    SCHED_IDLE class (runs only on a core no other task wants; a waking normal task preempts it)."""
    pids = subprocess.run(["pgrep", "-f", "chromium"], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                if idle:
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                if niceness:
                    os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except OSError:
            pass


def report(r: int, kind: str, result: tuple[float, list[float]], extra: str = "") -> None:
    tps, gaps = result
    print(f"round {r + 1} (page {kind}): {tps:.1f} output tok/s, ITL p50 {pct(gaps, 50):.1f} ms, "
          f"p99 {pct(gaps, 99):.1f} ms{extra}", flush=True)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each kind (closed, open), alternating")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--screenshot", default=None, help="save the page under load here (PNG)")
    ap.add_argument("--viewer", choices=("chromium", "sse"), default="chromium")
    ap.add_argument("--refresh", choices=("1", "2", "5", "10"), default="5", help="the page's refresh, seconds")
    ap.add_argument("--browser-nice", type=int, default=0,
                    help="run the browser's processes at this niceness (the engine keeps the cores it needs)")
    ap.add_argument("--browser-idle", action="store_true",
                    help="run the browser's processes in Linux's SCHED_IDLE class (only on cores left idle)")
    args = ap.parse_args()
    chromium = None
    if args.viewer == "chromium":
        chromium = shutil.which("chromium") or sys.exit("Debian's chromium is not installed (make test-browser)")
    proc, url = start_server()
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    results: dict[str, list[tuple[float, list[float]]]] = {"closed": [], "open": []}
    try:
        if chromium is None:
            viewer = SSEViewer(url, args.refresh)
            one_round(url, model, args.streams, 16)                        # warm-up
            for r in range(args.rounds * 2):
                kind = "open" if r % 2 else "closed"
                if kind == "open":
                    viewer.open()
                results[kind].append(one_round(url, model, args.streams, args.output_len))
                viewer.close()
                report(r, kind, results[kind][-1])
        else:
            from playwright.sync_api import sync_playwright

            with sync_playwright() as p:
                page = p.chromium.launch(executable_path=chromium, args=FLAGS).new_page(
                    viewport={"width": 1280, "height": 1000})
                page.add_init_script(f"localStorage.setItem('phasewise-refresh', '{args.refresh}')")
                one_round(url, model, args.streams, 16)                    # warm-up
                for r in range(args.rounds * 2):
                    kind = "open" if r % 2 else "closed"
                    if kind == "open":
                        page.goto(url + "/dashboard")
                        page.wait_for_function("document.getElementById('status').dataset.state === 'live'")
                        if args.browser_nice or args.browser_idle:
                            lower_priority(args.browser_nice, args.browser_idle)
                    else:
                        page.goto("about:blank")
                    shot = None
                    if kind == "open" and args.screenshot and r == 5:
                        def shot() -> None:
                            time.sleep(3.0)
                            page.screenshot(path=args.screenshot, full_page=True)
                    used, start = cpu_seconds("chromium"), time.perf_counter()
                    results[kind].append(one_round(url, model, args.streams, args.output_len, shot))
                    share = (cpu_seconds("chromium") - used) / (time.perf_counter() - start)
                    report(r, kind, results[kind][-1], f", chromium {share:.1%} of a core")
    finally:
        proc.terminate()
        proc.wait(30)
    summary = {kind: figures(rounds) for kind, rounds in results.items()}
    print(f"{'page':8}{'output tok/s':>14}{'ITL p50 ms':>12}{'ITL p99 ms':>12}   "
          f"(tok/s: median of {args.rounds} rounds; ITL: of all their gaps)")
    for kind, (tps, p50, p99) in summary.items():
        print(f"{kind:8}{tps:>14.1f}{p50:>12.1f}{p99:>12.1f}")
    ratio, noise = relabelled(results["closed"], results["open"])
    names = ("throughput", "ITL p50", "ITL p99")
    print("open / closed: " + ", ".join(f"{n} {r:.3f}" for n, r in zip(names, ratio)))
    print("the same ratios over other splits of the rounds into two halves (every one, or 2,000 at random); "
          "the range holding 95% of them is the noise:")
    print("               " + ", ".join(f"{n} {lo:.3f}-{hi:.3f}" for n, (lo, hi) in zip(names, noise)))


def figures(rounds: list[tuple[float, list[float]]]) -> tuple[float, float, float]:
    """Median throughput of the rounds; ITL p50 and p99 of all their gaps pooled (a round's p99 rests on
    its ~15 largest gaps, too few to compare)."""
    p50, p99 = np.percentile(np.concatenate([gs for _, gs in rounds]), [50, 99])
    return statistics.median(t for t, _ in rounds), float(p50), float(p99)


def relabelled(closed: list, opened: list) -> tuple[tuple[float, ...], list[tuple[float, float]]]:
    """The open/closed ratios, and the central 95% of the same ratios over the other ways of calling
    half the rounds "open" (every one, or 2,000 drawn at random: a permutation test; an effect outside
    that range is not noise)."""
    rounds, n = [(t, np.asarray(gs)) for t, gs in closed + opened], len(closed)
    ratio = tuple(o / c for o, c in zip(figures(rounds[n:]), figures(rounds[:n])))
    splits = list(itertools.combinations(range(len(rounds)), n))
    if len(splits) > 2000:
        splits = random.Random(0).sample(splits, 2000)
    null = []
    for picked in splits:
        a = [rounds[i] for i in picked]
        b = [rounds[i] for i in range(len(rounds)) if i not in picked]
        null.append([y / x for x, y in zip(figures(a), figures(b))])
    lo, hi = np.quantile(np.array(null), [0.025, 0.975], axis=0)
    return ratio, list(zip(lo.tolist(), hi.tolist()))

if __name__ == "__main__":
    main()
