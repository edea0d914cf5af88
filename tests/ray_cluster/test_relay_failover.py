"""The relay's failover and the prefix router's avoidance, without a cluster (Ray imported, not started):
a request whose replica died before answering goes again naming that replica, and so do later requests
for a while; a stream that began ends with an error event, never restarted; the router never picks a
replica a request avoids, even the prefix's home, and with none left waits for Serve's next one."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.ray
pytest.importorskip("ray.serve", reason="Ray is not installed (make test-ray)")

from ray.exceptions import ActorDiedError, ActorUnavailableError  # noqa: E402
from ray.serve._private.common import ReplicaID  # noqa: E402

from phasewise.deploy import relay as relay_module  # noqa: E402
from phasewise.deploy.prefix_router import PrefixAffinityRouter, _home, prompt_block_hashes  # noqa: E402
from phasewise.deploy.relay import DEAD_FOR_S, Relay, RelayedRequest  # noqa: E402

BODY = {"model": "m", "prompt": "A story of a lighthouse and the ships it counts at night, one by one. " * 4}
JSON_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
SSE_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


class Replicas:
    """Stands for the engine deployment: each call plays the next script (messages, then the actor id of a
    replica that dies, or another error, or None) and records the request it was sent."""

    def __init__(self, *scripts: tuple[list[dict], str | None]) -> None:
        self.scripts, self.sent = list(scripts), []

    def options(self, **_: object) -> Replicas:
        return self

    def stream(self, _handle: object, request: RelayedRequest):
        self.sent.append(request)
        messages, dies = self.scripts.pop(0)

        async def run():
            if messages:
                yield messages
            if isinstance(dies, Exception):
                raise dies
            if dies:
                raise _died(dies)
        return run()


def _died(actor_id: str) -> ActorDiedError:
    error = ActorDiedError()
    error.actor_id = actor_id
    return error


def _call(relay: Relay, body: dict = BODY) -> list[dict]:
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        return pending.pop() if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    asyncio.run(relay(scope, receive, send))
    return sent


@pytest.fixture
def replicas(monkeypatch):
    def make(*scripts):
        fake = Replicas(*scripts)
        monkeypatch.setattr(relay_module, "_stream", fake.stream)
        return fake, Relay(fake)
    return make


def test_a_request_whose_replica_died_goes_to_another_and_later_ones_avoid_it(replicas):
    answer = [JSON_START, {"type": "http.response.body", "body": b'{"ok": 1}'}]
    fake, relay = replicas(([], "dead-1"), ([], "dead-2"), (answer, None), (answer, None))
    assert _call(relay) == answer
    assert [r.avoid for r in fake.sent] == [frozenset(), {"dead-1"}, {"dead-1", "dead-2"}]
    assert _call(relay) == answer and fake.sent[-1].avoid == {"dead-1", "dead-2"}     # a new request too
    relay._dead["dead-1"] = time.monotonic() - DEAD_FOR_S - 1                          # long gone: forgotten
    assert relay._recently_dead() == {"dead-2"}


def test_a_begun_stream_ends_with_an_error_event_and_is_not_sent_again(replicas):
    chunk = {"type": "http.response.body", "body": b'data: {"n": 1}\n\n', "more_body": True}
    fake, relay = replicas(([SSE_START, chunk], "dead-1"))
    sent = _call(relay, {**BODY, "stream": True})
    assert sent[:2] == [SSE_START, chunk] and len(fake.sent) == 1
    tail = sent[2]["body"].decode()
    assert '"code": "replica_failed"' in tail and tail.endswith("data: [DONE]\n\n")


def test_a_replica_merely_unreachable_is_tried_again_but_not_avoided(replicas):
    answer = [JSON_START, {"type": "http.response.body", "body": b'{"ok": 1}'}]
    unreachable = ActorUnavailableError("a network blip", None)
    unreachable.actor_id = "busy-1"
    fake, relay = replicas(([], unreachable), (answer, None))
    assert _call(relay) == answer
    assert [r.avoid for r in fake.sent] == [frozenset(), frozenset()]


def test_after_the_retries_the_client_gets_a_503(replicas):
    fake, relay = replicas(*[([], f"dead-{i}") for i in range(relay_module.RETRIES + 1)])
    sent = _call(relay)
    assert sent[0]["status"] == 503 and len(fake.sent) == relay_module.RETRIES + 1


def _replica(uid: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID.from_full_id_str(f"SERVE_REPLICA::app#EngineReplica#{uid}"),
                           actor_id=SimpleNamespace(hex=lambda: f"actor-{uid}"))


def test_the_router_never_picks_an_avoided_replica_even_the_prefix_home():
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router.initialize_state()
    router._replica_queue_len_cache = SimpleNamespace(get=lambda _: 0)
    replicas = [_replica(u) for u in ("aaaa", "bbbb", "cccc")]
    hashes = prompt_block_hashes(BODY)
    home = _home(replicas, hashes)

    def choose(avoid: set[str]) -> list[list[str]]:
        pending = SimpleNamespace(args=[RelayedRequest({}, b"", hashes, frozenset(avoid))])
        ranks = asyncio.run(router.choose_replicas(replicas, pending))
        return [[r.actor_id.hex() for r in rank] for rank in ranks]

    assert choose(set())[0] == [home.actor_id.hex()]                 # affinity: the prefix's home
    others = choose({home.actor_id.hex()})
    assert home.actor_id.hex() not in sum(others, []) and len(sum(others, [])) == 2
    assert choose({r.actor_id.hex() for r in replicas}) == [[]]      # none left: Serve waits for a new one
