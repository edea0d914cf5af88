"""Qwen3, Gemma 3 and sliding windows: tiny random checkpoints (HF folders and GGUF files), compared
with transformers in fp32 at every prompt position and on greedy tokens, whole and in chunks."""

from __future__ import annotations

import pytest
import torch
from conftest import PagedRunner
from model_builders import QT, assert_logits_close, build_hf, check_against_hf, hf_config, prompt_ids, write_gguf

from phasewise.loading.loader import load_model

WINDOW = 8          # short enough that the prompts below run far past it

CASES = {
    "qwen3": ("qwen3", dict(head_dim=32)),                        # head size != hidden / heads
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "gemma3": ("gemma3", dict(num_hidden_layers=6, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24)),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-window": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                   max_window_layers=1)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            kind, over = CASES[case]
            hf_model = build_hf(hf_config(kind, **over), seed=11 + len(cache))
            folder = tmp_path_factory.mktemp(case)
            hf_model.save_pretrained(folder)
            cache[case] = folder, hf_model
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_matches_transformers_whole_and_chunked(case, checkpoints):
    folder, hf_model = checkpoints(case)
    prompt = prompt_ids(256, 40, seed=3)
    model, cfg = check_against_hf(folder, hf_model, prompt, n=12)
    check_against_hf(folder, hf_model, prompt, n=12, chunk=7)
    assert cfg.architecture == CASES[case][0]
    assert cfg.qk_norm == (cfg.architecture in ("qwen3", "gemma3"))
    if "window" in case or case == "gemma3":
        assert cfg.sliding_window == WINDOW
    if case == "gemma3":
        assert cfg.sliding_layers == (0, 1, 2, 3, 4) and cfg.hidden_act == "gelu_tanh"
        assert cfg.query_scale == pytest.approx(24 ** -0.5) and cfg.rope_local_theta == 10000.0
    if case == "qwen2-window":
        assert cfg.sliding_layers == (1, 2)          # transformers' rule: the layers from max_window_layers on


@pytest.mark.parametrize("case", ["mistral-window", "gemma3"])
def test_the_window_matters(case, checkpoints):
    """The same weights without the window give other logits past it (so the parity above checks it)."""
    folder, hf_model = checkpoints(case)
    kind, over = CASES[case]
    unwindowed = build_hf(hf_config(kind, **{**over, "sliding_window": 4096}), seed=0)
    unwindowed.load_state_dict(hf_model.state_dict())
    prompt = torch.tensor([prompt_ids(256, 40, seed=3)])
    with torch.no_grad():
        diff = (hf_model(prompt).logits[0] - unwindowed(prompt).logits[0]).abs()
    assert diff[:WINDOW].max() < 1e-4 and diff[WINDOW:].max() > 0.1


def test_a_window_no_shorter_than_the_context_is_dropped(tmp_path):
    build_hf(hf_config("mistral", sliding_window=4096)).save_pretrained(tmp_path)
    _, cfg = load_model(tmp_path)
    assert cfg.sliding_window is None and cfg.sliding_layers == ()


GGUF_CASES = {
    "qwen3": ("qwen3", dict(head_dim=32)),
    # GGUF carries no pattern, local RoPE base or query scale: llama.cpp's fixed values are used
    "gemma3": ("gemma3", dict(num_hidden_layers=6, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16)),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_matches_transformers(case, tmp_path):
    kind, over = GGUF_CASES[case]
    hf_model = build_hf(hf_config(kind, **over), seed=21)
    path = tmp_path / "tiny.gguf"
    assert QT.Q8_0 in write_gguf(path, hf_model, kind, permute=False)
    prompt = prompt_ids(256, 40, seed=6)
    _, cfg = check_against_hf(path, hf_model, prompt, n=12)
    check_against_hf(path, hf_model, prompt, n=12, chunk=9)
    assert cfg.architecture == kind and cfg.head_dim == 16 + 16 * (kind == "qwen3")
    if kind == "gemma3":
        assert cfg.sliding_layers == (0, 1, 2, 3, 4) and cfg.sliding_window == WINDOW


def test_gemma3_decodes_past_the_window_in_small_blocks(checkpoints):
    """Blocks of 2 tokens, a 40-token prompt in chunks of 3, then 20 tokens: the window cuts through
    blocks; logits agree with one whole pass."""
    folder, _ = checkpoints("gemma3")
    model, _ = load_model(folder)
    prompt = prompt_ids(256, 40, seed=8)
    whole, tokens = PagedRunner(model, block_size=16).greedy(prompt, 20)
    chunked, chunked_tokens = PagedRunner(model, block_size=2, seed=5).greedy(prompt, 20, chunk=3)
    assert_logits_close(chunked, whole, tol=1e-5)
    assert chunked_tokens == tokens
