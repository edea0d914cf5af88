"""Tiny random checkpoints built in the tests (HF folders and GGUF files written as llama.cpp
would), and what compares a loaded model with transformers in fp32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PagedRunner

from phasewise.loading.loader import load_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
N_NEW = 24


# ---- builders ---------------------------------------------------------------------------------

def hf_config(kind: str, **over):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig, "phi3": transformers.Phi3Config,
           "gemma3": transformers.Gemma3TextConfig}[kind]
    kw = dict(SMALL, max_position_embeddings=128)
    if kind == "phi3":
        kw.update(pad_token_id=0, original_max_position_embeddings=128)
    kw.update(over)
    return cls(**kw)


def build_hf(config, seed: int = 0) -> torch.nn.Module:
    """An HF model with every parameter random (HF zeroes biases and sets norms to 1; we want them all to count)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embedding: listed once
            noise = torch.randn(p.shape, generator=g)
            if "embed_tokens" in name:
                p.copy_(noise)
            elif p.ndim == 1:
                p.copy_(1 + 0.3 * noise if "norm" in name else 0.5 * noise)
            else:
                p.copy_(noise * (3.0 if "lm_head" in name else 1.0) / p.shape[1] ** 0.5)
    return model


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_reference(model, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """HF's prompt logits [T, V] and n greedy tokens (generate, no eos stop)."""
    ids = torch.tensor([prompt])
    logits = model(ids).logits[0].float()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == n
    return logits, tokens


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    assert ours.shape == ref.shape
    diff = (ours.float() - ref).abs().max().item()
    span = (ref.max() - ref.min()).item()
    assert diff < tol or diff / span < tol, f"max |diff| {diff:.3g} (logit range {span:.3g})"


def check_against_hf(path: Path, hf_model, prompt: list[int], n: int = N_NEW, chunk: int | None = None):
    model, cfg = load_model(path)
    ref_logits, ref_tokens = hf_reference(hf_model, prompt, n)
    logits, tokens = PagedRunner(model).greedy(prompt, n, chunk=chunk)
    assert_logits_close(logits, ref_logits)
    assert tokens == ref_tokens
    return model, cfg


# ---- HF folders ------------------------------------------------------------------------------

def with_tokenizer(folder):
    """`folder` with a word-level tokenizer of the tiny models' 256 tokens saved beside the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)
    return folder


# ---- GGUF --------------------------------------------------------------------------------------

_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down",
               # mixture of experts (the experts' 3-D tensors: _pieces)
               "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_GGUF_LAYER_QK = {**_GGUF_LAYER, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GGUF_LAYER_GEMMA3 = {**_GGUF_LAYER_QK, "post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _GGUF_TOP:
        return _GGUF_TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    base, suffix = rest.rsplit(".", 1)
    names = {"gemma3": _GGUF_LAYER_GEMMA3, "qwen3": _GGUF_LAYER_QK, "qwen3moe": _GGUF_LAYER_QK,
             "olmoe": _GGUF_LAYER_QK}.get(arch, _GGUF_LAYER)
    return f"blk.{layer}.{names[base]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def file_type_for(name: str) -> QT:
    if name == "token_embd.weight" or name == "blk.0.attn_q.weight" or (
            name.endswith((".ffn_down.weight", ".ffn_gate.weight"))):
        return QT.Q8_0
    if name.endswith(".attn_k.weight") or name == "output.weight":
        return QT.F16
    return QT.F32


def gguf_rows(type_name: str, n: int, k: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Random but valid GGUF rows [n, k / block values * block bytes] of a block type (Q4_0, Q4_1,
    Q8_0, Q5_0, Q4_K, Q5_K, Q6_K), scales times `scale`: how K-quant files are made here (the
    gguf package cannot quantize to them)."""
    rng = np.random.default_rng(seed)
    blocks = k // (256 if "_K" in type_name else 32)
    half = lambda lo, hi: (rng.random((n, blocks, 1)) * (hi - lo) * scale + lo * scale  # noqa: E731
                           ).astype(np.float16).view(np.uint8)
    body = lambda size: rng.integers(0, 256, (n, blocks, size), dtype=np.uint8)  # noqa: E731
    parts = {"Q8_0": [half(1e-4, 0.02), body(32)], "Q5_0": [half(1e-4, 0.02), body(4), body(16)],
             "Q4_0": [half(1e-4, 0.02), body(16)], "Q4_1": [half(1e-4, 0.02), half(-0.1, 0), body(16)],
             "Q4_K": [half(1e-4, 0.002), half(1e-4, 0.002), body(12), body(128)],
             "Q5_K": [half(1e-4, 0.002), half(1e-4, 0.002), body(12), body(32), body(128)],
             "Q6_K": [body(128), body(64), body(16), half(1e-4, 0.002)]}[type_name]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _pieces(hf: str, p: torch.Tensor, arch: str) -> list[tuple[str, tuple, tuple[int, ...] | None]]:
    """(GGUF name, index into p, shape in the file or None: p's) of each tensor an HF parameter is
    written as: transformers' fused experts [E, 2 I, H] as ffn_gate_exps and ffn_up_exps [E, I, H],
    the shared expert's gate [1, H] as [H], as llama.cpp's converter writes them."""
    layer = hf.split(".")[2] if hf.startswith("model.layers.") else None
    if hf.endswith(".mlp.experts.gate_up_proj"):
        half = p.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", (slice(None), slice(0, half)), None),
                (f"blk.{layer}.ffn_up_exps.weight", (slice(None), slice(half, None)), None)]
    if hf.endswith(".mlp.experts.down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", (), None)]
    if hf.endswith(".mlp.shared_expert_gate.weight"):
        return [(gguf_name(hf, arch), (), (p.shape[-1],))]
    return [(gguf_name(hf, arch), (), None)]


