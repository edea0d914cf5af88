"""Gemma 3 270M, the real file (Q5_0, Q4_K, Q6_K, Q8_0 blocks; sliding window 512 on 15 of 18
layers), against transformers loading the same GGUF: argmax at every prompt position of 100- and
1,500-token prompts, through the engine with chunked prefill; greedy decoding past the window and
again from the prefix cache; the default precision (every weight in the file's own blocks) within
1% perplexity of fp32."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from phasewise import LLM, SamplingParams
from phasewise.loading.gguf import ModelLoadError
from phasewise.loading.loader import resolve_model_path
from tests.conftest import transformers_from_gguf

pytestmark = pytest.mark.slow
TEXT = Path(__file__).parent.parent / "benchmarks" / "data" / "lighthouses.txt"
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def path() -> Path:
    try:
        return resolve_model_path("gemma-3-270m")
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf(path):
    pytest.importorskip("transformers")
    return transformers_from_gguf(path)


@pytest.fixture(scope="module")
def fp32(path):
    return LLM(model=str(path), dtype="fp32", max_num_batched_tokens=256, kv_cache_memory=0.5)


@pytest.fixture(scope="module")
def prompts(fp32) -> dict[int, list[int]]:
    ids = fp32.engine.tokenizer.encode(TEXT.read_text())
    ids = (ids + ids[1:])[:1500]                # the text is 1,432 tokens: go round once more
    return {100: ids[:100], 1500: ids}


@torch.no_grad()
def hf_top2(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' argmax after each position and its margin over the runner-up: [n] each."""
    logits = hf(torch.tensor([ids])).logits[0]
    top = logits.topk(2, dim=-1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


def engine_argmax(llm: LLM, ids: list[int]) -> list[int]:
    """The engine's most likely token after each prompt position but the last (prompt logprobs)."""
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    return [lp.top[0][0] for lp in out.prompt_logprobs[1:]]


@pytest.fixture(scope="module")
def long_run(hf, fp32, prompts):
    """24 greedy tokens after the 1,500-token prompt, and transformers' argmax and margin after every
    position of the prompt and those tokens: one forward of transformers serves two tests."""
    ids = prompts[1500]
    first = fp32.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    return first, *hf_top2(hf, ids + first.token_ids[:-1])


@pytest.mark.parametrize("n", [100, 1500])
def test_fp32_argmax_is_transformers_at_every_position(n, request, fp32, prompts):
    ids = prompts[n]
    if n == 1500:
        _, ref, margin = request.getfixturevalue("long_run")
        ref, margin = ref[:n], margin[:n]
    else:
        ref, margin = hf_top2(request.getfixturevalue("hf"), ids)
    ours = torch.tensor(engine_argmax(fp32, ids))
    differ = ours != ref[:-1]
    assert not (differ & (margin[:-1] > NEAR_TIE)).any(), differ.nonzero().flatten().tolist()


def test_greedy_past_the_window_and_from_the_prefix_cache(fp32, prompts, long_run):
    """24 greedy tokens after 1,500: each is transformers' argmax given the tokens before it; asked
    again, the prompt comes from the prefix cache and the tokens are the same."""
    ids = prompts[1500]
    first, ref, margin = long_run
    again = fp32.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert again.cached_tokens >= 1024 and again.token_ids == first.token_ids
    ref, margin = ref[len(ids) - 1:], margin[len(ids) - 1:]
    for i, token in enumerate(first.token_ids):
        assert token == ref[i] or margin[i] <= NEAR_TIE, f"token {i}: {token} vs {int(ref[i])}"


def test_default_precision_is_within_1_percent_perplexity_of_fp32(path, fp32, prompts):
    ids = prompts[1500][:800]                 # past the 512-token window of the local layers

    def perplexity(llm: LLM) -> float:
        out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        return math.exp(-sum(lp.logprob for lp in out.prompt_logprobs[1:]) / (len(ids) - 1))

    from phasewise.layers.linear import Linear

    default = LLM(model=str(path), max_num_batched_tokens=256, kv_cache_memory=0.5)
    # every projection in the file's own blocks: Q5_0 as q5 (fused with a Q8_0 v: q8), Q8_0 as q8,
    # Q4_K as k4, Q6_K as q6k
    formats = {m.fmt for m in default.engine.model.modules() if isinstance(m, Linear)}
    assert formats == {"q5", "q8", "k4", "q6k"}, formats
    ratio = perplexity(default) / perplexity(fp32)
    assert abs(ratio - 1) < 0.01, ratio


def test_chat_template_of_a_gguf_without_one(fp32):
    """The file ships no chat template: Gemma's turn format is used, and <end_of_turn> ends a reply."""
    tok = fp32.engine.tokenizer
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.hf.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids
