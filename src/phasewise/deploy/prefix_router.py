"""Prefix affinity on Ray Serve's request-router extension point (`ray.serve.request_router.RequestRouter`).

The key is the prompt as text, cut into pieces of `BLOCK_CHARS` characters (64: about one KV block of 16
tokens at ~4 characters a token) and hashed in a chain, each piece's hash on its parent's, as the engine's
prefix cache hashes its blocks of token ids; a prompt given as token ids is cut into blocks of 16 ids. The
text is what the request says before the model answers: for chat, each message's role and text in order
(system and instructions first); for completions, the prompt. A body's `prompt_cache_key` (OpenAI's) and
`cache_salt` (vLLM's) are the chain's root, so one session's or tenant's requests meet their own cache and
no other's. The router runs in each caller's process
(here the ingress replica) and remembers which replica it sent each block hash to (bounded, least recently
used forgotten first); a replica that dies is forgotten. It does not see the engine's evictions: a replica
that evicted a prefix still attracts it, which costs one recompute there, never a wrong answer. Routers
do not share what they remember (HAProxy's ingress runs one per node): a prefix none of them has sent yet
goes to a home all of them compute alike, rendezvous hashing of its blocks over the live replicas.

Rule: the replica that holds the longest run of the request's blocks (at least one) gets it, unless its
queue is longer than the shortest queue among the others by more than `margin` requests; then, as for a
request that matches nowhere, the least loaded replica does. A request that names replicas to `skip` (a
visit of every replica for /metrics) goes to one not named, while there is one. A request that names
replicas to `avoid` (the relay's: replicas that died, which Serve may still list) never goes to them: with
none left it waits, as Serve's routing loop does, for the replica Serve starts in their place.

Two callers. A handle call (the relay's) is routed by Serve: it takes the first rank of the answer whose
replica accepts, and tells `on_request_routed` where it went. A pick (`RoutePick`, from `route.py`, for
HAProxy's direct ingress) only asks which replica: Serve takes the first replica of the first rank and
sends nothing, so the answer is one list in order of preference, the router remembers the pick itself,
and queues are probed afresh each time plus the picks of the last `PICK_GRACE_S` (requests HAProxy is
still forwarding, which no replica counts yet).

Ray's own PrefixCacheAffinityRouter (ray.serve.llm) runs without vLLM, but it keeps its tree in a detached
actor reached by blocking `ray.get` calls from the router's event loop, matches characters with a 10% match
rate threshold rather than whole blocks, and needs an actor (and its CPU share) per deployment; this one is
a dictionary in the router.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

if TYPE_CHECKING:
    from phasewise.json_types import JsonObject, JsonValue

BLOCK_CHARS = 64
BLOCK_TOKENS = 16
MAX_BLOCKS = 64                # a prompt's first 64 blocks are hashed (4,096 characters)
# a new prefix's home is chosen by its 4th block (256 characters: a system prompt)
HOME_BLOCKS = 4
PICK_GRACE_S = 1.0             # a pick counts in its replica's queue this long (HAProxy still forwarding it)


@dataclass(frozen=True)
class RoutePick:
    """A routing question without a request to send (HAProxy's direct ingress asks it of `route.py`):
    which replica should serve a request whose prompt has these block hashes."""
    block_hashes: tuple[bytes, ...]


def prompt_block_hashes(body: JsonValue) -> tuple[bytes, ...]:
    """The chained hashes of an OpenAI (or Anthropic Messages, or Responses) request body's full blocks."""
    if not isinstance(body, dict):
        return ()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]                                   # a batch of token-id prompts: the first
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        pieces = [",".join(map(str, prompt[i:i + BLOCK_TOKENS]))
                  for i in range(0, len(prompt) - BLOCK_TOKENS + 1, BLOCK_TOKENS)]
        return _chain(pieces[:MAX_BLOCKS], _root(body))
    text = _prompt_text(body)
    return _chain([text[i:i + BLOCK_CHARS]
                   for i in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS) - BLOCK_CHARS + 1,
                                 BLOCK_CHARS)], _root(body))


def _root(body: JsonObject) -> bytes:
    """The chain's root: the body's prompt_cache_key and cache_salt (b"" without either)."""
    named = [f"{name}={body[name]}" for name in ("prompt_cache_key", "cache_salt")
             if isinstance(body.get(name), str)]
    return hashlib.blake2b("\0".join(named).encode(), digest_size=8).digest() if named else b""


def _prompt_text(body: JsonObject) -> str:
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


def _text(value: JsonValue) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        return _text(value.get("text", value.get("content")))
    return ""


def _chain(pieces: list[str], root: bytes = b"") -> tuple[bytes, ...]:
    hashes, parent = [], root
    for piece in pieces:
        parent = hashlib.blake2b(parent + piece.encode(), digest_size=8).digest()
        hashes.append(parent)
    return tuple(hashes)


