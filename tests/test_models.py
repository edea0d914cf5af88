"""Model loading: tiny random HF / GGUF checkpoints built here, compared with transformers in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PagedRunner, bind
from model_builders import (N_NEW, QT, assert_logits_close, build_hf, check_against_hf, gguf, hf_config,
                            hf_reference, prompt_ids, write_gguf)

from phasewise.loading.gguf import ModelLoadError
from phasewise.loading.loader import load_model
from phasewise.models.config import UnsupportedModelError


HF_CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "llama-3layers-mha": ("llama", dict(num_hidden_layers=3, num_key_value_heads=4)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-head_dim32": ("llama", dict(head_dim=32)),
    "llama-rope-llama3": ("llama", dict(max_position_embeddings=64, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "llama-rope-linear": ("llama", dict(max_position_embeddings=64,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0})),
}


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """Build and save each HF case once: name → (folder, HF model)."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(case: str):
        if case not in cache:
            kind, over = HF_CASES[case]
            hf_model = build_hf(hf_config(kind, **over), seed=len(cache))
            folder = tmp_path_factory.mktemp(case)
            hf_model.save_pretrained(folder)
            cache[case] = folder, hf_model
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_folder_matches_transformers(case, hf_checkpoints):
    folder, hf_model = hf_checkpoints(case)
    kind = HF_CASES[case][0]
    rope_case = "rope" in case
    prompt = prompt_ids(256, 40 if rope_case else 11, seed=1)
    model, cfg = check_against_hf(folder, hf_model, prompt, n=16 if rope_case else N_NEW)
    assert cfg.architecture == kind
    assert cfg.tie_word_embeddings == ("tied" in case)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if kind == "phi3":  # the checkpoint really holds the fused tensors
        names = set(hf_model.state_dict())
        assert "model.layers.0.self_attn.qkv_proj.weight" in names
        assert "model.layers.0.mlp.gate_up_proj.weight" in names


@pytest.mark.parametrize("case", ["llama-rope-llama3", "llama-rope-linear"])
def test_rope_scaling_matters(case, hf_checkpoints):
    """The scaled-RoPE cases would not pass if the loader ignored the scaling."""
    folder, hf_model = hf_checkpoints(case)
    model, cfg = load_model(folder)
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] in case
    plain = build_hf(hf_config("llama", max_position_embeddings=64), seed=0)
    plain.load_state_dict(hf_model.state_dict())
    prompt = prompt_ids(256, 40, seed=1)
    with torch.no_grad():
        scaled_logits = hf_model(torch.tensor([prompt])).logits[0]
        plain_logits = plain(torch.tensor([prompt])).logits[0]
    assert (scaled_logits - plain_logits).abs().max() > 0.1


@pytest.mark.parametrize("case", ["llama", "qwen2", "phi3", "llama-rope-llama3"])
def test_chunked_prefill_matches(case, hf_checkpoints):
    folder, hf_model = hf_checkpoints(case)
    prompt = prompt_ids(256, 40 if "rope" in case else 11, seed=2)
    model, _ = load_model(folder)
    full, full_tokens = PagedRunner(model).greedy(prompt, 8)
    chunked, chunked_tokens = PagedRunner(model, seed=3).greedy(prompt, 8, chunk=3)
    assert_logits_close(chunked, full, tol=1e-5)
    assert chunked_tokens == full_tokens
    ref_logits, ref_tokens = hf_reference(hf_model, prompt, 8)
    assert_logits_close(chunked, ref_logits)
    assert chunked_tokens == ref_tokens


def test_bf16_runs_and_agrees_with_fp32(hf_checkpoints):
    folder, _ = hf_checkpoints("llama")
    prompt = prompt_ids(256, 11, seed=1)
    fp32, _ = load_model(folder)
    bf16, _ = load_model(folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    runner = PagedRunner(bf16)
    assert runner.cache.data.dtype == torch.bfloat16
    ref_logits, ref_tokens = PagedRunner(fp32).greedy(prompt, 12)
    logits, tokens = runner.greedy(prompt, 3)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    span = (ref_logits.max() - ref_logits.min()).item()
    diff = (logits - ref_logits).abs().max().item()
    assert 0 < diff < 0.02 * span, f"bf16 vs fp32 max |diff| {diff:.3g} (range {span:.3g})"
    assert tokens == ref_tokens[:3]
    # Teacher-forced on fp32's sequence: same argmax wherever fp32's choice is not a near tie.
    seq = prompt + ref_tokens[:-1]
    ours, ref = PagedRunner(bf16).forward(seq, 0), PagedRunner(fp32).forward(seq, 0)
    top2 = ref.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * span
    assert clear.sum() >= 5
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])



