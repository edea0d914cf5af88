"""Soak: a bounded mixed load on `phasewise serve` for a given time, then the invariants.

    .venv/bin/python benchmarks/soak.py [--duration 600] [--max-concurrency 8] [--base-url URL]

Without --base-url it starts its own server (and watches its memory), with a 0.5 GB KV pool: the
pool's pages become resident as blocks are first used (they are mapped lazily), which a small pool
finishes within the warm-up. Workers loop until the time
is up, each request drawn at random: completions or chat, streamed or not, prompts of 5-300 words
(half of them after one of four shared prefixes), 1-64 output tokens, n of 1-3, greedy or sampled;
some streams hang up after a few chunks; some requests are invalid (they must get a 4xx).
At the end: nothing running or waiting, every KV block free (the prefix cache's blocks are free,
evictable ones), resident memory within 5% of what it was after the first tenth of the run (runs
of 5 minutes or more; shorter ones only print it), no status 500. Per minute: requests, p99 TTFT and p99 ITL, so drift shows. Exit status 1 if an
invariant fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

from phasewise.report import percentile

sys.path.insert(0, str(Path(__file__).parent))
import serving  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work number night point home water "
         "room mother area money story fact month lot right study book eye job word business issue side").split()
INVALID = [{"max_tokens": -3}, {"model": "no-such-model"}, {"temperature": -1}, {"n": 0}, {"top_p": 5}]


class Soak:
    def __init__(self, url: str, seed: int) -> None:
        self.url, self.rng = url, random.Random(seed)
        self.prefixes = [" ".join(self.rng.choice(WORDS) for _ in range(120)) for _ in range(4)]
        self.statuses: dict[int, int] = defaultdict(int)
        self.unexpected: list[str] = []
        self.minutes: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.started = time.perf_counter()

    def body(self) -> tuple[str, dict, bool]:
        r = self.rng
        text = " ".join(r.choice(WORDS) for _ in range(r.randint(5, 300)))
        if r.random() < 0.5:
            text = r.choice(self.prefixes) + " " + text
        common = {"max_tokens": r.randint(1, 64), "n": r.choice([1, 1, 1, 2, 3]), "stream": r.random() < 0.6,
                  "temperature": r.choice([0.0, 0.7, 1.0]), "ignore_eos": r.random() < 0.5}
        invalid = r.random() < 0.05
        if r.random() < 0.5:
            path, body = "/v1/completions", {"prompt": text, **common}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **common}
        if invalid:
            body.update(r.choice(INVALID))
        return path, body, invalid

    async def one(self, client: httpx.AsyncClient) -> None:
        path, body, invalid = self.body()
        hang_up = body.get("stream") and self.rng.random() < 0.1
        minute = int((time.perf_counter() - self.started) // 60)
        start = time.perf_counter()
        try:
            if not body.get("stream"):
                resp = await client.post(self.url + path, json=body)
                self.note(resp.status_code, invalid, resp.text)
                return
            async with client.stream("POST", self.url + path, json=body) as resp:
                if resp.status_code != 200:
                    self.note(resp.status_code, invalid, (await resp.aread()).decode(errors="replace"))
                    return
                times, chunks = [], 0
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        times.append(time.perf_counter())
                        chunks += 1
                        if hang_up and chunks >= 3:
                            break                   # the client goes away mid-stream
                self.note(200, invalid, "")
                if times:
                    self.minutes[minute]["ttft"].append((times[0] - start) * 1e3)
                    self.minutes[minute]["itl"].extend((b - a) * 1e3 for a, b in zip(times, times[1:]))
        except httpx.HTTPError as e:
            self.unexpected.append(f"{path}: {type(e).__name__}: {e}")
        finally:
            self.minutes[minute]["done"].append(1.0)

    def note(self, status: int, invalid: bool, text: str) -> None:
        self.statuses[status] += 1
        if status >= 500 and status != 503 or (invalid and status < 400) or (not invalid and status >= 400
                                                                              and status != 503):
            self.unexpected.append(f"HTTP {status} (invalid={invalid}): {text[:200]}")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m[0]: float(m[1]) for m in re.findall(r"^(phasewise:[\w]+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


async def load(soak: Soak, duration: float, concurrency: int, pid: int | None) -> list[tuple[float, float]]:
    deadline, memory = time.perf_counter() + duration, []

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            while time.perf_counter() < deadline:
                await soak.one(client)

    async def watch() -> None:
        while pid is not None and time.perf_counter() < deadline:
            memory.append((time.perf_counter() - soak.started, rss_mb(pid)))
            await asyncio.sleep(min(10.0, duration / 20))

    await asyncio.gather(watch(), *(worker() for _ in range(concurrency)))
    return memory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--base-url", default=None, help="a running server (default: start one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    proc, log = None, None
    url = args.base_url
    if url is None:
        port = serving.free_port()
        log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        proc = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "serve", "--port", str(port),
                                 "--kv-cache-memory", "0.5", "--no-access-log"], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
    try:
        if proc is not None:
            serving.wait_ready(url, proc)
        soak = Soak(url, args.seed)
        memory = asyncio.run(load(soak, args.duration, args.max_concurrency, proc.pid if proc else None))
        for _ in range(120):                        # hung-up streams are aborted on the next turn
            g = gauges(url)
            if g["phasewise:num_requests_running"] == g["phasewise:num_requests_waiting"] == 0:
                break
            time.sleep(0.5)
        ok = report(soak, g, memory, judge_memory=args.duration >= 300)
        if proc is not None:
            log.seek(0)
            if "Traceback" in log.read():
                print("FAIL: a traceback in the server's log")
                ok = False
        return 0 if ok else 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def report(soak: Soak, g: dict[str, float], memory: list[tuple[float, float]], judge_memory: bool) -> bool:
    print(f"{'minute':>6}{'requests':>10}{'p99 TTFT ms':>13}{'p99 ITL ms':>12}")
    for m in sorted(soak.minutes):
        row = soak.minutes[m]
        print(f"{m:6d}{len(row['done']):10d}{percentile(row['ttft'], 99):13.0f}{percentile(row['itl'], 99):12.1f}")
    print("statuses:", json.dumps(dict(sorted(soak.statuses.items()))))
    checks = {
        "nothing running or waiting": g["phasewise:num_requests_running"] == g["phasewise:num_requests_waiting"] == 0,
        "every KV block free or evictable": g["phasewise:kv_cache_free_blocks"] == g["phasewise:kv_cache_total_blocks"],
        "no status 500 and every status as expected": not soak.unexpected,
    }
    if len(memory) >= 4:
        warm = memory[max(1, len(memory) // 10)][1]
        growth = memory[-1][1] / warm - 1
        print(f"resident memory: {warm:.0f} MB after warm-up, {memory[-1][1]:.0f} MB at the end ({growth:+.1%})")
        if judge_memory:
            checks["resident memory growth under 5% after warm-up"] = growth < 0.05
    for line in soak.unexpected[:10]:
        print("  unexpected:", line)
    for name, passed in checks.items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}")
    return all(checks.values())


if __name__ == "__main__":
    sys.exit(main())
