"""API fuzzing with schemathesis against the server's own OpenAPI schema (/openapi.json): every
generated request, valid or not, gets a 2xx, or a 4xx (or 503) in OpenAI's error shape, never a
500; afterwards the server answers /health and holds no request and no KV block. The server runs
with a 48-token context, so no generated request can generate for long.

The examples come from a fixed seed (`make test`, so CI is repeatable); `make fuzz` explores with a fresh
seed (PHASEWISE_FUZZ_SEED) and more examples (PHASEWISE_FUZZ_SCALE), and names the seed on failure: each
case it finds becomes a fixed test (tests/test_agent_surface.py has the first ones)."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings

from live_server import start_server, stop_server

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("PHASEWISE_FUZZ_SEED", "65"))
SCALE = int(os.environ.get("PHASEWISE_FUZZ_SCALE", "1"))
EXAMPLES = {"POST": 70 * SCALE, "GET": 20 * SCALE}      # per operation; POST bodies are where the input is


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("fuzz"), "--max-model-len", "48", "--max-num-seqs", "16")
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def check(case, response: httpx.Response | object) -> None:
    status, text = response.status_code, response.text
    where = (f"{case.method} {case.path} body={json.dumps(case.body, default=str)[:300]} → {status} {text[:300]} "
             f"(PHASEWISE_FUZZ_SEED={SEED})")
    assert status < 500 or status == 503, where
    if status >= 400:
        body = json.loads(text)
        error = body.get("error") if isinstance(body, dict) else None
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], where
        assert {"type", "param", "code"} <= error.keys(), where
    elif "json" in response.headers.get("content-type", ""):
        json.loads(text)


def test_every_generated_request_gets_a_2xx_or_an_openai_shaped_4xx(small):
    schema = schemathesis.openapi.from_url(f"{small.url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= paths
    assert schema.raw_schema["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]
    for op in operations:
        if op.path == "/metrics":
            continue

        @seed(SEED)
        @settings(max_examples=EXAMPLES.get(op.method.upper(), 15 * SCALE), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case) -> None:
            check(case, case.call(base_url=small.url, timeout=120))

        run()
    assert httpx.get(small.url + "/health", timeout=30).status_code == 200
    metrics = httpx.get(small.url + "/metrics", timeout=30).text

    def gauge(name: str) -> float:
        return float(re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M).group(1))

    assert gauge("phasewise:num_requests_running") == gauge("phasewise:num_requests_waiting") == 0
    free, total = gauge("phasewise:kv_cache_free_blocks"), gauge("phasewise:kv_cache_total_blocks")
    assert free == total > 0
