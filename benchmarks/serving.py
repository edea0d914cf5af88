"""Servers under one client, for compare_peers.py: start `phasewise serve` or llama.cpp's
`llama-server` on 127.0.0.1, wait for it, load it with `phasewise bench serve` (the same client and
workload for both), stop it; and llama.cpp's own `llama-bench` for batch-1 prefill and decode.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until GET url/health answers 200 (llama-server says 503 while it loads); fails if the process ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready after {timeout:.0f} s")


def bench(url: str, num_prompts: int, input_len: int, output_len: int, concurrency: int) -> dict:
    """One `phasewise bench serve` run (random token-id prompts, ignore_eos, all at once up to
    `concurrency`, one warm-up request): its summary (results.json's run)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "phasewise.cli", "bench", "serve", "--base-url", url,
               "--num-prompts", str(num_prompts), "--input-len", str(input_len), "--output-len", str(output_len),
               "--max-concurrency", str(concurrency), "--num-warmup", "1", "--result-dir", out]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"bench serve failed: {done.stderr.strip()[-800:]}")
        return json.loads((Path(out) / "results.json").read_text())["runs"][0]


@contextmanager
def running(cmd: list[str], env: dict | None = None) -> Iterator[str]:
    """The server `cmd` (its port given by a {port} placeholder) started and ready: its URL; stopped
    after the block. A RuntimeError inside the block carries the end of the server's log."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url
    except RuntimeError as e:
        log.seek(0)
        raise RuntimeError(f"{e}\n{log.read().decode(errors='replace')[-1500:]}") from None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def served(cmd: list[str], load: dict, env: dict | None = None) -> dict:
    """Start the server `cmd` (its port given by a {port} placeholder), bench it, stop it."""
    with running(cmd, env) as url:
        return bench(url, **load)


def phasewise_server(dtype: str, kv_dtype: str, threads: int, max_num_seqs: int, model: str | None = None
                     ) -> list[str]:
    weights = ["--quantization", dtype] if dtype in ("int8", "q4") else ["--dtype", dtype]
    weights += ["--model", model] if model else []
    return [sys.executable, "-m", "phasewise.cli", "serve", "--port", "{port}", *weights,
            "--kv-dtype", kv_dtype, "--threads", str(threads), "--max-num-seqs", str(max_num_seqs),
            "--max-waiting", str(max_num_seqs), "--no-access-log"]


def llama_server(bin_dir: Path, model: Path, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    return [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}",
            "-t", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot), "--no-webui"]


def llama_bench(bin_dir: Path, model: Path, threads: int, prompt: int, decode: int,
                repeats: int) -> tuple[float, float, float]:
    """llama-bench's pp<prompt>, tg<decode> from an empty context and tg<decode> @ d<prompt> (after a
    prompt's worth of context) in tokens/s, each its mean over `repeats` runs."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(decode),
           "-d", f"0,{prompt}", "-r", str(repeats), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    rows = json.loads(done.stdout)

    def rate(n_prompt: int, n_gen: int, depth: int) -> float:
        return next(r["avg_ts"] for r in rows
                    if (r["n_prompt"], r["n_gen"], r.get("n_depth", 0)) == (n_prompt, n_gen, depth))

    return rate(prompt, 0, 0), rate(0, decode, 0), rate(0, decode, prompt)