GGUF_CASES = {
    "llama": ("llama", dict(rope_theta=1000.0, rms_norm_eps=1e-5), {}),
    "llama-tied-vocab-from-tokens": ("llama", dict(tie_word_embeddings=True), dict(vocab_in_tokens=True)),
    "qwen2": ("qwen2", dict(rope_theta=1000.0), {}),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_matches_transformers(case, tmp_path):
    kind, over, extra = GGUF_CASES[case]
    hf_model = build_hf(hf_config(kind, **over), seed=7)
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    path = tmp_path / "tiny.gguf"
    used = write_gguf(path, hf_model, kind, permute=kind == "llama", **extra)
    assert {QT.Q8_0, QT.F16, QT.F32} <= used
    # Quantization really changed what HF holds (so this test checks the dequantized values).
    assert not torch.equal(hf_model.model.embed_tokens.weight, original["model.embed_tokens.weight"])
    model, cfg = check_against_hf(path, hf_model, prompt_ids(256, 11, seed=4))
    assert cfg.architecture == kind
    assert cfg.tie_word_embeddings == ("tied" in case)
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.rope_theta == hf_model.config.rope_parameters["rope_theta"]
    assert cfg.vocab_size == 256 and cfg.num_kv_heads == 2 and cfg.num_layers == 2


K_QUANT_TYPES = {"attn_q": QT.Q4_K, "attn_k": QT.Q4_K, "attn_v": QT.Q6_K, "attn_output": QT.Q5_K,
                 "ffn_gate": QT.Q4_K, "ffn_up": QT.Q4_K, "ffn_down": QT.Q6_K}


def test_gguf_k_quants_at_their_own_precision(tmp_path, chosen_ops):
    """A Q4_K_M-like file (Q4_K q and k fused with a Q6_K v, Q5_K, Q6_K): fp32 equals transformers on
    the same file; at the file's own blocks every projection keeps them (k4, q6k, k6 for Q5_K; the qkv
    of two types in two parts), the reference
    path gives the fp32 logits, the kernels (activations in int8) a close copy."""
    from phasewise.layers.linear import Linear

    hf_model = build_hf(hf_config("llama", hidden_size=256, intermediate_size=512), seed=3)
    path = tmp_path / "k.gguf"
    types = lambda name: K_QUANT_TYPES.get(name.split(".")[-2], QT.Q8_0) if name.startswith("blk.") else QT.Q8_0  # noqa: E731
    assert {QT.Q4_K, QT.Q5_K, QT.Q6_K} <= write_gguf(path, hf_model, "llama", permute=True, types=types)
    ids = prompt_ids(256, 20, seed=2)
    check_against_hf(path, hf_model, ids, n=4)
    fp32, _ = load_model(path)
    want = PagedRunner(fp32, block_size=16).forward(ids, 0)
    model, _ = load_model(path, "q4")
    formats = {name.rsplit(".", 1)[-1]: "+".join(p.fmt for p in m.packed.parts) for name, m in model.named_modules()
               if isinstance(m, Linear)}
    assert formats == {"qkv_proj": "k4+q6k", "o_proj": "k6", "gate_up_proj": "k4", "down_proj": "q6k", "lm_head": "q8"}
    torch.testing.assert_close(PagedRunner(model, block_size=16).forward(ids, 0), want, rtol=1e-4, atol=1e-4)
    bind(model, chosen_ops)
    got = PagedRunner(model, block_size=16).forward(ids, 0)
    assert (got - want).norm() < 0.03 * want.norm()


def test_gguf_chunked_prefill(tmp_path):
    hf_model = build_hf(hf_config("llama"), seed=8)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model, "llama", permute=True)
    check_against_hf(path, hf_model, prompt_ids(256, 13, seed=5), n=8, chunk=3)


