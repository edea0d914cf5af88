"""Write a tiny Qwen3.5 model (transformers' own classes) as llama.cpp's converter writes a `qwen35` or
`qwen35moe` GGUF: norms stored as 1 + w, the decay as -exp(A_log), the conv's taps squeezed, the v heads
of every DeltaNet tensor reordered from grouped to tiled, and an MTP layer after the model's own.
Written here from the format's description (docs/notes/hybrid_gguf.md), for the loader's tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from phasewise.models.config import ModelConfig

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
          "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
          "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_OFFSET = ("attn_norm.weight", "post_attention_norm.weight", "output_norm.weight", "attn_q_norm.weight",
           "attn_k_norm.weight")


def tiled(x: np.ndarray, axis: int, nk: int, head: int, start: int = 0) -> np.ndarray:
    """The v heads along `axis` from `start` (nk groups of r heads of `head` values each, HF's order)
    reordered so that head j of group g comes at j * nk + g."""
    x = np.moveaxis(x, axis, 0)
    block = x[start:]
    r = block.shape[0] // (nk * head)
    block = block.reshape(nk, r, head, *block.shape[1:]).swapaxes(0, 1).reshape(block.shape)
    return np.moveaxis(np.concatenate([x[:start], block]), 0, axis)


def _qkvz(b: str, p: np.ndarray, c) -> list[tuple[str, np.ndarray]]:
    """Qwen3-Next's in_proj_qkvz, grouped per key head [q, k, v (r heads), z (r heads)], as the converter
    writes it: q of all heads, then k, then v, as attn_qkv; z as attn_gate."""
    nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // nk
    groups = p.reshape(nk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = np.split(groups, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    flat = [t.reshape(-1, p.shape[-1]) for t in (q, k, v, z)]
    return [(b + "attn_qkv.weight", np.concatenate(flat[:3])), (b + "attn_gate.weight", flat[3])]


def _lfm2_tensors(hf: str, p: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """An LFM2 parameter as llama.cpp's converter names it (the conv's taps squeezed, norms as they are)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.embedding_norm.weight": "token_embd_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return [(top[hf], p)]
    _, _, layer, rest = hf.split(".", 3)
    names = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate",
             "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
             "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
             "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj"}
    base, suffix = rest.rsplit(".", 1)
    return [(f"blk.{layer}.{names[base]}.{suffix}", p[:, 0] if base == "conv.conv" else p)]


def _tensors(hf: str, p: np.ndarray, c) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors (name, value in numpy's order) of one HF parameter (Qwen3.5: v heads tiled)."""
    if c.model_type == "lfm2":
        return _lfm2_tensors(hf, p)
    if c.model_type == "qwen3_next":
        if hf.endswith("in_proj_qkvz.weight"):
            return _qkvz(f"blk.{hf.split('.')[2]}.", p, c)
        if hf.endswith("in_proj_ba.weight"):
            return [(f"blk.{hf.split('.')[2]}.ssm_ba.weight", p)]
    tile = tiled if c.model_type != "qwen3_next" else (lambda x, *args, **kw: x)    # Qwen3-Next's stay grouped
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return [(top[hf], p)]
    _, _, layer, rest = hf.split(".", 3)
    b, nk, dv = f"blk.{layer}.", c.linear_num_key_heads, c.linear_value_head_dim
    if rest == "linear_attn.A_log":
        return [(b + "ssm_a", -np.exp(tile(p, 0, nk, 1)))]
    if rest == "linear_attn.dt_bias":
        return [(b + "ssm_dt.bias", tile(p, 0, nk, 1))]
    if rest == "mlp.experts.gate_up_proj":
        half = p.shape[1] // 2
        return [(b + "ffn_gate_exps.weight", p[:, :half]), (b + "ffn_up_exps.weight", p[:, half:])]
    if rest == "mlp.experts.down_proj":
        return [(b + "ffn_down_exps.weight", p)]
    base, suffix = rest.rsplit(".", 1)
    name = f"{b}{_LAYER[base]}.{suffix}"
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    if base == "linear_attn.in_proj_qkv":
        p = tile(p, 0, nk, dv, start=2 * key_dim)
    elif base == "linear_attn.conv1d":
        p = tile(p[:, 0], 0, nk, dv, start=2 * key_dim)
    elif base == "linear_attn.in_proj_z":
        p = tile(p, 0, nk, dv)
    elif base in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
        p = tile(p, 0, nk, 1)
    elif base == "linear_attn.out_proj":
        p = tile(p, 1, nk, dv)
    elif base == "mlp.shared_expert_gate":
        p = p.reshape(-1)
    return [(name, p)]


def _lfm2_metadata(w: gguf.GGUFWriter, c) -> None:
    """LFM2's keys: KV heads per layer (0: a short-conv layer), the conv's taps, the MLP's final width."""
    w.add_head_count_kv([0 if kind == "conv" else c.num_key_value_heads for kind in c.layer_types])
    w.add_uint32("lfm2.shortconv.l_cache", c.conv_L_cache)
    w.add_feed_forward_length(ModelConfig.from_hf(c.to_dict()).intermediate_size)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.norm_eps)


