"""PrefixAffinityRouter's home of a new prefix (rendezvous hashing), without a cluster: every router
computes the same home whatever order it lists the replicas in, and a replica that leaves moves only
the prefixes whose home it was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.ray
pytest.importorskip("ray.serve", reason="Ray is not installed (make test-ray)")

from phasewise.deploy.prefix_router import _home, prompt_block_hashes  # noqa: E402


def _replica(uid: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid))


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.text("abcdefgh0123", min_size=4, max_size=8), min_size=2, max_size=8, unique=True),
       prompts=st.lists(st.text(min_size=64, max_size=600), min_size=1, max_size=20), data=st.data())
def test_a_prefix_has_one_home_for_every_router_and_moves_only_with_its_replica(ids, prompts, data):
    replicas = [_replica(i) for i in ids]
    shuffled = data.draw(st.permutations(replicas))
    gone = data.draw(st.sampled_from(replicas))
    rest = [r for r in replicas if r is not gone]
    for prompt in prompts:
        hashes = prompt_block_hashes({"prompt": prompt})
        home = _home(replicas, hashes)
        assert _home(shuffled, hashes) is home
        if home is not gone:
            assert _home(rest, hashes) is home


def test_prompts_sharing_their_first_four_blocks_share_a_home():
    replicas = [_replica(f"r{i}") for i in range(8)]
    system = "You are a careful assistant who answers in one sentence. " * 6      # > 4 blocks of 64 characters
    homes = {_home(replicas, prompt_block_hashes({"messages": [{"role": "system", "content": system},
                                                             {"role": "user", "content": f"Question {q}?"}]})).replica_id.unique_id
             for q in range(20)}
    assert len(homes) == 1


def test_a_prompt_cache_key_or_salt_roots_the_chain():
    """One session's (or tenant's) requests share their hashes; another key's never meet them."""
    text = "The same long system prompt that every session sends first, word for word. " * 4
    plain = prompt_block_hashes({"prompt": text})
    mine = prompt_block_hashes({"prompt": text, "prompt_cache_key": "session-1"})
    assert len(mine) == len(plain) >= 4
    assert mine == prompt_block_hashes({"prompt": text + " more", "prompt_cache_key": "session-1"})[:len(mine)]
    others = [prompt_block_hashes({"prompt": text, "prompt_cache_key": "session-2"}),
              prompt_block_hashes({"prompt": text, "cache_salt": "session-1"}), plain]
    assert all(not set(mine) & set(other) for other in others)
