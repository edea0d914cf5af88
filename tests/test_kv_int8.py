"""The int8 KV cache on the default model: teacher-forced quality against the fp32 cache, and the engine."""

from __future__ import annotations

import math

import pytest
import torch

from phasewise.layers.attention import AttentionMetadata
from phasewise.runner.kv_cache import KVCache, kv_bytes_per_token
from tests.conftest import bind

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
        "the great lens, and wound the clockwork that turned the light. Ships far out at sea counted the "
        "flashes and knew where they were: three short flashes and a long one meant the northern cape, and "
        "the rocks beneath it. In winter storms he stayed awake all night, listening to the waves break "
        "against the tower and watching for the lanterns of fishing boats making for the harbour.")


@torch.inference_mode()
def teacher_forced_logits(model, ids: list[int], kv_dtype: torch.dtype, chunk: int = 8) -> torch.Tensor:
    """Logits [len(ids), V], computed in chunks so that each chunk reads the earlier ones from the cache."""
    cache = KVCache(model.config, 32, 16, kv_dtype, "cpu")
    table = list(range(32))
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        n = len(piece)
        meta = AttentionMetadata.build([n], [start + n], [table], 16, torch.device("cpu"))
        hidden = model(torch.tensor(piece), torch.arange(start, start + n), meta, cache.layers)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "reference"])
def test_int8_kv_keeps_quality_teacher_forced(llm, chosen_ops, compiled):
    model = llm.engine.model
    ids = llm.tokenizer.encode(TEXT * 3)           # 285 tokens, the first 95 repeated
    saved = model.model.norm.kernels
    bind(model, chosen_ops if compiled else None)
    try:
        ref = teacher_forced_logits(model, ids, torch.float32)
        q8 = teacher_forced_logits(model, ids, torch.int8)
    finally:
        bind(model, saved)
    agree = (ref.argmax(-1) == q8.argmax(-1)).float().mean().item()
    ppl_ref, ppl_q8 = perplexity(ref, ids), perplexity(q8, ids)
    assert agree >= 0.97, agree                      # measured: 0.989 (kernel), 0.993 (reference)
    assert abs(ppl_q8 / ppl_ref - 1) < 0.01, (ppl_ref, ppl_q8)   # measured: +0.16%, +0.25%


def test_int8_pool_is_sized_with_its_scales(default_model_path):
    from phasewise.loading.loader import load_config

    cfg = load_config(default_model_path)
    fp32, int8 = kv_bytes_per_token(cfg, torch.float32), kv_bytes_per_token(cfg, torch.int8)
    assert fp32 == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert int8 == cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim + 4 + cfg.head_dim // 2)


@pytest.mark.slow
def test_engine_with_an_int8_kv_cache_generates_and_frees_everything():
    from phasewise import LLM, SamplingParams

    llm = LLM(dtype="fp32", kv_cache_memory=0.05, kv_dtype="int8", warmup=False)
    assert llm.engine.kv_cache.data.dtype == torch.int8
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([TEXT, "Once upon a time", TEXT[:80]], params)
    assert [len(o.token_ids) for o in outs] == [24, 24, 24]
    assert llm.engine.core.kv.pool.num_free == llm.engine.core.kv.pool.num_blocks
    with pytest.raises(ValueError, match="kv_dtype"):
        LLM(kv_dtype="fp8", warmup=False)


@pytest.mark.slow
def test_speculation_batching_preemption_and_prefix_hits_keep_greedy_tokens_exactly():
    """With the file's blocks (a row's bits independent of its batch) and the int8 KV cache, greedy tokens
    are the same alone, batched under preemption with prefix hits, and with drafts verified in runs (a
    group filled by rejected drafts quantized again), token for token: every row reads the groups below
    its length as int8 and its own group as floats, whichever rows share its step."""
    from phasewise import LLM, SamplingParams
    from phasewise.config import SpeculativeConfig

    prompts = [f"{TEXT} Repeat the first sentence of this text twice, then say what {t} means."
               for t in ("dusk", "a wick", "a cape", "a harbour", "clockwork")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(kv_dtype="int8", enable_prefix_caching=False, kv_cache_memory=0.05, warmup=False)
    assert (plain.engine.precision.weights, plain.engine.kv_cache.dtype) == ("q4", torch.int8)
    alone = [plain.generate(p, params)[0].token_ids for p in prompts]
    spec = SpeculativeConfig.parse("ngram", num_speculative_tokens=7, adaptive=False)
    busy = LLM(kv_dtype="int8", speculative=spec, num_blocks=16, warmup=False)   # must preempt
    busy.generate(prompts[0], params)                                              # the shared text, cached
    outs = busy.generate(prompts, params)
    assert sum(o.metrics.preemptions for o in outs) > 0 and sum(o.cached_tokens for o in outs) > 0
    assert sum(o.metrics.spec_accepted_tokens for o in outs) > 0
    assert [o.token_ids for o in outs] == alone


def test_int8_blocks_copy_whole_between_caches_and_as_bytes(default_model_path):
    """What the prefix cache's disk tier and disaggregation copy of an int8 cache: every part of a block
    (codes, K's group scales, V's scales), whole, in and out; another layout's bytes are refused."""
    from phasewise.loading.loader import load_config
    from phasewise.runner.kv_cache import KVBlocks

    cfg = load_config(default_model_path)
    a, b = KVCache(cfg, 6, 32, torch.int8, "cpu"), KVCache(cfg, 6, 32, torch.int8, "cpu")
    g = torch.Generator().manual_seed(0)
    a.data.copy_(torch.randint(-127, 128, a.data.shape, generator=g, dtype=torch.int8))
    a.k_groups.normal_(generator=g)
    a.v_scale.uniform_(generator=g)
    parts = a.read_blocks([1, 4])
    assert parts["k_groups"].shape[2] == 2 * 32 // 16 and parts["v_scale"].shape[2] == 2 * 32
    b.write_blocks([3, 0], parts)
    for t, u in ((a.data, b.data), (a.k_groups, b.k_groups), (a.v_scale, b.v_scale)):
        per = t.shape[2] // 6
        assert torch.equal(t[:, :, per:2 * per], u[:, :, 3 * per:4 * per])
        assert torch.equal(t[:, :, 4 * per:5 * per], u[:, :, :per])
    one = KVBlocks(list(range(64)), 32, parts).block(1)
    assert all(torch.equal(one[name], t) for name, t in a.read_blocks([4]).items())
    c = KVCache(cfg, 6, 32, torch.int8, "cpu")
    c.fill([5], a.copy_out([2]))
    assert c.read_blocks([5]).keys() == a.read_blocks([2]).keys()
    assert all(torch.equal(c.read_blocks([5])[n], t) for n, t in a.read_blocks([2]).items())
    assert "k_groups:torch.float32" in a.block_layout and a.block_layout != KVCache(cfg, 6, 32, torch.float32,
                                                                                      "cpu").block_layout
    with pytest.raises(ValueError, match="bytes"):
        c.fill([0], KVCache(cfg, 6, 32, torch.float32, "cpu").copy_out([0]))
