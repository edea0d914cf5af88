"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against Hugging Face transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from phasewise.loading.loader import load_model
from tests.conftest import PagedRunner, transformers_from_gguf

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module")
def ours(default_model_path):
    model, _ = load_model(default_model_path)
    return model


@pytest.fixture(scope="module")
def hf(default_model_path):
    return transformers_from_gguf(default_model_path)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    from phasewise.tokenization.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(ours, hf, hf_tokenizer, prompt):
    ids = hf_tokenizer.encode(prompt)
    logits, _ = PagedRunner(ours, block_size=16).greedy(ids, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    span = (ref.max() - ref.min()).item()
    assert (logits - ref).abs().max().item() < 1e-3 * span


def test_64_greedy_tokens_match_transformers(ours, hf, hf_tokenizer):
    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])
    _, tokens = PagedRunner(ours, block_size=16).greedy(ids, 64)
    assert tokens == hf_greedy(hf, ids, 64)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with HF's own KV cache, never stopping at eos."""
    out, tokens = None, []
    with torch.no_grad():
        step = hf(torch.tensor([ids]), use_cache=True)
        while True:
            tokens.append(int(step.logits[0, -1].argmax()))
            if len(tokens) == n:
                return tokens
            step = hf(torch.tensor([[tokens[-1]]]), past_key_values=step.past_key_values, use_cache=True)


def test_engine_greedy_equals_reference_and_chunked_prefill(ours, hf_tokenizer, default_model_path):
    """The full engine (chunked prefill under a small token budget) gives the reference greedy tokens."""
    from phasewise import LLM, SamplingParams

    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    _, ref = PagedRunner(ours, block_size=16).greedy(ids, 24)
    llm = LLM(dtype="fp32", kv_dtype="model", max_num_batched_tokens=7, kv_cache_memory=0.05, warmup=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert len(out.metrics.prefill_chunks) == -(-len(ids) // 7)
    assert out.text == hf_tokenizer.decode(ref)