class PrefixAffinityRouter(RequestRouter):
    """Serve's router for the engine replicas (`request_router_config`); see the module's docstring.
    A request's first argument carries `block_hashes` (the relay's `RelayedRequest`, or a `RoutePick`)."""

    # Serve's 0.1 s first probe misses often on a busy 2-core machine
    queue_len_response_deadline_s = 0.5

    # Serve calls it with request_router_kwargs; its stub's `**kwargs: Any` is for subclasses to name
    # their own
    def initialize_state(self, margin: int = 4, max_blocks: int = 200_000) -> None:  # type: ignore[override]
        self._margin = margin
        self._max_blocks = max_blocks
        self._holders: OrderedDict[bytes, dict[ReplicaID, None]] = OrderedDict()
        self._picks: deque[tuple[float, ReplicaID]] = deque()        # (when, where) of recent picks

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        first = pending_request.args[0] if pending_request and pending_request.args else None
        avoid = getattr(first, "avoid", None)
        if avoid:                                        # replicas seen dying: never, even as the only ones
            candidate_replicas = [r for r in candidate_replicas if r.actor_id.hex() not in avoid]
            if not candidate_replicas:
                return [[]]
        skip = getattr(first, "skip", None)
        if skip is not None:                             # a visit of every replica: one not visited yet
            fresh = [r for r in candidate_replicas if r.replica_id.to_full_id_str() not in skip]
            return [fresh or candidate_replicas]
        if isinstance(first, RoutePick):
            order = await self._preference(candidate_replicas, first.block_hashes, fresh=True)
            self._remember(first.block_hashes, order[0].replica_id)
            self._picks.append((time.monotonic(), order[0].replica_id))
            return [order]
        if not _hashes(pending_request):                 # no full block: the least loaded (Serve picks it)
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        order = await self._preference(candidate_replicas, _hashes(pending_request), fresh=False)
        return [order[:1], order[1:]] if len(order) > 1 else [order]

    async def _preference(self, replicas: list[RunningReplica], hashes: tuple[bytes, ...],
                          fresh: bool) -> list[RunningReplica]:
        """The replicas in order of preference: the prefix's holder first (unless its queue is too long),
        then by queue length (unknown last, ties in random order). A prefix this router has not sent
        anywhere has a home that every router computes alike (`_home`)."""
        depth = self._matched_depth(hashes, {r.replica_id for r in replicas})
        if not depth and hashes:
            depth = {_home(replicas, hashes).replica_id: 1}
        queue = await self._queue_lens(replicas, fresh)
        shuffled = random.sample(replicas, len(replicas))
        order = sorted(shuffled, key=lambda r: (queue[r.replica_id] is None, queue[r.replica_id] or 0))
        if not depth:
            return order
        best = max(replicas, key=lambda r: (depth.get(r.replica_id, 0), -(queue[r.replica_id] or 0)))
        others = [r for r in order if r.replica_id != best.replica_id]
        known = [n for r in others if (n := queue[r.replica_id]) is not None]
        mine = queue[best.replica_id]
        if mine is not None and known and mine - min(known) > self._margin:
            return order
        return [best, *others]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: object) -> None:
        self._remember(_hashes(pending_request), replica_id)

    def _remember(self, hashes: tuple[bytes, ...], replica_id: ReplicaID) -> None:
        for h in hashes:
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
        """Replica → how many leading blocks of the prompt it was sent (chained hashes: block i implies the
        rest)."""
        depth: dict[ReplicaID, int] = {}
        for i, h in enumerate(hashes):
            holders = [r for r in self._holders.get(h, ()) if r in alive]
            if not holders:
                break
            for r in holders:
                depth[r] = i + 1
        return depth

    async def _queue_lens(self, replicas: list[RunningReplica], fresh: bool) -> dict[ReplicaID, int | None]:
        """Ongoing requests per replica: Serve's cache (unless `fresh`), else a probe, plus the picks of the
        last PICK_GRACE_S; None when a probe missed its deadline (an unknown queue neither breaks affinity
        nor attracts a request)."""
        queue: dict[ReplicaID, int | None] = {}
        missing = []
        for r in replicas:
            n = None if fresh else self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                queue[r.replica_id] = n
        for r, n in await self._probe_queue_lens(missing, 0) if missing else ():
            queue[r.replica_id] = n
        now = time.monotonic()
        while self._picks and now - self._picks[0][0] > PICK_GRACE_S:
            self._picks.popleft()
        for _, replica_id in self._picks:
            n = queue.get(replica_id)
            if n is not None:
                queue[replica_id] = n + 1
        return queue


def _home(replicas: list[RunningReplica], hashes: tuple[bytes, ...]) -> RunningReplica:
    """The replica a prefix goes to when no holder is known: the highest hash of (the prompt's HOME_BLOCKS-th
    block, or its last full one, and the replica's id), rendezvous hashing: the same for every router
    (HAProxy asks one router per node), and a replica leaving moves only its own prefixes."""
    key = hashes[min(len(hashes), HOME_BLOCKS) - 1]
    return max(replicas,
               key=lambda r: hashlib.blake2b(key + r.replica_id.unique_id.encode(), digest_size=8).digest())


def _hashes(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return tuple(getattr(pending_request.args[0], "block_hashes", ()))
