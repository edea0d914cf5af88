"""Hybrid models in the C++ decoder stack (Gated DeltaNet and LFM2's short conv layers over state slots,
Qwen3.5's gated attention with partial RoPE) against the same models' Python layers on the same ops:
every step's logits, the states they leave, and a verify step's state snapshots."""

from __future__ import annotations

import pytest
import torch
from model_builders import build_hf

from phasewise.layers.attention import AttentionMetadata
from phasewise.loading.loader import choose_weight_forms, load_model
from phasewise.runner.kv_cache import KVCache
from tests.conftest import assert_paths_agree, bind
from tests.test_hybrid import CASES

pytestmark = pytest.mark.slow

SLOTS = [3, 0, 5]                 # the three sequences' state slots (of 8); snapshots go to 1, 2 and 4
NONE = torch.tensor([], dtype=torch.int64)
# (new tokens per sequence, rows kept, state snapshots): a batched prefill, decodes, a chunk, a step whose
# rows are all dropped, a verify step (sequence 0's first two rows snapshotted, sequence 2's one), a decode
STEPS = [([37, 5, 20], torch.tensor([36, 41, 61]), None), ([1, 1, 1], None, None), ([1, 1, 1], None, None),
         ([4, 1, 1], None, None), ([1, 1, 1], NONE, None), ([3, 1, 1], None, [[1, 2], [], [4]]),
         ([1, 1, 1], None, None)]


@pytest.fixture(scope="module", params=list(CASES))
def int8_hybrid(request, tmp_path_factory):
    """A tiny random hybrid of the family, its linear layers int8."""
    folder, config = tmp_path_factory.mktemp(request.param), CASES[request.param]()
    if hasattr(config, "shared_expert_intermediate_size"):
        config.shared_expert_intermediate_size = 64        # int8 rows: a multiple of 32 wide
    if request.param == "lfm2":
        config.intermediate_size, config.block_multiple_of = 192, 32    # an MLP 2/3 x 192 = 128 wide
    build_hf(config, seed=7).save_pretrained(folder)
    model, _ = load_model(folder, "int8")
    return model


@torch.inference_mode()
def run_hybrid_steps(model, use_stack: bool, kv_dtype: torch.dtype = torch.float32
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three sequences through STEPS: each step's logits, then every recurrent state tensor."""
    stack = model.model.stack
    model.model.stack = stack if use_stack else None
    try:
        cfg, bs = model.config, 16
        cache = KVCache(cfg, 12, bs, kv_dtype, "cpu", num_state_slots=8)
        for layer in cache.states:
            for t in layer:
                t.fill_(float("nan"))      # a starting sequence's slot is zeroed by the step, never read as is
        tables = [[list(range(4 * s, 4 * s + 4)) for s in range(3)]]
        g = torch.Generator().manual_seed(0)
        lens, out = [0, 0, 0], []
        for query, keep, snapshots in STEPS:
            new = torch.randint(0, cfg.vocab_size, (sum(query),), generator=g)
            pos = torch.cat([torch.arange(n, n + q) for n, q in zip(lens, query)])
            lens = [n + q for n, q in zip(lens, query)]
            meta = AttentionMetadata.build_groups(query, lens, tables, bs, torch.device("cpu"))
            meta.state_slots, meta.state_snapshots = SLOTS, snapshots
            out.append(model.compute_logits(model(new, pos, meta, cache.layers, keep)))
        return out, [t.clone() for layer in cache.states for t in layer]
    finally:
        model.model.stack = stack


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["fp32-kv", "int8-kv"])
def test_hybrid_stack_matches_the_python_layers(int8_hybrid, ops, kv_dtype):
    model = int8_hybrid
    choose_weight_forms(model, "cpu", torch.float32, ops)
    bind(model, ops)
    assert model.model.stack is not None, "no decoder stack for the hybrid"
    fast, fast_states = run_hybrid_steps(model, use_stack=True, kv_dtype=kv_dtype)
    ref, ref_states = run_hybrid_steps(model, use_stack=False, kv_dtype=kv_dtype)
    for a, b in zip(fast, ref):
        assert_paths_agree(a, b)
    for a, b in zip(fast_states, ref_states):
        assert_paths_agree(a, b, "states")
        assert torch.equal(a.isnan(), b.isnan())              # the same slots written
    snapped = torch.tensor([1, 2, 4])
    assert not fast_states[0][snapped].isnan().any()             # the verify step's snapshots were written


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_on_the_stack_gives_the_python_layers_tokens(case, tmp_path):
    """An int8 hybrid served by the engine runs on the stack (chosen once, at build): alone, batched, in
    chunks of 3, preempted, after prefix hits, under n-gram speculation (the stack's verify steps
    snapshot the states) and drafted by itself in q4 (a hybrid draft) it gives the greedy tokens of its
    Python layers on the same kernels. The model
    is made to repeat itself (output head = embedding, mixers damped) so drafts are taken and refused."""
    from model_builders import with_tokenizer

    from phasewise import LLM
    from phasewise.config import SpeculativeConfig
    from phasewise.core.sampling_params import SamplingParams
    from tests.conftest import PagedRunner

    config = CASES[case]()
    if hasattr(config, "shared_expert_intermediate_size"):
        config.shared_expert_intermediate_size = 64
    if case == "lfm2":
        config.intermediate_size, config.block_multiple_of = 192, 32
    hf_model = build_hf(config, seed=3)
    with torch.no_grad():
        hf_model.lm_head.weight.copy_(hf_model.model.embed_tokens.weight * 0.5)
        for name, p in hf_model.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "w2.weight")):
                p.mul_(0.6 if case == "lfm2" else 0.3)     # (LFM2 at 0.3 copies its drafts perfectly)
    hf_model.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (5,), generator=g).tolist() * 4 for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(model=str(with_tokenizer(tmp_path)), quantization="int8", kv_dtype="model", warmup=False,
              kv_cache_memory=0.01, block_size=4)
    llm = LLM(**kw)
    model = llm.engine.core.runner.model
    assert model.model.stack is not None, "the engine's hybrid is not on the stack"
    stack, model.model.stack = model.model.stack, None
    want = [PagedRunner(model).greedy(p, 20)[1] for p in prompts]         # the Python layers
    model.model.stack = stack
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert [llm.generate(p, params)[0].token_ids for p in prompts] == want      # prefix hits now
    assert llm.generate(prompts[0], params)[0].cached_tokens > 0
    assert [o.token_ids for o in LLM(**kw, max_num_batched_tokens=3).generate(prompts, params)] == want
    tight = LLM(**kw, num_blocks=14)
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == want and sum(o.metrics.preemptions for o in outs) > 0
    fixed = dict(num_speculative_tokens=3, adaptive=False)        # every decode drafts: rollbacks happen
    spec = LLM(**kw, speculative=SpeculativeConfig.parse("ngram", **fixed))
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    drafted, accepted = spec.engine.core.spec.num_draft_tokens, spec.engine.core.spec.num_accepted_tokens
    assert 0 < accepted < drafted
    draft = LLM(**kw, speculative=SpeculativeConfig.parse("draft", **fixed))   # itself in q4: states roll back too
    assert [o.token_ids for o in draft.generate(prompts, params)] == want
    assert [o.token_ids for o in draft.generate(prompts[:1], params)] == want[:1]
    assert draft.engine.core.spec.num_accepted_tokens > 0
