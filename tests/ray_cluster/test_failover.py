"""`serve --ray` with two replicas on a local cluster of two 1-CPU nodes, a replica killed (ray.kill) with
8 unstreamed requests in flight and 8 more sent straight after: every one is answered in full, by a live
replica, whichever the ingress (HAProxy's retry and redispatch; the relay's, which avoids the replicas
it saw die); repeated as Serve replaces the killed one. And the prefix router's choice follows a body's
`prompt_cache_key`: each key's requests meet on the replica its chain's home names, whatever the text.
`make test-ray` runs these (with Ray's HAProxy switches; without them the proxy ingress alone)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from live_server import MODEL

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("ray.serve", reason="Ray is not installed (make test-ray)")
import ray  # noqa: E402
openai = pytest.importorskip("openai")

from test_ray_serve import _client, _deploy, serve_cluster  # noqa: E402  (the Serve helpers of the other cluster tests)

ROUNDS = 5                                     # kills per ingress (issue 68: "repeated 5 times")
IN_FLIGHT = 8
TOKENS = 128                                   # each answer's length (ignore_eos): seconds on one CPU
REPLACE_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def cluster():
    """Two 1-CPU nodes, Serve on a free port; with HAProxy's switches on, its retries too, as `serve --ray`
    sets them (options.start_direct_ingress)."""
    from phasewise.deploy.options import HAPROXY_RETRY_ENV

    saved = dict(os.environ)
    if "direct" in _ingress_modes():
        for name, value in HAPROXY_RETRY_ENV.items():
            os.environ.setdefault(name, value)
    try:
        with serve_cluster() as (url, c):
            yield url, c
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _ingress_modes() -> list[str]:
    from phasewise.deploy.options import DIRECT_INGRESS_ENV

    direct = all(os.environ.get(k) == v for k, v in DIRECT_INGRESS_ENV.items())
    return ["direct", "proxy"] if direct else ["proxy"]


def _replica(full_id: str) -> SimpleNamespace:
    from ray.serve._private.common import ReplicaID

    return SimpleNamespace(replica_id=ReplicaID.from_full_id_str(full_id))


def _replicas(client: openai.OpenAI, pinned: bool, deadline_s: float = REPLACE_TIMEOUT) -> list[str]:
    """The two live replicas' ids, once both answer (requests of distinct prefixes until both have); `pinned`:
    answering as HAProxy's router pinned them (until HAProxy's config names a new replica, Serve's proxy
    carries its requests, and that fallback sends a request whose replica dies nowhere else)."""
    from phasewise.deploy.replica_app import PINNED_HEADER

    seen: set[str] = set()
    deadline = time.monotonic() + deadline_s
    while len(seen) < 2 and time.monotonic() < deadline:
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=f"Probe {time.monotonic()}: a prefix no other request has. " * 2, max_tokens=1)
            if raw.headers.get(PINNED_HEADER) == "haproxy" or not pinned:
                seen.add(raw.headers["x-phasewise-replica"])
        except openai.APIError:
            time.sleep(0.5)
    assert len(seen) == 2, f"two replicas did not answer within {deadline_s:.0f} s: {seen}"
    return sorted(seen)


def _prompts_homed(replicas: list[str], victim: str, n: int, tag: str) -> list[str]:
    """n prompts of distinct prefixes, half of them homed on the victim (the router's rendezvous home)."""
    from phasewise.deploy.prefix_router import _home, prompt_block_hashes

    nodes = [_replica(r) for r in replicas]
    mine, others = [], []
    for i in range(10_000):
        prompt = f"{tag} story {i}: a lighthouse keeper counts the ships that pass in the night, one by one. " * 3
        home = _home(nodes, prompt_block_hashes({"prompt": prompt})).replica_id.to_full_id_str()
        (mine if home == victim else others).append(prompt)
        if len(mine) >= n // 2 and len(others) >= n - n // 2:
            return mine[:n // 2] + others[:n - n // 2]
    raise AssertionError("no prompts homed on both replicas")


def _running_on(url: str, replica: str) -> float:
    """The replica's running plus waiting requests, from the gathered /metrics."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("phasewise:num_requests_running{", "phasewise:num_requests_waiting{")) \
                and f'replica="{replica}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _kill_round(url: str, replicas: list[str], tag: str) -> None:
    """8 requests in flight (half homed on the victim), the victim killed, 8 more at once: all 16 answered
    in full by the other replica or a new one."""
    client = _client(url)
    victim = replicas[0]
    prompts = _prompts_homed(replicas, victim, 2 * IN_FLIGHT, tag)

    def ask(prompt: str) -> tuple[str, int]:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=TOKENS,
                                                          temperature=0, extra_body={"ignore_eos": True})
        return raw.headers["x-phasewise-replica"], raw.parse().usage.completion_tokens

    with ThreadPoolExecutor(2 * IN_FLIGHT) as pool:
        first = [pool.submit(ask, p) for p in prompts[::2]]
        deadline = time.monotonic() + 60
        while _running_on(url, victim) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(f.done() for f in first), "the requests ended before the kill: make them longer"
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        after = [pool.submit(ask, p) for p in prompts[1::2]]
        answers = [f.result(timeout=300) for f in first + after]
    assert all(n == TOKENS for _, n in answers), answers
    assert victim not in {r for r, _ in answers}, answers


@pytest.mark.parametrize("ingress", _ingress_modes())
def test_a_replica_killed_with_requests_in_flight_loses_none(cluster, ingress):
    from phasewise.deploy.ray import build_app

    url, c = cluster
    _deploy(c, build_app({"num-replicas": 2, "kv-cache-memory": 0.25, "ray-ingress": ingress}))
    client = _client(url)
    for round_ in range(ROUNDS):
        replicas = _replicas(client, pinned=ingress == "direct")
        started = time.monotonic()
        _kill_round(url, replicas, f"{ingress}-{round_}")
        print(f"{ingress} round {round_}: 16 answered {time.monotonic() - started:.1f} s after the kill began")
        replaced = _replicas(client, pinned=False)
        assert replicas[0] not in replaced


def test_the_routers_choice_follows_prompt_cache_key(cluster):
    """The same text under different keys: each key's requests all meet on its chain's home (the first
    request goes there as a new prefix; the next ones find it held there), and the keys reach both."""
    from phasewise.deploy.prefix_router import _home, prompt_block_hashes
    from phasewise.deploy.ray import build_app

    url, c = cluster
    _deploy(c, build_app({"num-replicas": 2, "kv-cache-memory": 0.25}))
    client = _client(url)
    replicas = _replicas(client, pinned=False)
    nodes = [_replica(r) for r in replicas]
    text = "You are the support desk of a bicycle shop. Answer in one short sentence, plainly. " * 4
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "Is the shop open?"}]
    homes = {}
    for i in range(64):
        key = f"session-{i}"
        body = {"model": MODEL, "messages": messages, "prompt_cache_key": key}
        homes[key] = _home(nodes, prompt_block_hashes(body)).replica_id.to_full_id_str()
    keys = [next(k for k, h in homes.items() if h == r) for r in replicas]
    keys += [k for k in homes if k not in keys][:4]
    assert {homes[k] for k in keys} == set(replicas)
    for _ in range(2):
        for key in keys:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=1, prompt_cache_key=key)
            assert raw.headers["x-phasewise-replica"] == homes[key], key
            raw.parse()
