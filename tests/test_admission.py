"""The one admission rule (engine/admission.py) over a real engine core's limits: what it refuses, with
the field at fault, and the max_tokens it gives a request that names none (the most the pool holds)."""

from __future__ import annotations

import pytest
from test_engine_core import make_core

from phasewise.engine.admission import Admission, ContextLengthError, RequestError
from phasewise.core.sampling_params import SamplingParams


def admission(num_blocks: int = 64, max_len: int = 32, vocab: int = 1000) -> Admission:
    core, _ = make_core(num_blocks=num_blocks, max_len=max_len)            # blocks of 4 tokens
    return Admission(max_len, vocab, num_blocks, core.blocks_needed)


@pytest.mark.parametrize("ids,params,error,param,words", [
    ([], SamplingParams(max_tokens=1), RequestError, "prompt", "empty"),
    ([5, 1000], SamplingParams(max_tokens=1), RequestError, "prompt", "token id 1000"),
    ([5, -1], SamplingParams(max_tokens=1), RequestError, "prompt", "token id -1"),
    ([5], SamplingParams(max_tokens=1, stop_token_ids=[1000]), RequestError, "stop_token_ids", "1000"),
    (list(range(32)), SamplingParams(max_tokens=1), ContextLengthError, "prompt", "32 tokens"),
    (list(range(30)), SamplingParams(max_tokens=3), ContextLengthError, "max_tokens", "33 were requested"),
])
def test_what_it_refuses_names_the_field(ids, params, error, param, words):
    with pytest.raises(error, match=words) as e:
        admission().check(ids, params)
    assert e.value.param == param


def test_the_pool_bounds_a_request_at_its_longest():
    small = admission(num_blocks=5, max_len=512)                            # 20 tokens
    assert small.check(list(range(12)), SamplingParams(max_tokens=8)).max_tokens == 8
    with pytest.raises(RequestError, match="need 6 KV blocks, but the pool holds 5"):
        small.check(list(range(12)), SamplingParams(max_tokens=9))
    assert small.check(list(range(12)), SamplingParams(max_tokens=None)).max_tokens == 8   # as many as fit
    with pytest.raises(RequestError, match="raise the KV cache memory"):
        small.check(list(range(20)), SamplingParams(max_tokens=None))
    assert admission(max_len=32).check([1, 2], SamplingParams(max_tokens=None)).max_tokens == 30   # the context first
