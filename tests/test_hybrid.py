"""Hybrid models: Qwen3.5 (dense and MoE) and Qwen3-Next, Gated DeltaNet layers beside gated attention,
and LFM2, short convolutions beside attention, each recurrent layer with a state per sequence. Tiny
random models built with transformers' own classes give transformers' logits and greedy tokens in
fp32, alone, batched, chunked, preempted and with few state slots."""

from __future__ import annotations

import pytest
import torch
from conftest import PagedRunner, bind
from model_builders import assert_logits_close, build_hf, check_against_hf, hf_reference, prompt_ids, with_tokenizer

from phasewise.core.kv_cache_manager import KVCacheManager
from phasewise.core.request import Request
from phasewise.core.sampling_params import SamplingParams
from phasewise.layers.gated_delta import causal_conv, gated_delta_rule, l2norm
from phasewise.loading.loader import load_model
from phasewise.loading.sharding import check_tensor_parallel

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, bos_token_id=None, eos_token_id=None)
SHAPE = dict(BASE, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CASES = {
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**SHAPE, intermediate_size=128),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**SHAPE, **EXPERTS),
    # layer 1's MLP dense (mlp_only_layers), the others experts with a shared expert; top-k weights as they are
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**SHAPE, **EXPERTS, intermediate_size=96, mlp_only_layers=[1],
                                                       norm_topk_prob=False),
    # an MLP of 2/3 x 168 = 112, rounded up to 16: 112
    "lfm2": lambda: transformers.Lfm2Config(**BASE, intermediate_size=168, block_multiple_of=16, pad_token_id=None,
                                            layer_types=["conv", "conv", "conv", "full_attention"]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            hf_model = build_hf(CASES[case](), seed=3)
            folder = tmp_path_factory.mktemp(case)
            hf_model.save_pretrained(folder)
            cache[case] = with_tokenizer(folder), hf_model
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [None, 5, 1])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_hf_folder_matches_transformers_teacher_forced_and_greedy(case, chunk, kernels, folders, request):
    """The model's Python layers, on the PyTorch reference paths or with the kernels bound (the DeltaNet's
    delta_net_mix among them), give transformers' prompt logits and greedy tokens, whole or chunked."""
    folder, hf_model = folders(case)
    prompt = prompt_ids(256, 19, seed=2)
    model, cfg = load_model(folder)
    assert cfg.recurrent_layers == (0, 1, 2) and cfg.kv_groups == ((3,),)
    assert cfg.rotary_dim == (None if case == "lfm2" else 4)
    if kernels:
        bind(model, request.getfixturevalue("chosen_ops"))
    mixers = [getattr(layer, "linear_attn", None) or layer.conv for layer in model.model.layers[:3]]
    assert all((getattr(m, "kernels", None) is not None) == kernels for m in mixers if case != "lfm2")
    with torch.no_grad():
        ref_logits, ref_tokens = hf_reference(hf_model, prompt, 12)
    logits, tokens = PagedRunner(model).greedy(prompt, 12, chunk=chunk)
    assert_logits_close(logits, ref_logits)
    assert tokens == ref_tokens