def write_gguf(path: Path, hf_model, arch: str, *, permute: bool, vocab_in_tokens: bool = False,
               types=file_type_for, experts_norm: bool | None = None) -> set[QT]:
    """Write hf_model as llama.cpp would, then set hf_model to exactly the (dequantized) values in the file.
    `types(gguf name)` picks each matrix's type; K-quant matrices get random blocks (gguf_rows).
    A mixture of experts gets its expert counts and widths (`experts_norm`: `expert_weights_norm`)."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)     # Gemma 3: per layer type
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        if experts_norm is not None:
            w.add_expert_weights_norm(experts_norm)
    if getattr(c, "clip_qkv", None):
        w.add_clamp_kqv(c.clip_qkv)
    if vocab_in_tokens:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    else:
        w.add_vocab_size(c.vocab_size)
    used, params = set(), dict(hf_model.named_parameters())  # tied lm_head is not listed
    for hf, p, name, index, shape in ((hf, p, *piece) for hf, p in params.items() for piece in _pieces(hf, p, arch)):
        offset = 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0   # llama.cpp stores 1 + w
        array = p.detach()[index].numpy().astype(np.float32) + offset
        array = array.reshape(shape) if shape is not None else np.ascontiguousarray(array)
        order = np.arange(array.shape[0])
        if permute and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            order = llama_cpp_permute(order[:, None], heads)[:, 0]  # file row i = HF row order[i]
            array = array[order]
        qtype = types(name) if array.ndim >= 2 else QT.F32
        if qtype.name.endswith("_K"):
            rows = int(np.prod(array.shape[:-1]))                        # an expert tensor: [E, rows, in]
            data = gguf_rows(qtype.name, rows, array.shape[-1], seed=len(used) + 7 * rows, scale=0.1)
            data = data.reshape(*array.shape[:-1], -1)
        else:
            data = quantize(array, qtype)
        w.add_tensor(name, data, raw_dtype=qtype if qtype not in (QT.F32, QT.F16) else None)
        held = np.empty_like(array)
        held[order] = dequantize(data, qtype).reshape(array.shape)
        with torch.no_grad():
            p[index].copy_(torch.from_numpy(held - offset).reshape(p[index].shape))
        used.add(qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return used

