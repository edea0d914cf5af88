"""KV blocks handed from one engine to another (the core of prefill/decode disaggregation): the
block manager's side without torch, then two engines on the default model."""

from __future__ import annotations

import pytest

from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.core.request import Request
from phasewise.core.sampling_params import SamplingParams


def _request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), frozenset())


def test_adopted_blocks_are_hits_for_a_request_with_that_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(11))                                   # 2 whole blocks + 3 tokens
    placed = kv.adopt_prefix(tokens, 2)
    assert [fresh for _, fresh in placed] == [True, True] and kv.pool.num_free == 8   # cached, free
    req = _request(tokens)
    assert kv.get_computed_blocks(req) == [[b for b, _ in placed]]
    assert kv.cached_prefix(tokens) == [b for b, _ in placed]
    again = kv.adopt_prefix(tokens, 2)                          # already here: kept, nothing to fill
    assert again == [(b, False) for b, _ in placed]
    other = _request([99] + tokens[1:])
    assert kv.get_computed_blocks(other) == [[]]                # another first block: no hit
    salted = Request("s", tokens, SamplingParams(max_tokens=4, cache_salt="t"), frozenset())
    assert kv.get_computed_blocks(salted) == [[]]               # another salt: no hit, until its own arrive
    mine = kv.adopt_prefix(tokens, 2, salt="t")
    assert all(fresh for _, fresh in mine) and kv.get_computed_blocks(salted) == [[b for b, _ in mine]]
    assert kv.cached_prefix(tokens, "t") == [b for b, _ in mine] and kv.cached_prefix(tokens, "u") == []


def test_adopting_more_than_the_pool_takes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    req = _request(list(range(8)))
    assert kv.allocate_slots(req, 8)                           # 2 blocks held
    assert kv.adopt_prefix(list(range(100, 116)), 4) is None and kv.pool.num_free == 1
    with pytest.raises(ValueError, match="sliding-window"):
        KVCacheManager(8, 4, windows=(None, 16)).adopt_prefix(list(range(8)), 2)
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(8, 4, enable_prefix_caching=False).adopt_prefix(list(range(8)), 2)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_a_prompt_computed_by_one_engine_continues_on_another(default_model_path, kv_dtype):
    """Engine A runs a prompt; its cached blocks move to engine B, which computes only the last
    partial block and then generates exactly what A generates from its own cache."""
    from phasewise import LLM

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a, b = (LLM(kv_cache_memory=0.3, kv_dtype=kv_dtype, warmup=False) for _ in range(2))
    bs = a.engine.kv_cache.block_size
    prompt = a.tokenizer.apply_chat_template([{"role": "user", "content": "Explain in detail how a bicycle works. " * 20}])
    a.generate(prompt, SamplingParams(max_tokens=1))              # the prefill side: the prompt, once
    kv = a.engine.kv_transfer.export(prompt)
    assert kv.num_blocks == (len(prompt) - 1) // bs and kv.num_blocks >= 2
    assert b.engine.kv_transfer.adopt(kv) == kv.num_blocks * bs
    ours = b.generate(prompt, greedy)[0]
    ref = a.generate(prompt, greedy)[0]                           # A from its own cache
    assert ours.cached_tokens == ref.cached_tokens == kv.num_blocks * bs
    assert ours.token_ids == ref.token_ids
    stats = b.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    with pytest.raises(ValueError, match=f"cannot enter a cache of {bs}"):
        b.engine.kv_transfer.adopt(type(kv)(kv.token_ids[:8], 8, kv.parts))


