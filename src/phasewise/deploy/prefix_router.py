"""Prefix affinity on Ray Serve's request-router extension point (`ray.serve.request_router.RequestRouter`).

The key is the prompt as text, cut into pieces of `BLOCK_CHARS` characters (64: about one KV block of 16
tokens at ~4 characters a token) and hashed in a chain, each piece's hash on its parent's, as the engine's
prefix cache hashes its blocks of token ids; a prompt given as token ids is cut into blocks of 16 ids. The
text is what the request says before the model answers: for chat, each message's role and text in order
(system and instructions first); for completions, the prompt. The router runs in each caller's process
(here the ingress replica) and remembers which replica it sent each block hash to (bounded, least recently
used forgotten first); a replica that dies is forgotten. It does not see the engine's evictions: a replica
that evicted a prefix still attracts it, which costs one recompute there, never a wrong answer.

Rule: the replica that holds the longest run of the request's blocks (at least one) gets it, unless its
queue is longer than the shortest queue among the others by more than `margin` requests; then, as for a
request that matches nowhere, the least loaded replica does. A request that names replicas to `skip` (the
relay's visit of every replica for /metrics) goes to one not named, while there is one.

Ray's own PrefixCacheAffinityRouter (ray.serve.llm) runs without vLLM, but it keeps its tree in a detached
actor reached by blocking `ray.get` calls from the router's event loop, matches characters with a 10% match
rate threshold rather than whole blocks, and needs an actor (and its CPU share) per deployment; this one is
a dictionary in the router.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

BLOCK_CHARS = 64
BLOCK_TOKENS = 16
MAX_BLOCKS = 64                # a prompt's first 64 blocks are hashed (4,096 characters)


def prompt_block_hashes(body: Any) -> tuple[bytes, ...]:
    """The chained hashes of an OpenAI (or Anthropic Messages, or Responses) request body's full blocks."""
    if not isinstance(body, dict):
        return ()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]                                   # a batch of token-id prompts: the first
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        pieces = [",".join(map(str, prompt[i:i + BLOCK_TOKENS]))
                  for i in range(0, len(prompt) - BLOCK_TOKENS + 1, BLOCK_TOKENS)]
        return _chain(pieces[:MAX_BLOCKS])
    text = _prompt_text(body)
    return _chain([text[i:i + BLOCK_CHARS] for i in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS) - BLOCK_CHARS + 1,
                                                         BLOCK_CHARS)])


def _prompt_text(body: dict) -> str:
    parts = [_text(body.get("system")), _text(body.get("instructions"))]
    for field in ("messages", "input"):
        value = body.get(field)
        if isinstance(value, list):
            parts += [f"{m.get('role', '')}\n{_text(m.get('content'))}\n" if isinstance(m, dict) else _text(m)
                      for m in value]
        else:
            parts.append(_text(value))
    prompt = body.get("prompt")
    parts.append(_text(prompt[0] if isinstance(prompt, list) and prompt else prompt))
    return "".join(parts)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        return _text(value.get("text", value.get("content")))
    return ""


def _chain(pieces: list[str]) -> tuple[bytes, ...]:
    hashes, parent = [], b""
    for piece in pieces:
        parent = hashlib.blake2b(parent + piece.encode(), digest_size=8).digest()
        hashes.append(parent)
    return tuple(hashes)


class PrefixAffinityRouter(RequestRouter):
    """Serve's router for the engine replicas (`request_router_config`); see the module's docstring.
    A request's first argument carries `block_hashes` (`ray.py`'s RelayedRequest)."""

    queue_len_response_deadline_s = 0.5        # Serve's 0.1 s first probe misses often on a busy 2-core machine

    def initialize_state(self, margin: int = 4, max_blocks: int = 200_000) -> None:
        self._margin = margin
        self._max_blocks = max_blocks
        self._holders: OrderedDict[bytes, dict[ReplicaID, None]] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        skip = getattr(pending_request.args[0], "skip", None) if pending_request and pending_request.args else None
        if skip is not None:                             # a visit of every replica: one not visited yet
            fresh = [r for r in candidate_replicas if r.replica_id.to_full_id_str() not in skip]
            return [fresh or candidate_replicas]
        everyone = random.sample(candidate_replicas, len(candidate_replicas))   # ties among idle replicas: any
        depth = self._matched_depth(_hashes(pending_request), {r.replica_id for r in candidate_replicas})
        if not depth:
            return [everyone]                            # the least loaded (Serve picks it among these)
        queue = await self._queue_lens(candidate_replicas)
        best = max(candidate_replicas, key=lambda r: (depth.get(r.replica_id, 0), -(queue[r.replica_id] or 0)))
        others = [r for r in everyone if r.replica_id != best.replica_id]
        known = [queue[r.replica_id] for r in others if queue[r.replica_id] is not None]
        mine = queue[best.replica_id]
        if mine is not None and known and mine - min(known) > self._margin:
            return [everyone]
        return [[best], others]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for h in _hashes(pending_request):
            holders = self._holders.setdefault(h, {})
            holders[replica_id] = None
            self._holders.move_to_end(h)
        while len(self._holders) > self._max_blocks:
            self._holders.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for h in list(self._holders):
            holders = self._holders[h]
            holders.pop(replica_id, None)
            if not holders:
                del self._holders[h]

    def _matched_depth(self, hashes: tuple[bytes, ...], alive: set[ReplicaID]) -> dict[ReplicaID, int]:
        """Replica → how many leading blocks of the prompt it was sent (chained hashes: block i implies the rest)."""
        depth: dict[ReplicaID, int] = {}
        for i, h in enumerate(hashes):
            holders = [r for r in self._holders.get(h, ()) if r in alive]
            if not holders:
                break
            for r in holders:
                depth[r] = i + 1
        return depth

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int | None]:
        """Ongoing requests per replica: Serve's cache, else a probe; None when a probe missed its deadline
        (an unknown queue neither breaks affinity nor attracts a request)."""
        queue: dict[ReplicaID, int | None] = {}
        missing = []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                queue[r.replica_id] = n
        for r, n in await self._probe_queue_lens(missing, 0) if missing else ():
            queue[r.replica_id] = n
        return queue


def _hashes(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return tuple(getattr(pending_request.args[0], "block_hashes", ()))
