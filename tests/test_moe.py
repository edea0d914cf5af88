"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): tiny random models from transformers'
own classes, saved as safetensors folders and written as GGUF files (F32, and Q8_0 experts), against
transformers in fp32 (their experts on the kernels: tests/test_expert_kernels.py): logits at every prompt position and the argmax there (teacher-forced), and
greedy tokens; the sparse block and its router against transformers' own modules (softmax, top-k
and its ties, renormalising, the shared expert's gate); the engine's greedy tokens alone, batched
and in chunks."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from conftest import PagedRunner
from model_builders import (QT, assert_logits_close, build_hf, check_against_hf, prompt_ids, with_tokenizer,
                            write_gguf)

from phasewise.loading.gguf import GGUFFile, ModelLoadError
from phasewise.loading.loader import load_model
from phasewise.loading.sharding import check_tensor_parallel
from phasewise.models.config import ModelConfig, UnsupportedModelError
from phasewise.models.moe import route
from phasewise.engine.precision import choose

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
TOP2 = dict(num_experts_per_tok=2)
# name → (transformers config class, GGUF architecture, llama.cpp permutes Q/K, config)
CASES = {
    # a dense layer among the sparse ones (mlp_only_layers), head size != hidden / heads, renormalised top-k
    # (llama.cpp renormalises Qwen3-MoE's always)
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3moe", False, dict(num_hidden_layers=3, num_experts=8, head_dim=32,
                                                             moe_intermediate_size=32, norm_topk_prob=True,
                                                             mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2moe", False, dict(num_experts=8, moe_intermediate_size=32,
                                                             shared_expert_intermediate_size=48)),
    "mixtral": ("MixtralConfig", "llama", True, dict(num_local_experts=8, intermediate_size=64)),
    "olmoe": ("OlmoeConfig", "olmoe", False, dict(num_experts=8, intermediate_size=64, clip_qkv=1.5)),
}


def hf_moe(case: str, seed: int = 0, **over):
    cls, _, _, kw = CASES[case]
    return build_hf(getattr(transformers, cls)(**{**BASE, **TOP2, **kw, **over}), seed=seed)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            hf_model = hf_moe(case, seed=5 + len(cache))
            folder = tmp_path_factory.mktemp(case)
            hf_model.save_pretrained(folder)
            cache[case] = folder, hf_model
        return cache[case]

    return get


@torch.no_grad()
def check_teacher_forced(path, hf_model, n: int = 16, chunk: int | None = None):
    """Logits at each of n prompt positions close to transformers', the same argmax at each; then 6
    greedy tokens as transformers generates them."""
    prompt = prompt_ids(256, n, seed=2)
    model, cfg = load_model(path)
    ref = hf_model(torch.tensor([prompt])).logits[0]
    logits, _ = PagedRunner(model).greedy(prompt, 1, chunk=chunk)
    assert_logits_close(logits, ref)
    assert logits.argmax(-1).tolist() == ref.argmax(-1).tolist()
    check_against_hf(path, hf_model, prompt, n=6)
    return model, cfg


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_matches_transformers(case, folders):
    folder, hf_model = folders(case)
    model, cfg = check_teacher_forced(folder, hf_model, chunk=5)
    kw = CASES[case][3]
    assert cfg.architecture == case and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.moe_intermediate_size == kw.get("moe_intermediate_size", kw.get("intermediate_size"))
    assert cfg.norm_topk_prob == (case in ("qwen3_moe", "mixtral"))
    assert cfg.shared_expert_intermediate_size == kw.get("shared_expert_intermediate_size", 0)
    assert cfg.moe_layers == ((0, 2) if case == "qwen3_moe" else (0, 1))
    assert (cfg.qk_norm, cfg.qk_norm_whole, cfg.clip_qkv) == (case == "qwen3_moe", case == "olmoe",
                                                                1.5 if case == "olmoe" else None)
    assert not any(".experts.0." in n for n in hf_model.state_dict())   # transformers fuses them in memory ...
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert any(".experts.0." in n for n in f.keys())                  # ... and saves one tensor per expert


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_transformers(case, tmp_path):
    """F32 everywhere, then Q8_0 experts (the file's values dequantized by the gguf package)."""
    _, arch, permute, _ = CASES[case]
    for i, types in enumerate([lambda n: QT.F32, lambda n: QT.Q8_0 if "_exps." in n else QT.F32]):
        hf_model = hf_moe(case, seed=20 + i)
        path = tmp_path / f"tiny{i}.gguf"
        assert (QT.Q8_0 in write_gguf(path, hf_model, arch, permute=permute, types=types)) == bool(i)
        _, cfg = check_teacher_forced(path, hf_model)
        assert cfg.architecture == case and cfg.num_experts == 8
        assert cfg.moe_layers == ((0, 2) if case == "qwen3_moe" else (0, 1))


