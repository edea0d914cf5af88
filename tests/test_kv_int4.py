"""The int4 KV cache on the default model: teacher-forced quality against the fp32 cache, its size, its
blocks as the prefix cache, disk tier and disaggregation copy them, and the engine (greedy tokens exact
under speculation, batching, preemption and prefix hits)."""

from __future__ import annotations

import pytest
import torch

from phasewise.layers.attention import AttentionMetadata
from phasewise.runner.kv_cache import INT4, KVBlocks, KVCache, kv_bytes_per_token
from tests.conftest import bind
from tests.test_kv_int8 import TEXT, perplexity


@torch.inference_mode()
def teacher_forced_logits(model, ids: list[int], kv_dtype: torch.dtype, chunk: int = 8) -> torch.Tensor:
    """Logits [len(ids), V] in chunks over blocks of 64, each chunk reading the earlier ones from the cache."""
    cache = KVCache(model.config, 8, 64, kv_dtype, "cpu")
    table = list(range(8))
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        n = len(piece)
        meta = AttentionMetadata.build([n], [start + n], [table], 64, torch.device("cpu"))
        hidden = model(torch.tensor(piece), torch.arange(start, start + n), meta, cache.layers)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "reference"])
def test_int4_kv_keeps_quality_teacher_forced(llm, chosen_ops, compiled):
    model = llm.engine.model
    ids = llm.tokenizer.encode(TEXT * 3)           # 285 tokens, the first 95 repeated
    saved = model.model.norm.kernels
    bind(model, chosen_ops if compiled else None)
    try:
        ref = teacher_forced_logits(model, ids, torch.float32)
        q4 = teacher_forced_logits(model, ids, INT4)
    finally:
        bind(model, saved)
    agree = (ref.argmax(-1) == q4.argmax(-1)).float().mean().item()
    ppl_ref, ppl_q4 = perplexity(ref, ids), perplexity(q4, ids)
    assert agree >= 0.9, agree
    assert abs(ppl_q4 / ppl_ref - 1) < 0.03, (ppl_ref, ppl_q4)


def test_int4_pool_holds_4_5_bits_a_value_and_twice_the_int8_tokens(default_model_path):
    from phasewise.loading.loader import load_config

    cfg = load_config(default_model_path)
    int8, int4 = kv_bytes_per_token(cfg, torch.int8), kv_bytes_per_token(cfg, INT4)
    assert int4 * 8 == cfg.num_layers * cfg.num_kv_heads * 2 * cfg.head_dim * 4.5
    assert int8 / int4 >= 1.9
    with pytest.raises(ValueError, match="multiple of 64"):
        KVCache(cfg, 4, 16, INT4, "cpu")


def test_int4_blocks_copy_whole_between_caches_and_as_bytes(default_model_path):
    """What the prefix cache's disk tier and disaggregation copy of an int4 cache: every part of a block
    (codes, K's group minimums and steps, V's scales), whole, in and out; another layout's bytes are refused."""
    from phasewise.loading.loader import load_config

    cfg = load_config(default_model_path)
    a, b = KVCache(cfg, 6, 128, INT4, "cpu"), KVCache(cfg, 6, 128, INT4, "cpu")
    g = torch.Generator().manual_seed(0)
    a.data.copy_(torch.randint(0, 256, a.data.shape, generator=g, dtype=torch.uint8))
    a.k_groups.copy_(torch.randn(a.k_groups.shape, generator=g))
    a.v_scale.copy_(torch.rand(a.v_scale.shape, generator=g))
    parts = a.read_blocks([1, 4])
    assert parts["k_groups"].shape[2] == 2 * 128 // 64 and parts["v_scale"].shape[2] == 2 * 128
    b.write_blocks([3, 0], parts)
    for t, u in ((a.data, b.data), (a.k_groups, b.k_groups), (a.v_scale, b.v_scale)):
        per = t.shape[2] // 6
        assert torch.equal(t[:, :, per:2 * per], u[:, :, 3 * per:4 * per])
        assert torch.equal(t[:, :, 4 * per:5 * per], u[:, :, :per])
    one = KVBlocks(list(range(256)), 128, parts).block(1)
    assert all(torch.equal(one[name], t) for name, t in a.read_blocks([4]).items())
    c = KVCache(cfg, 6, 128, INT4, "cpu")
    c.fill([5], a.copy_out([2]))
    assert all(torch.equal(c.read_blocks([5])[n], t) for n, t in a.read_blocks([2]).items())
    assert "k_groups:torch.float16" in a.block_layout
    assert a.block_layout != KVCache(cfg, 6, 128, torch.int8, "cpu").block_layout
    with pytest.raises(ValueError, match="bytes"):
        c.fill([0], KVCache(cfg, 6, 128, torch.int8, "cpu").copy_out([0]))


@pytest.mark.slow
def test_engine_with_an_int4_kv_cache_takes_blocks_of_64_generates_and_frees_everything():
    from phasewise import LLM, SamplingParams

    llm = LLM(kv_cache_memory=0.25, kv_dtype="int4", warmup=False)   # its tails: 2.9 MiB a running sequence
    assert (llm.engine.kv_cache.dtype, llm.engine.kv_cache.block_size) == (INT4, 64)
    assert "int4 KV cache" in llm.engine.precision.describe()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([TEXT, "Once upon a time", TEXT[:80]], params)
    assert [len(o.token_ids) for o in outs] == [24, 24, 24]
    assert llm.engine.core.kv.pool.num_free == llm.engine.core.kv.pool.num_blocks
    with pytest.raises(ValueError, match="block size of 48"):
        LLM(kv_dtype="int4", block_size=48, warmup=False)


@pytest.mark.slow
def test_speculation_batching_preemption_and_prefix_hits_keep_greedy_tokens_exactly():
    """With the file's blocks and the int4 KV cache, greedy tokens are the same alone, batched under
    preemption with prefix hits, and with drafts verified in runs, token for token: every row reads the
    groups below its length as int4 and its own group as floats, whichever rows share its step."""
    from phasewise import LLM, SamplingParams
    from phasewise.config import SpeculativeConfig

    prompts = [f"{TEXT} Repeat the first sentence of this text twice, then say what {t} means."
               for t in ("dusk", "a wick", "a cape", "a harbour", "clockwork")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(kv_dtype="int4", enable_prefix_caching=False, kv_cache_memory=0.25, warmup=False)
    assert (plain.engine.precision.weights, plain.engine.kv_cache.dtype) == ("q4", INT4)
    alone = [plain.generate(p, params)[0].token_ids for p in prompts]
    spec = SpeculativeConfig.parse("ngram", num_speculative_tokens=7, adaptive=False)
    busy = LLM(kv_dtype="int4", speculative=spec, num_blocks=6, warmup=False)     # must preempt
    busy.generate(prompts[0], params)                                              # the shared text, cached
    outs = busy.generate(prompts, params)
    assert sum(o.metrics.preemptions for o in outs) > 0 and sum(o.cached_tokens for o in outs) > 0
    assert sum(o.metrics.spec_accepted_tokens for o in outs) > 0
    assert [o.token_ids for o in outs] == alone
