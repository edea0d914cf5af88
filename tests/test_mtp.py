"""`--speculative mtp`: the model's own multi-token-prediction layer drafts, on tiny random Qwen3.5 (dense
and MoE) and Qwen3-Next folders with an `mtp.*` layer added to their checkpoints. Only random weights
exist here, so these tests hold what must hold whatever the weights: greedy output is that of plain
decoding, alone, batched, chunked and preempted, with drafts both taken and refused; a model without the
layer is refused in one line. (Its speed-up needs a trained layer: docs/benchmarks.md says how to measure it.)"""

from __future__ import annotations

import json

import pytest
import torch
from model_builders import build_hf, with_tokenizer
from safetensors.torch import save_file

from phasewise.config import SpeculativeConfig
from phasewise.core.sampling_params import SamplingParams
from phasewise.loading.loader import load_model
from tests.test_hybrid import CASES

pytestmark = pytest.mark.slow
MTP_CASES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def mtp_folder(case: str, folder, damp: float = 0.3):
    """A tiny random `case` that repeats itself (head = embedding, mixers damped), its checkpoint given an
    MTP layer: a copy of its attention layer (layer 3) perturbed, `fc` passing the next token's embedding
    through, its outputs damped, so that its drafts are often (not always) the model's next tokens."""
    config = CASES[case]()
    if hasattr(config, "shared_expert_intermediate_size"):
        config.shared_expert_intermediate_size = 64        # int8 rows: a multiple of 32 wide
    hf_model = build_hf(config, seed=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        hf_model.lm_head.weight.copy_(hf_model.model.embed_tokens.weight * 0.5)
        for name, p in hf_model.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.mul_(damp)
    hf_model.save_pretrained(folder)
    H = config.hidden_size
    mtp = {"mtp.fc.weight": torch.cat([torch.eye(H), 0.3 * torch.randn(H, H, generator=g)], dim=1),
           "mtp.pre_fc_norm_embedding.weight": torch.zeros(H), "mtp.pre_fc_norm_hidden.weight": torch.zeros(H),
           "mtp.norm.weight": torch.zeros(H)}
    for name, t in hf_model.state_dict().items():
        if name.startswith("model.layers.3."):
            t = t.float() * (0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
            mtp["mtp.layers.0." + name[len("model.layers.3."):]] = (t + 0.01 * torch.randn(t.shape, generator=g)
                                                                     if t.dim() > 1 else t).contiguous()
    save_file(mtp, str(folder / "mtp.safetensors"))
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(cfg))
    return with_tokenizer(folder)


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_drafts_keep_greedy_output_alone_batched_chunked_and_preempted(case, kv_dtype, tmp_path):
    """Also over the int8 KV cache (blocks of 16, the MTP layer's own cache int8 too)."""
    from phasewise import LLM

    folder = mtp_folder(case, tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (5,), generator=g).tolist() * 3 for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    bs = 16 if kv_dtype == "int8" else 4
    kw = dict(model=str(folder), quantization="int8", kv_dtype=kv_dtype, warmup=False, kv_cache_memory=0.01,
              block_size=bs)
    want = [o.token_ids for o in LLM(**kw).generate(prompts, params)]
    fixed = dict(num_speculative_tokens=3, adaptive=False)        # every decode drafts
    spec = LLM(**kw, speculative=SpeculativeConfig.parse("mtp", **fixed))
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.engine.core.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "drafts both taken and refused"
    assert [spec.generate(p, params)[0].token_ids for p in prompts] == want          # alone, after prefix hits
    chunked = LLM(**kw, max_num_batched_tokens=5, speculative=SpeculativeConfig.parse("mtp", **fixed))
    assert [o.token_ids for o in chunked.generate(prompts, params)] == want
    tight = LLM(**kw, num_blocks=64 // bs, speculative=SpeculativeConfig.parse("mtp", **fixed))
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == want and sum(o.metrics.preemptions for o in outs) > 0


def test_sampled_requests_with_mtp_drafts_reproduce_with_a_seed(tmp_path):
    from phasewise import LLM

    folder = mtp_folder("qwen3_5", tmp_path)
    prompt = list(range(3, 12)) * 2
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    llm = LLM(model=str(folder), dtype="fp32", kv_dtype="model", warmup=False, kv_cache_memory=0.01,
              speculative=SpeculativeConfig.parse("mtp", num_speculative_tokens=3, adaptive=False))
    first, again = (llm.generate(prompt, params)[0].token_ids for _ in range(2))
    assert first == again and len(first) == 12
    assert llm.engine.core.spec.num_draft_tokens > 0


def test_the_mtp_layer_loads_only_when_asked_and_a_model_without_one_is_refused(tmp_path):
    from phasewise import LLM

    folder = mtp_folder("qwen3_5", tmp_path / "with")
    plain, cfg = load_model(folder)
    assert plain.mtp is None and cfg.mtp_layers == 0                 # its weights skipped
    model, cfg = load_model(folder, mtp=True)
    assert model.mtp is not None and cfg.mtp_layers == 1
    fc = model.mtp.fc.weight
    assert torch.equal(fc[:, :cfg.hidden_size], torch.eye(cfg.hidden_size))
    assert torch.equal(model.mtp.norm.weight, torch.ones(cfg.hidden_size))     # (1 + w) norms kept as 1 + w
    bare = tmp_path / "bare"
    build_hf(CASES["qwen3_5"](), seed=3).save_pretrained(bare)
    with pytest.raises(ValueError, match="multi-token-prediction layer"):
        LLM(model=str(with_tokenizer(bare)), dtype="fp32", warmup=False, speculative=SpeculativeConfig.parse("mtp"))
    with pytest.raises(ValueError, match="'ngram', 'draft\\[:MODEL\\]' or 'mtp'"):
        SpeculativeConfig.parse("mtp:x")


@torch.inference_mode()
def test_each_catch_up_ends_where_the_layer_over_the_models_own_states_does(tmp_path):
    """Every catch-up of the engine's proposer (after a prefill, then over decodes and verify steps with
    accepted drafts) ends on the output the layer gives when run once, from a fresh cache, over the whole
    sequence so far with the model's own teacher-forced hidden states: the catch-ups fed it the right
    rows, at the right positions, with the right next tokens, over K/V from the model's own states."""
    from phasewise import LLM
    from phasewise.spec_decode.mtp import MTPProposer
    from tests.conftest import PagedRunner

    folder = mtp_folder("qwen3_5", tmp_path, damp=1.0)
    llm = LLM(model=str(folder), dtype="fp32", kv_dtype="model", warmup=False, kv_cache_memory=0.01, block_size=4,
              speculative=SpeculativeConfig.parse("mtp", num_speculative_tokens=3, adaptive=False))
    proposer = llm.engine.core.runner.proposer
    assert isinstance(proposer, MTPProposer)
    seen: list[tuple[list[int], torch.Tensor]] = []             # (the request's tokens, the catch-up's last output)
    propose, forward = proposer.propose, proposer._forward

    def recording(chunks, reqs):
        calls: list[torch.Tensor] = []
        proposer._forward = lambda *a: calls.append(forward(*a)) or calls[-1]
        propose(chunks, reqs)
        seen.extend((list(r.token_ids), calls[0][i]) for i, r in enumerate(reqs))
    proposer.propose = recording
    llm.generate(list(range(3, 12)) * 2, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    assert len(seen) > 3 and llm.engine.core.spec.num_accepted_tokens > 0

    model, _ = load_model(folder, mtp=True)
    fresh = MTPProposer(model, 64, 4, torch.float32)
    for tokens, out in seen:
        T = len(tokens)
        hidden = model(torch.tensor(tokens[:T - 1]), torch.arange(T - 1), *_meta(PagedRunner(model), T - 1))
        want = fresh._forward([tokens[1:]], hidden, [0], [list(range(64))])[0]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def _meta(runner, n: int):
    """A one-sequence forward's metadata and KV over a fresh paged cache (PagedRunner's)."""
    from phasewise.layers.attention import AttentionMetadata

    meta = AttentionMetadata.build_groups([n], [n], [[t] for t in runner.tables], runner.block_size,
                                          torch.device("cpu"))
    meta.state_slots = runner.state_slots
    return meta, runner.cache.layers
