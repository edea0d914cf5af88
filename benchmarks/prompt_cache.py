"""The prompt cache's disk tier across a crash: a long prompt's time to first token cold, then after the
server was killed with SIGKILL and started again on the same --prompt-cache-dir.

    .venv/bin/python benchmarks/prompt_cache.py [--model qwen2.5-coder-1.5b] [--tokens 16384] [--json FILE]

A real `phasewise serve` (greedy, `--prompt-cache-dir` in a fresh folder) gets one /v1/completions request
of --tokens prompt tokens (text of benchmarks/data, token ids cut to length, a unique first line); once the
disk tier's written bytes stop growing, the server is killed (-9) and started again, and the same request
is sent. Reported: each TTFT (the response's `timings.ttft_ms`: arrival to the first token, the disk
tier's load included; and the request's wall time), the tokens read
from disk (`timings.disk_n`) against the prompt, and whether the outputs are the same. The issue's target:
the restarted TTFT at most 3% of the cold one, at least 95% of the tokens read from the cache.

    .venv/bin/python benchmarks/prompt_cache.py --trace [--turns 20] [--system-tokens 6000] [--json FILE]

replays an agent's session instead: a system prompt of --system-tokens with two tools, then --turns
chat turns (each a short user message and the model's reply, kept in the history), the server killed
with SIGKILL and started again halfway. Reported per turn: the prompt's tokens, those resent (the
previous turn's prompt and reply) and those the cache gave (`timings.cache_n`); the target: at least
95% of all resent tokens read from the cache, across the restart.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

DATA = Path(__file__).parent / "data"


def prompt_ids(model: str, n: int) -> list[int]:
    from phasewise.loading.loader import resolve_model_path
    from phasewise.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model_path(model))
    text = "\n\n".join(p.read_text() for p in sorted(DATA.glob("*.txt")))
    ids = tok.encode(f"Run {time.time_ns()}: read this, then answer at the end.\n\n")
    while len(ids) < n:
        ids += tok.encode(text)
    return ids[:n]


def start(model: str, cache_dir: Path, port: int, tokens: int, log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "phasewise.cli", "serve", "--model", model, "--port", str(port),
            "--host", "127.0.0.1", "--prompt-cache-dir", str(cache_dir), "--max-model-len", str(tokens + 64),
            "--kv-cache-memory", "3", "--no-access-log"]
    proc = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start within 300 s; see {log}")


def ask(port: int, ids: list[int]) -> dict[str, object]:
    name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
    started = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=3600,
                   json={"model": name, "prompt": ids, "max_tokens": 16, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    t = body["timings"]
    return {"wall_s": time.perf_counter() - started, "ttft_ms": t["ttft_ms"], "disk_n": t.get("disk_n", 0),
            "disk_load_ms": t.get("disk_load_ms", 0.0), "prompt_n": body["usage"]["prompt_tokens"],
            "text": body["choices"][0]["text"], "timings": t}


def chat(port: int, messages: list[dict[str, object]], tools: list[dict[str, object]]) -> dict[str, object]:
    name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=3600,
                   json={"model": name, "messages": messages, "tools": tools, "max_tokens": 24, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return {"prompt_n": body["usage"]["prompt_tokens"], "cache_n": body["timings"]["cache_n"],
            "ttft_ms": body["timings"]["ttft_ms"], "reply": body["choices"][0]["message"]["content"] or "",
            "reply_n": body["usage"]["completion_tokens"]}


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}},
         {"type": "function", "function": {"name": "run_tests", "description": "Run the project's tests.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def trace(args: argparse.Namespace) -> dict[str, object]:
    """The agent session of the module's text; its turns and the fraction of resent tokens the cache gave."""
    from phasewise.loading.loader import resolve_model_path
    from phasewise.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model_path(args.model))
    ids = prompt_ids(args.model, args.system_tokens)
    system = "You are a coding agent. The project's notes follow.\n\n" + tok.decode(ids)
    messages: list[dict[str, object]] = [{"role": "system", "content": system}]
    turns: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="phasewise-prompt-cache-") as tmp:
        cache, log = Path(tmp) / "cache", Path(tmp) / "server.log"
        server = start(args.model, cache, args.port, args.tokens, log)
        try:
            for turn in range(args.turns):
                if turn == args.turns // 2:              # the crash halfway
                    settle(args.port)
                    server.send_signal(signal.SIGKILL)
                    server.wait()
                    server = start(args.model, cache, args.port, args.tokens, log)
                messages.append({"role": "user", "content": f"Step {turn + 1}: what should we look at next, "
                                                            f"and why? One sentence."})
                r = chat(args.port, messages, TOOLS)
                before = turns[-1] if turns else None
                r["resent"] = 0 if before is None else int(before["prompt_n"]) + int(before["reply_n"])
                turns.append(r)
                messages.append({"role": "assistant", "content": r["reply"]})
                print(f"turn {turn + 1:2d}: prompt {r['prompt_n']:6d}, resent {r['resent']:6d}, from the cache "
                      f"{r['cache_n']:6d}, TTFT {float(r['ttft_ms']) / 1e3:6.2f} s", flush=True)
        finally:
            server.terminate()
            server.wait(60)
    resent = sum(int(t["resent"]) for t in turns[1:])
    cached = sum(min(int(t["cache_n"]), int(t["resent"])) for t in turns[1:])
    print(f"{args.turns} turns, a restart before turn {args.turns // 2 + 1}: {cached} of {resent} resent tokens "
          f"from the cache ({cached / resent:.1%}; target >= 95%)")
    return {"turns": turns, "resent": resent, "cached": cached, "fraction": cached / resent}