# ---- bad input ---------------------------------------------------------------------------------

def _one_line_naming(err: pytest.ExceptionInfo, path: Path) -> None:
    msg = str(err.value)
    assert str(path) in msg
    assert "\n" not in msg


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "ok.gguf"
    write_gguf(path, build_hf(hf_config("llama"), seed=9), "llama", permute=True)
    return path


@pytest.mark.parametrize("keep", [0.02, 0.3, 0.9])
def test_truncated_gguf(keep, small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    _one_line_naming(err, path)


@pytest.mark.parametrize("content", [b"", b"hello, this is not a model\n" * 10,
                                     b"GGUF" + bytes(range(256)) * 4])
def test_garbage_gguf(content, tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    _one_line_naming(err, path)


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(path)


def test_unsupported_model_type(tmp_path):
    config = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt2") as err:
        load_model(tmp_path)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("drop", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                  "model.norm.weight", "lm_head.weight"])
def test_missing_weight(drop, hf_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = hf_checkpoints("llama")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    assert drop in tensors
    del tensors[drop]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing") as err:
        load_model(tmp_path)
    _one_line_naming(err, tmp_path)


def test_missing_path(tmp_path):
    for path in (tmp_path / "nope.gguf", tmp_path / "no-such-folder"):
        with pytest.raises(ModelLoadError) as err:
            load_model(path)
        _one_line_naming(err, path)


def test_folder_without_weights(hf_checkpoints, tmp_path):
    folder, _ = hf_checkpoints("llama")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def _save_folder(folder: Path, config, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")


@pytest.mark.parametrize("problem", ["unexpected", "wrong-shape"])
def test_bad_weight_raises_model_load_error(problem, hf_checkpoints, tmp_path):
    folder, hf_model = hf_checkpoints("llama")
    tensors = dict(hf_model.state_dict())
    if problem == "unexpected":  # e.g. a Llama with attention_bias: o_proj has a bias we do not implement
        tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    else:
        tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    _save_folder(tmp_path, hf_model.config, tensors)
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path)
    _one_line_naming(err, tmp_path)
    assert ("o_proj.bias" if problem == "unexpected" else "up_proj") in str(err.value)


def test_partial_rotary_is_rejected(tmp_path):
    """HF Phi-3 configs may rotate only part of each head; we do not implement that (rather than be wrong)."""
    build_hf(hf_config("phi3", partial_rotary_factor=0.5)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="partial"):
        load_model(tmp_path)


def test_a_gguf_tensor_type_phasewise_cannot_read_is_one_line_naming_it(tmp_path):
    path = tmp_path / "f64.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 32), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_vocab_size, 4)):
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float64))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="cannot read GGUF tensor type F64") as err:
        load_model(path)
    _one_line_naming(err, path)


@pytest.mark.parametrize("kind", ["default", "qwen3", "gemma3"])
def test_bind_kernels_reaches_every_module_that_runs_them(kind, tmp_path, default_model_path, chosen_ops):
    """`bind_kernels(model, kernels)`, one call: every norm, attention, MLP, quantized linear layer and
    token table (each a UsesKernels) gets them as `kernels` (and None takes them all back)."""
    from phasewise.kernels import UsesKernels
    from phasewise.layers.embedding import Embedding
    from phasewise.layers.linear import Linear

    if kind == "default":
        model, _ = load_model(default_model_path, "q4")
    else:
        over = dict(num_hidden_layers=2, head_dim=16, sliding_window=8) if kind == "gemma3" else {}
        build_hf(hf_config(kind, **over)).save_pretrained(tmp_path)
        model, _ = load_model(tmp_path, "int8")
    assert issubclass(Linear, UsesKernels) and issubclass(Embedding, UsesKernels)
    users = [m for m in model.modules() if isinstance(m, UsesKernels)]
    assert sum(isinstance(m, Linear) and m.form == "blocks" for m in users) >= 4 * len(model.model.layers)
    assert any(isinstance(m, Embedding) and m.form == "blocks" for m in users) == (kind == "default")
    for kernels in (chosen_ops, None):
        bind(model, kernels)
        got = [m.kernels for m in users]
        assert all(k is kernels for k in got), [type(m).__name__ for m, k in zip(users, got) if k is not kernels]
