"""Do long prompts stop disturbing running streams? The same mixed load on one colocated server and on
a disaggregated pair (prefill instance + decode instance + proxy), in one run.

    .venv/bin/python benchmarks/disaggregation.py [--duration 40] [--long-len 2000] [--short-rate 2]

The load, through `phasewise bench serve` (two of them at once): steady short chats (random
64-token prompts, 96 output tokens, --short-rate a second, at most 4 at a time) plus occasional
long prompts (--long-len tokens, 8 output tokens, one every --long-every seconds). Colocated: one
`phasewise serve` with the machine's threads (chunked prefill: 512 tokens a step). Disaggregated:
`serve --role prefill` and `serve --role decode` with half the threads each, joined by their KV
link, and `serve --role proxy` in front. Reported: the short streams' ITL p50/p99 and TTFT, the
long prompts' TTFT, for both; ratios disaggregated / colocated.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH = [sys.executable, "-m", "phasewise.cli", "bench", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "serve", "--port", str(port), "--no-access-log",
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy")


def run_load(url: str, args, tmp: Path, tag: str) -> dict:
    n_short = int(args.duration * args.short_rate)
    n_long = max(1, int(args.duration / args.long_every))
    common = ["--base-url", url, "--endpoint", "completions", "--dataset", "random", "--seed", "0"]
    short = subprocess.Popen(BENCH + common + ["--num-prompts", str(n_short), "--input-len", "64", "--output-len", "96",
                                               "--request-rate", str(args.short_rate), "--max-concurrency", "4",
                                               "--result-dir", str(tmp / f"{tag}-short")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(args.long_every / 2)
    long = subprocess.Popen(BENCH + common + ["--num-prompts", str(n_long), "--input-len", str(args.long_len),
                                              "--output-len", "8", "--request-rate", str(1 / args.long_every),
                                              "--seed", "1", "--result-dir", str(tmp / f"{tag}-long")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if short.wait() or long.wait():
        raise SystemExit(f"{tag}: a load client failed")
    runs = {k: json.loads((tmp / f"{tag}-{k}" / "results.json").read_text())["runs"][0] for k in ("short", "long")}
    for k, r in runs.items():
        if r["failed"]:
            raise SystemExit(f"{tag}: {r['failed']} {k} requests failed: {r['errors'][:2]}")
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of short chats")
    ap.add_argument("--short-rate", type=float, default=2.0)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--long-every", type=float, default=8.0)
    args = ap.parse_args()
    cores = os.cpu_count() or 2
    half = str(max(1, cores // 2))
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, url = serve("--threads", str(cores))
        try:
            wait_healthy(url)
            results["colocated"] = run_load(url, args, tmp, "colocated")
        finally:
            proc.terminate()
            proc.wait(60)
        peer = f"tcp://127.0.0.1:{free_port()}"
        prefill, p_url = serve("--role", "prefill", "--kv-peer", peer, "--threads", half)
        decode, d_url = serve("--role", "decode", "--kv-peer", peer, "--threads", half)
        proxy, url = serve("--role", "proxy", "--prefill", p_url, "--decode", d_url)
        try:
            for u in (p_url, d_url, url):
                wait_healthy(u)
            results["disaggregated"] = run_load(url, args, tmp, "disaggregated")
        finally:
            for p in (proxy, decode, prefill):
                p.terminate()
                p.wait(60)
    print(f"{'':15}{'short ITL p50':>14}{'p99':>8}{'short TTFT p50':>16}{'p99':>8}{'long TTFT p50':>15}"
          f"{'out tok/s':>11}   (ms; {cores} cores, {args.long_len}-token prompts every {args.long_every:g} s)")
    for name, r in results.items():
        s, lg = r["short"], r["long"]
        print(f"{name:15}{s['itl_ms']['median']:>14.1f}{s['itl_ms']['p99']:>8.1f}{s['ttft_ms']['median']:>16.1f}"
              f"{s['ttft_ms']['p99']:>8.1f}{lg['ttft_ms']['median']:>15.1f}{s['output_token_throughput']:>11.1f}")
    c, g = results["colocated"]["short"], results["disaggregated"]["short"]
    print(f"disaggregated / colocated: short ITL p50 {g['itl_ms']['median'] / c['itl_ms']['median']:.2f}, "
          f"p99 {g['itl_ms']['p99'] / c['itl_ms']['p99']:.2f}; long TTFT p50 "
          f"{results['disaggregated']['long']['ttft_ms']['median'] / results['colocated']['long']['ttft_ms']['median']:.2f}")


if __name__ == "__main__":
    main()