def written_bytes(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    m = re.search(r"^phasewise:prompt_cache_disk_written_bytes(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def settle(port: int, quiet_s: float = 3.0, limit_s: float = 600.0) -> float:
    """Wait until the disk tier's written bytes stop growing; those bytes."""
    last, since, deadline = -1.0, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        now = written_bytes(port)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.5)
    return last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", action="store_true", help="replay an agent session with a restart halfway")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--system-tokens", type=int, default=6000)
    args = ap.parse_args()
    if args.trace:
        result = trace(args)
        if args.json:
            Path(args.json).write_text(json.dumps({"model": args.model, **result}, indent=1) + "\n")
        return
    ids = prompt_ids(args.model, args.tokens)
    with tempfile.TemporaryDirectory(prefix="phasewise-prompt-cache-") as tmp:
        cache, log = Path(tmp) / "cache", Path(tmp) / "server.log"
        server = start(args.model, cache, args.port, args.tokens, log)
        try:
            cold = ask(args.port, ids)
            written = settle(args.port)
        finally:
            server.send_signal(signal.SIGKILL)          # a crash: nothing flushed or closed
            server.wait()
        server = start(args.model, cache, args.port, args.tokens, log)
        try:
            warm = ask(args.port, ids)
        finally:
            server.terminate()
            server.wait(60)
    ratio = warm["ttft_ms"] / cold["ttft_ms"]
    read = warm["disk_n"] / warm["prompt_n"]
    print(f"{args.model}, a {warm['prompt_n']}-token prompt; disk tier {written / 2**20:.0f} MiB written")
    print(f"cold:               TTFT {cold['ttft_ms'] / 1e3:8.2f} s (wall {cold['wall_s']:.2f} s)")
    print(f"after kill -9:      TTFT {warm['ttft_ms'] / 1e3:8.2f} s (wall {warm['wall_s']:.2f} s), "
          f"{warm['disk_n']} tokens from disk in {warm['disk_load_ms']:.0f} ms")
    print(f"ratio {ratio:.1%} (target <= 3%), read {read:.1%} (target >= 95%), "
          f"same output: {'yes' if warm['text'] == cold['text'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "tokens": args.tokens, "cold": cold,
                                               "warm": warm, "written_bytes": written, "ratio": ratio,
                                               "read": read}, indent=1) + "\n")


if __name__ == "__main__":
    main()