def _metadata(w: gguf.GGUFWriter, c, mtp: int) -> None:
    w.add_name("tiny-hybrid")
    w.add_block_count(c.num_hidden_layers + mtp)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    if w.arch == "lfm2":
        _lfm2_metadata(w, c)
        return
    if mtp:
        w.add_uint32(f"{w.arch}.nextn_predict_layers", mtp)
    if getattr(c, "intermediate_size", None):
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 0.25)))
    if w.arch.startswith("qwen35"):
        w.add_rope_dimension_sections([2, 1, 1, 0])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_uint32(f"{w.arch}.full_attention_interval", 4)
    if getattr(c, "num_experts", None):
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        if hasattr(c, "norm_topk_prob"):          # llama.cpp renormalises unless the file says otherwise
            w.add_expert_weights_norm(c.norm_topk_prob)


ARCHS = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next", "lfm2": "lfm2"}


def write_hybrid_gguf(path: Path, hf_model, q8_rows: bool = False) -> None:
    """Write hf_model (transformers' Qwen3.5 dense or MoE, Qwen3-Next or LFM2 text model) as llama.cpp's
    `qwen35`, `qwen35moe`, `qwen3next` or `lfm2`. `q8_rows`: the DeltaNet's row-reordered projections
    and the MLP in Q8_0, and hf_model set to the values they hold (out_proj, whose columns move, stays
    F32). A Qwen3.5 file gets a fake MTP layer after the model's, which a loader must skip."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), ARCHS[c.model_type])
    mtp = 1 if w.arch.startswith("qwen35") else 0
    _metadata(w, c, mtp)
    quantized = ("attn_qkv.weight", "attn_gate.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    for hf, param in dict(hf_model.named_parameters()).items():
        if q8_rows and any(_tensors(hf, param.detach().numpy(), c)[0][0].endswith(q) for q in quantized):
            with torch.no_grad():
                held = dequantize(quantize(param.detach().numpy(), QT.Q8_0), QT.Q8_0)
                param.copy_(torch.from_numpy(held.reshape(param.shape)))
        for name, value in _tensors(hf, param.detach().numpy().astype(np.float32), c):
            offset = 1.0 if name.endswith(_OFFSET) and w.arch != "lfm2" else 0.0
            value = np.ascontiguousarray(value + offset, dtype=np.float32)
            if q8_rows and name.endswith(quantized):
                w.add_tensor(name, quantize(value, QT.Q8_0), raw_dtype=QT.Q8_0)
            else:
                w.add_tensor(name, value)
    for i in range(mtp):               # an MTP layer's tensors, as the converter appends them
        b, h = f"blk.{c.num_hidden_layers + i}.", c.hidden_size
        w.add_tensor(b + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(b + "nextn.eh_proj.weight", np.zeros((h, 2 * h), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