def test_gguf_expert_weights_norm_is_honoured(tmp_path):
    """llama.cpp never renormalises Qwen2-MoE's weights, unless the file says expert_weights_norm."""
    hf_model = hf_moe("qwen2_moe", seed=3, norm_topk_prob=True)
    path = tmp_path / "norm.gguf"
    write_gguf(path, hf_model, "qwen2moe", permute=False, types=lambda n: QT.F32, experts_norm=True)
    _, cfg = check_teacher_forced(path, hf_model)
    assert cfg.norm_topk_prob


@pytest.mark.parametrize("case", list(CASES))
def test_alone_batched_and_chunked_greedy_are_the_same(case, folders, tmp_path):
    """Through the engine at fp32: two prompts together, each alone, and in prefill chunks of 4."""
    from phasewise import LLM, SamplingParams

    folder = with_tokenizer(folders(case)[0])
    prompts = [prompt_ids(256, 13, seed=7), prompt_ids(256, 9, seed=8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(model=str(folder), dtype="fp32", kv_dtype="model", kv_cache_memory=0.01, warmup=False)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate(p, params)[0].token_ids for p in prompts]
    chunked = LLM(model=str(folder), dtype="fp32", kv_dtype="model", kv_cache_memory=0.01, warmup=False,
                  max_num_batched_tokens=4, enable_prefix_caching=False)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == together
    assert PagedRunner(load_model(folder)[0]).greedy(prompts[0], 10)[1] == together[0]


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_ngram_speculation_and_prefix_caching_keep_greedy_tokens(case, folders):
    """At the default precision (int8 experts, on the decoder stack where kernels are built): greedy
    tokens with ngram drafts verified k + 1 rows at a time, and over a cached prefix, are those of
    plain decoding, token for token (each row's bits do not depend on the rows beside it)."""
    from phasewise import LLM, SamplingParams

    folder = with_tokenizer(folders(case)[0])
    loop = [5, 6, 7, 8, 9] * 4                                   # a repeating prompt: drafts to accept
    prompts = [loop, prompt_ids(256, 11, seed=3), loop + prompt_ids(256, 6, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model=str(folder), kv_cache_memory=0.01, warmup=False)
    plain = LLM(**kw, enable_prefix_caching=False)
    assert plain.engine.model.model.stack is not None        # the kernels are built: the sparse layers run there
    want = [plain.generate(p, params)[0].token_ids for p in prompts]
    spec = LLM(**kw, speculative="ngram", num_speculative_tokens=4)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.core.spec.num_accepted_tokens > 0
    cached = LLM(**kw)
    first = cached.generate(prompts[0], params)[0]
    again = cached.generate(prompts[2], params)[0]                 # shares the first's prompt blocks
    assert again.cached_tokens > 0 and [first.token_ids, again.token_ids] == [want[0], want[2]]


@pytest.mark.parametrize("dtype", ["fp32", "auto"])
def test_each_step_records_what_the_routers_chose(folders, dtype):
    """A step's record holds each sparse layer's choices per expert: k a row for every row of a decode
    step, in the Python layers (fp32) and in the decoder stack (default precision) alike; the
    dashboard's expert spread is built from them."""
    from phasewise import LLM, SamplingParams

    folder = with_tokenizer(folders("qwen3_moe")[0])          # layers 0 and 2 sparse, 8 experts, k = 2
    engine = LLM(model=str(folder), dtype=dtype, kv_cache_memory=0.01, warmup=False).engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for n, seed in ((9, 1), (5, 2)):
        engine.add_request(prompt_ids(256, n, seed=seed), params)
    decodes = 0
    while engine.has_unfinished():
        engine.step()
        step = engine.last_step                                # as the server's observers see each step
        s, choices = step.record, step.extras.expert_choices
        assert len(choices) == 2 and len(choices[0]) == 8
        if s.num_prefill_tokens == 0:
            decodes += 1
            assert [sum(layer) for layer in choices] == [2 * s.num_decode_tokens] * 2
            assert all(max(layer) <= s.num_decode_tokens for layer in choices)   # k distinct a row
    # older steps let their choices go
    assert decodes and all(s.extras.expert_choices is None for s in engine.steps[:-1])


# ---- the sparse block against transformers' own -----------------------------------------------------

def _hf_block(case: str, **over):
    """transformers' sparse block of `case` (one layer, random weights) and ours, loaded from its state dict."""
    from phasewise.models.llama import LlamaForCausalLM

    hf_model = hf_moe(case, seed=9, num_hidden_layers=1, **over)
    ours = LlamaForCausalLM(ModelConfig.from_hf(hf_model.config.to_dict()))
    assert ours.load_weights(hf_model.state_dict().items()) == ours.expected_weights()
    return hf_model.model.layers[0].mlp, ours.model.layers[0].mlp


@pytest.mark.parametrize("case,over", [("qwen3_moe", dict(norm_topk_prob=False)),
                                       ("qwen3_moe", dict(norm_topk_prob=True)),
                                       ("mixtral", {}), ("olmoe", {}), ("qwen2_moe", {})])
@torch.no_grad()
def test_sparse_block_matches_transformers(case, over):
    """Softmax then top-k, with and without renormalising; Mixtral's (always renormalised); Qwen2-MoE's
    shared expert behind its sigmoid gate: the same experts chosen and outputs close, on 40 rows."""
    block, ours = _hf_block(case, **over)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    assert_logits_close(ours(x), block(x[None])[0], tol=1e-5)
    _, _, hf_ids = block.gate(x)
    _, ids = route(ours.gate(x), 2, ours.cfg.norm_topk_prob, ours.cfg.router)
    assert torch.equal(ids, hf_ids)


@torch.no_grad()
def test_router_ties_and_orders():
    """Tied experts are broken as transformers' torch.topk breaks them; top-k then softmax equals
    softmax, top-k and renormalising; renormalising changes the weights (so the cases above test it)."""
    block, ours = _hf_block("qwen3_moe", norm_topk_prob=True)
    w = ours.gate.weight
    w[3] = w[5]                                            # experts 3 and 5 tie on every row
    block.gate.weight.copy_(w)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    _, hf_weights, hf_ids = block.gate(x)
    weights, ids = route(ours.gate(x), 2, True)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert ((ids == 3) | (ids == 5)).any()
    other, other_ids = route(ours.gate(x), 2, True, "topk_softmax")
    assert torch.allclose(other, weights, atol=1e-6) and torch.equal(other_ids, ids)
    plain, _ = route(ours.gate(x), 2, False)
    assert (plain - weights).abs().max() > 0.05


def test_the_shared_expert_and_its_gate_count():
    """Zeroing Qwen2-MoE's shared expert gate's weight changes the block's output (sigmoid(0) = 1/2)."""
    block, ours = _hf_block("qwen2_moe")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = ours(x)
        ours.shared_expert_gate.weight.zero_()
        block.shared_expert_gate.weight.zero_()
        assert (ours(x) - before).abs().max() > 1e-3
        assert_logits_close(ours(x), block(x[None])[0], tol=1e-5)


# ---- configs, precision, refusals ------------------------------------------------------------------

def test_default_precision_runs_the_experts_on_the_kernels(folders, tmp_path):
    """With kernels a mixture of experts takes a dense model's default: the file's blocks where it has
    them (q4), int8 per channel otherwise."""
    class Kernels:
        isa = "avx2"

    folder, hf_model = folders("mixtral")
    path, blocks = tmp_path / "m.gguf", tmp_path / "q8.gguf"
    write_gguf(path, hf_model, "llama", permute=True, types=lambda n: QT.F32)
    write_gguf(blocks, hf_model, "llama", permute=True, types=lambda n: QT.Q8_0 if "_exps." in n else QT.F32)
    for where, weights in ((folder, "int8"), (path, "int8"), (blocks, "q4")):
        p = choose(where, "auto", "auto", Kernels(), "mixtral")
        assert p.weights == weights and p.chosen
    assert "Q8_0" in choose(blocks, "auto", "auto", Kernels(), "mixtral").why
    assert choose(folder, "fp32", "model", Kernels(), "mixtral").weights == "fp32"


def test_tensor_parallelism_is_refused(folders):
    _, cfg = load_model(folders("qwen2_moe")[0])
    with pytest.raises(ValueError, match="mixture of experts"):
        check_tensor_parallel(cfg, 2)


def test_gguf_metadata_that_disagrees_or_routes_otherwise_is_refused(folders, tmp_path):
    _, hf_model = folders("olmoe")
    path = tmp_path / "o.gguf"
    write_gguf(path, hf_model, "olmoe", permute=False, types=lambda n: QT.F32)
    f = GGUFFile(path)
    f.fields["olmoe.expert_count"] = 4
    with pytest.raises(ModelLoadError, match="ffn_gate_inp"):
        f.model_config()
    f = GGUFFile(path)
    f.fields["olmoe.expert_gating_func"] = 2                # sigmoid
    with pytest.raises(UnsupportedModelError, match="softmax"):
        f.model_config()
    f = GGUFFile(path)
    f.fields["olmoe.expert_used_count"] = 9
    with pytest.raises(UnsupportedModelError):
        f.model_config()


def test_the_tokenizer_of_an_architecture_transformers_cannot_build(tmp_path):
    """transformers builds no OLMoE from a GGUF; the file's tokenizer fields still make its tokenizer."""
    import gguf

    from phasewise.tokenization.tokenizer import Tokenizer

    path = tmp_path / "olmoe.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab", "Ġ", "<|end|>"])
    w.add_token_merges(["a b"])
    w.add_token_types([1, 1, 1, 1, 3])
    w.add_eos_token_id(4)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    tok = Tokenizer.from_gguf(path, cache_dir=tmp_path)
    assert tok.encode("ab ab") == [2, 3, 2]