def test_the_recurrent_functions_match_transformers():
    """The delta rule from a state, token by token, against transformers' recurrent function; the conv
    against torch's conv1d with the state as its left padding."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    g = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = 7, 2, 4, 8, 6
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v, beta = torch.randn(n, hv, dv, generator=g), torch.rand(n, hv, generator=g)
    decay, state = -torch.rand(n, hv, generator=g), torch.randn(hv, dk, dv, generator=g)
    ref, ref_state = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                                         initial_state=state[None].clone(), output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    ours_state = state.clone()
    ours = gated_delta_rule(l2norm(q) / dk ** 0.5, l2norm(k), v, decay, beta, ours_state)
    torch.testing.assert_close(ours, ref[0])
    torch.testing.assert_close(ours_state, ref_state[0])
    x, conv_state, w = torch.randn(n, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(5, 4, generator=g)
    want = torch.nn.functional.silu(torch.nn.functional.conv1d(torch.cat([conv_state, x]).T[None], w[:, None],
                                                               groups=5))[0].T
    kept = conv_state.clone()
    torch.testing.assert_close(causal_conv(x, kept, w), want)
    assert torch.equal(kept, x[-3:])
    from transformers.models.lfm2 import modeling_lfm2 as lfm2          # LFM2's conv: no activation
    hf_state = torch.cat([torch.zeros(5, 1), conv_state.T], 1)[None]     # transformers keeps K inputs, we K - 1
    want = lfm2.causal_conv1d_update(x.T[None].contiguous(), hf_state, w)[0].T
    kept = conv_state.clone()
    torch.testing.assert_close(causal_conv(x, kept, w, silu=False), want)
    assert torch.equal(kept, hf_state[0, :, 1:].T)


def test_an_lfm2_config_reads_as_transformers_reads_it():
    """LFM2's published config.json keys (block_ff_dim, tie_embedding, full_attn_idxs, rope_theta): the
    MLP width by transformers' rule, tied embeddings, its attention layers and RoPE base."""
    from transformers.models.lfm2 import modeling_lfm2 as lfm2

    from phasewise.models.config import ModelConfig

    published = dict(model_type="lfm2", vocab_size=65536, hidden_size=2048, block_ff_dim=12288,
                     block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, norm_eps=1e-5,
                     conv_L_cache=3, full_attn_idxs=[2, 5, 8, 10, 12, 14], tie_embedding=True,
                     rope_theta=1000000.0, max_position_embeddings=128000)
    cfg = ModelConfig.from_hf(published)
    with torch.device("meta"):
        width = lfm2.Lfm2MLP(transformers.Lfm2Config(**published)).w1.out_features
    assert cfg.intermediate_size == width == 8192 and cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-5
    assert cfg.attention_layers == (2, 5, 8, 10, 12, 14) and cfg.rope_theta == 1e6 and cfg.head_dim == 64
    assert cfg.state_bytes_per_seq == 10 * 2 * 2048 * 4                 # 10 conv layers x [L - 1, H] fp32


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_gives_the_same_tokens_alone_batched_chunked_and_preempted(case, folders):
    """Every request holds a state slot while it runs: alone, batched, in chunks of 3, with one state slot
    for three requests, and preempted for blocks, it gives transformers' greedy tokens."""
    from phasewise import LLM

    folder, hf_model = folders(case)
    prompts = [prompt_ids(256, 13, seed=7), prompt_ids(256, 9, seed=8), prompt_ids(256, 21, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with torch.no_grad():
        want = [hf_model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    kw = dict(model=str(folder), dtype="fp32", kv_dtype="model", warmup=False)
    llm = LLM(**kw, kv_cache_memory=0.01)
    assert llm.engine.core.kv.num_state_slots > 3 and llm.engine.core.kv.checkpoints is not None
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert [llm.generate(p, params)[0].token_ids for p in prompts] == want
    chunked = LLM(**kw, kv_cache_memory=0.01, max_num_batched_tokens=3)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == want
    one_slot = LLM(**kw, kv_cache_memory=0.01, max_num_seqs=1)
    assert one_slot.engine.core.kv.num_state_slots == 1
    assert [o.token_ids for o in one_slot.generate(prompts, params)] == want
    tight = LLM(**kw, num_blocks=9, block_size=4)    # two requests outgrow 9 blocks of 4 tokens: preemptions
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert tight.engine.core.kv.free_state_slots and len(tight.engine.core.kv.free_state_slots) == \
        tight.engine.core.kv.num_state_slots                      # every slot back
    from phasewise.server.metrics import ServerMetrics
    from phasewise.server.server_stats import ServerStats

    stats = llm.engine.core.stats()                               # what /metrics and the dashboard show
    assert stats.num_state_slots == stats.num_free_state_slots > 3 and stats.num_state_checkpoints > 0
    scraped = ServerMetrics("m").render(ServerStats(engine=stats)).decode()
    assert f'phasewise:recurrent_state_slots{{model_name="m"}} {float(stats.num_state_slots)}' in scraped
    assert 'phasewise:recurrent_state_slots_used{model_name="m"} 0.0' in scraped


def test_state_slots_are_taken_with_the_first_blocks_and_given_back():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_state_slots=2)
    reqs = [Request(str(i), list(range(6)), SamplingParams()) for i in range(3)]
    assert kv.allocate_slots(reqs[0], 6) and kv.allocate_slots(reqs[1], 6)
    assert {reqs[0].state_slot, reqs[1].state_slot} == {0, 1}
    assert not kv.allocate_slots(reqs[2], 6) and reqs[2].state_slot is None and kv.pool.num_free == 4
    assert kv.allocate_slots(reqs[0], 1)                        # a request keeps its slot as it grows
    kv.free(reqs[1])
    assert reqs[1].state_slot is None and kv.allocate_slots(reqs[2], 6) and reqs[2].state_slot == 1
    assert kv.get_computed_blocks(reqs[2]) == [[]]             # no prefix hits without state checkpoints


def test_a_prefix_hit_resumes_from_the_state_checkpoint_where_it_ends():
    """A hybrid's state is saved where its computed tokens reach a block boundary; a later request with
    that prefix takes the blocks up to the last boundary with a checkpoint and restores it; saves are
    copied before restores, and the oldest checkpoint gives way."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_state_slots=2, num_state_checkpoints=2)
    a = Request("a", list(range(11)), SamplingParams())
    assert kv.prompt_boundary(a) == 8
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.commit(a)                                                # at a boundary: saved to checkpoint slot 2
    assert kv.take_state_copies() == [(a.state_slot, 2)]
    b = Request("b", list(range(10)) + [99, 98], SamplingParams())
    hits = kv.get_computed_blocks(b)
    assert hits == [a.block_tables[0][:2]]                     # 8 tokens: the checkpointed prefix
    assert kv.allocate_slots(b, 4, hits) and b.state_slot == 1
    assert kv.take_state_copies() == [(2, 1)]                  # restored into b's slot
    for n, start in ((12, 3), (16, 4)):                        # two more prefixes: the oldest gives way
        c = Request(f"c{n}", [start] * n, SamplingParams())
        kv.free(b) if b.state_slot is not None else None
        assert kv.allocate_slots(c, n)
        c.num_computed_tokens = n
        kv.commit(c)
        kv.free(c)
    assert kv.get_computed_blocks(Request("a2", list(range(11)), SamplingParams())) == [[]]
    assert len(kv.checkpoints.entries) == 2 and sorted(s for _, s in kv.checkpoints.entries.values()) == [2, 3]


@pytest.mark.parametrize("case", list(CASES))
def test_prefix_hits_and_later_turns_give_the_tokens_of_a_cold_run(case, folders):
    """The same prompt again, and a second turn (the first turn's prompt and reply, then more), hit the
    prefix cache through a state checkpoint and give the tokens of an engine without prefix caching,
    whatever the chunk budget."""
    from phasewise import LLM

    folder, _ = folders(case)
    first = prompt_ids(256, 22, seed=11)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    kw = dict(model=str(folder), dtype="fp32", kv_dtype="model", warmup=False, kv_cache_memory=0.01, block_size=4)
    cold = LLM(**kw, enable_prefix_caching=False)
    reply = cold.generate(first, params)[0].token_ids
    second = first + reply + prompt_ids(256, 6, seed=12)
    want = [reply, cold.generate(second, params)[0].token_ids]
    for budget in (512, 5):
        llm = LLM(**kw, max_num_batched_tokens=budget)
        outs = [llm.generate(first, params)[0], llm.generate(first, params)[0], llm.generate(second, params)[0]]
        assert [o.token_ids for o in outs] == [want[0], want[0], want[1]], budget
        assert [o.cached_tokens for o in outs] == [0, 20, 28], budget


def test_what_does_not_run_on_hybrids_yet_says_so(folders, default_model_path):
    from phasewise import LLM

    folder, _ = folders("qwen3_5")
    _, cfg = load_model(folder)
    with pytest.raises(ValueError, match="hybrid with recurrent layers"):
        check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match="hybrid draft model .* needs a hybrid target"):
        LLM(model=str(default_model_path), speculative=f"draft:{folder}", warmup=False)


def test_ngram_speculation_rolls_the_state_back_to_the_last_accepted_draft(tmp_path):
    """Models made to repeat themselves (the output head is the embedding, the mixers' outputs damped) draw
    n-gram drafts, some accepted and some not: a verify step keeps the state after each draft row in a
    snapshot slot and goes back to the last accepted one, so the greedy tokens are transformers', alone,
    batched and chunked."""
    from phasewise import LLM

    prompts = [prompt_ids(256, 5, seed=s) * 4 for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    drafted = accepted = 0
    for case in CASES:
        hf_model = build_hf(CASES[case](), seed=3)
        with torch.no_grad():
            hf_model.lm_head.weight.copy_(hf_model.model.embed_tokens.weight * 0.5)
            for name, p in hf_model.named_parameters():
                if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "w2.weight")):
                    p.mul_(0.3)
            want = [hf_model.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        hf_model.save_pretrained(tmp_path / case)
        kw = dict(model=str(with_tokenizer(tmp_path / case)), dtype="fp32", kv_dtype="model", warmup=False,
                  kv_cache_memory=0.01, speculative="ngram", num_speculative_tokens=3)
        llm = LLM(**kw)
        assert len(llm.engine.core.runner.snapshot_slots) == 3 * llm.engine.core.kv.num_state_slots
        assert [o.token_ids for o in llm.generate(prompts, params)] == want, case
        assert [llm.generate(p, params)[0].token_ids for p in prompts] == want, case
        assert [o.token_ids for o in LLM(**kw, max_num_batched_tokens=7).generate(prompts, params)] == want, case
        drafted, accepted = drafted + llm.engine.core.spec.num_draft_tokens, accepted + llm.engine.core.spec.num_accepted_tokens
    assert 0 < accepted < drafted                                   # drafts taken and drafts refused


@pytest.mark.parametrize("case,q8_rows", [(c, False) for c in CASES] + [("qwen3_5", True), ("qwen3_5_moe", True)])
def test_a_gguf_as_llama_cpp_writes_it_gives_transformers_tokens(case, q8_rows, tmp_path):
    """`qwen35`/`qwen35moe` (norms + 1, -exp(A_log), v heads tiled, an MTP layer after the model's),
    `qwen3next` (q, k, v, z ungrouped, b and a grouped) and `lfm2` (KV heads per layer) files give
    transformers' logits and greedy tokens, chunked or not; with Q8_0 rows, also as q4 (the file's
    blocks) within quantization's error of fp32."""
    from hybrid_gguf import write_hybrid_gguf

    hf_model = build_hf(CASES[case](), seed=5)
    path = tmp_path / f"{case}.gguf"
    write_hybrid_gguf(path, hf_model, q8_rows=q8_rows)
    model, cfg = load_model(path)
    assert cfg.architecture == case and cfg.num_layers == 4 and cfg.recurrent_layers == (0, 1, 2)
    assert getattr(cfg.recurrent, "tiled_v_heads", False) == case.startswith("qwen3_5")
    prompt = prompt_ids(256, 17, seed=4)
    for chunk in (None, 4):
        check_against_hf(path, hf_model, prompt, n=8, chunk=chunk)
    if q8_rows:                      # q4 keeps the file's Q8_0 rows, in the file's (tiled) order
        from phasewise.layers.linear import Linear

        q4, _ = load_model(path, dtype="q4", packed_cache=False)
        formats = {n.split(".", 3)[-1]: "+".join(p.fmt for p in m.packed.parts)
                   for n, m in q4.named_modules() if isinstance(m, Linear) and ".0." in n and m.packed}
        assert formats["linear_attn.in_proj_qkv"] == formats["linear_attn.in_proj_z"] == "q8"
        want, got = PagedRunner(model).forward(prompt, 0), PagedRunner(q4).forward(prompt, 0)
        assert (got - want).norm() < 0.1 * want.norm()
