"""A live `phasewise serve` process on 127.0.0.1 for the server tests, and what they check its answers with."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY = "test-key-123"
MAX_BODY = 200_000
STARTUP_TIMEOUT = 240.0
QUESTION = [{"role": "user", "content": "Name three colours."}]
CHAT = {"model": MODEL, "messages": QUESTION}


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def post(self, path: str, body=None, headers=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """name{labels} → value, plus bare names summed over their labels."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for name, labels, value in re.findall(r"^([\w:]+)(\{[^}]*\})? (\S+)$", text, re.M):
            pairs = sorted(re.findall(r'\w+="[^"]*"', labels))
            out[name + ("{" + ",".join(pairs) + "}" if pairs else "")] = float(value)
            out[name] = out.get(name, 0.0) + float(value)
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir: Path, *extra: str) -> Server:
    port = free_port()
    log = log_dir / "server.log"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phasewise.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--kv-cache-memory", "0.25", "--no-access-log", *extra],
            stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(server)
    pytest.fail(f"the server did not answer /health within {STARTUP_TIMEOUT} s:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10)


def assert_openai_error(resp: httpx.Response, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    for leak in ("pydantic", "errors.pydantic.dev", "'loc'", "'input'", "Traceback", "detail"):
        assert leak not in resp.text, resp.text
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- the API --------------------------------------------------------------------------------------