def test_a_transfer_without_room_waits_for_it_then_gives_up():
    """The decode side's import is retried while the pool is short; past the wait, the prompt is
    computed there instead (0 tokens imported); a transfer that never comes is a 503."""
    import asyncio
    from concurrent.futures import Future

    from phasewise.server.disaggregation import DisaggregatedPair
    from phasewise.server.api_error import APIError

    class Engine:                         # what DisaggregatedPair uses of AsyncEngine, LLMEngine and KVTransfer
        def __init__(self, short: int, arrives: bool = True):
            self.short, self.arrives, self.kv_transfer = short, arrives, self
            self.tries = 0

        async def call(self, fn):
            return fn(self)

        def expect(self, transfer_id):
            f = Future()
            f.set_result("blocks") if self.arrives else f.set_exception(ConnectionError("the link is down"))
            return f

        def adopt(self, kv, salt=None):
            self.tries += 1
            if self.tries <= self.short:
                raise ValueError("no room")
            return 32

        def forget(self, transfer_id):
            pass

    waits = Engine(short=3)
    assert asyncio.run(DisaggregatedPair(waits, room_wait_s=5).receive("t")) == 32 and waits.tries == 4
    gives_up = Engine(short=10**9)
    assert asyncio.run(DisaggregatedPair(gives_up, room_wait_s=0.2).receive("t")) == 0 and gives_up.tries > 1
    with pytest.raises(APIError, match="did not arrive: the link is down"):
        asyncio.run(DisaggregatedPair(Engine(0, arrives=False)).receive("t"))


LINK_ALONE = """
import socket
import pytest
from phasewise.distributed.kv_link import KVLink

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
link = KVLink("prefill", f"tcp://127.0.0.1:{port}", timeout_s=1.0)   # nobody joins: init times out
pending = link.send("early", ([1, 2], 2, {}))
with pytest.raises(ConnectionError, match="KV link to the decode instance failed"):
    pending.result(timeout=60)
with pytest.raises(ConnectionError):
    link.send("late", ([1, 2], 2, {})).result(timeout=1)
with pytest.raises(ConnectionError):
    link.expect("late").result(timeout=1)
print("ok")
"""


def test_a_kv_link_whose_peer_is_gone_fails_every_transfer_at_once():
    """Once the link has failed (here: its peer never came), sends and waits fail immediately instead
    of waiting for their timeout. In a process of its own: the link takes torch.distributed's
    default group, which must stay free in this one (the TP tests use it)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", LINK_ALONE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


LINK_PAIR = """
import os
import sys
from pathlib import Path
import torch
from phasewise.distributed.kv_link import KVLink
from phasewise.loading.loader import load_config
from phasewise.runner.kv_cache import INT4, KVCache

role, port, model = sys.argv[1], sys.argv[2], Path(sys.argv[3])
dtype = INT4 if sys.argv[4] == "int4" else getattr(torch, sys.argv[4])
bs = 64 if dtype == INT4 else 16                 # an int4 cache's key groups are 64 tokens
cache = KVCache(load_config(model), 4, bs, dtype, "cpu", num_tail_slots=2)
g = torch.Generator().manual_seed(0)


def noise(t):    # random codes (int8, or int4's two nibbles a byte) and scales
    if t.dtype in (torch.int8, torch.uint8):
        low, high = (-127, 128) if t.dtype == torch.int8 else (0, 256)
        return torch.randint(low, high, t.shape, generator=g, dtype=t.dtype)
    return torch.randn(t.shape, generator=g, dtype=t.dtype)


cache.write_blocks([0, 1, 2, 3], {n: noise(t) for n, t in cache.read_blocks([0, 1, 2, 3]).items()})
parts = cache.read_blocks([1, 3])
link = KVLink(role, f"tcp://127.0.0.1:{port}", timeout_s=60)
if role == "prefill":
    link.send("t", (list(range(2 * bs)), bs, parts)).result(timeout=60)
else:
    tokens, block_size, got = link.expect("t").result(timeout=60)
    assert tokens == list(range(2 * bs)) and block_size == bs, (tokens, block_size)
    assert got.keys() == parts.keys(), (sorted(got), sorted(parts))
    assert all(got[n].dtype == parts[n].dtype and torch.equal(got[n], parts[n]) for n in parts)
print("ok", sorted(parts), flush=True)
os._exit(0)                                  # the link's threads stay in gloo calls: no interpreter teardown
"""


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_every_part_of_a_kv_cache_crosses_the_link(default_model_path, dtype):
    """A prefill process sends two blocks of a cache of this dtype (an int8 or int4 cache has K group scales
    and V scales besides the codes) and the decode process receives every part, bit for bit. Each in a process of
    its own (the link takes torch.distributed's default group)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", LINK_PAIR, role, port, str(default_model_path), dtype],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role in ("decode", "prefill")]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.startswith("ok"), err[-2000:]
    assert ("k_groups" in outs[0][0]) == (dtype != "float32")
