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


def _tensors(hf: str, p: np.ndarray, c) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors (name, value in numpy's order) of one HF parameter."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return [(top[hf], p)]
    _, _, layer, rest = hf.split(".", 3)
    b, nk, dv = f"blk.{layer}.", c.linear_num_key_heads, c.linear_value_head_dim
    if rest == "linear_attn.A_log":
        return [(b + "ssm_a", -np.exp(tiled(p, 0, nk, 1)))]
    if rest == "linear_attn.dt_bias":
        return [(b + "ssm_dt.bias", tiled(p, 0, nk, 1))]
    if rest == "mlp.experts.gate_up_proj":
        half = p.shape[1] // 2
        return [(b + "ffn_gate_exps.weight", p[:, :half]), (b + "ffn_up_exps.weight", p[:, half:])]
    if rest == "mlp.experts.down_proj":
        return [(b + "ffn_down_exps.weight", p)]
    base, suffix = rest.rsplit(".", 1)
    name = f"{b}{_LAYER[base]}.{suffix}"
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    if base == "linear_attn.in_proj_qkv":
        p = tiled(p, 0, nk, dv, start=2 * key_dim)
    elif base == "linear_attn.conv1d":
        p = tiled(p[:, 0], 0, nk, dv, start=2 * key_dim)
    elif base == "linear_attn.in_proj_z":
        p = tiled(p, 0, nk, dv)
    elif base in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
        p = tiled(p, 0, nk, 1)
    elif base == "linear_attn.out_proj":
        p = tiled(p, 1, nk, dv)
    elif base == "mlp.shared_expert_gate":
        p = p.reshape(-1)
    return [(name, p)]


def _metadata(w: gguf.GGUFWriter, c, mtp: int) -> None:
    w.add_name("tiny-qwen35")
    w.add_block_count(c.num_hidden_layers + mtp)
    w.add_uint32(f"{w.arch}.nextn_predict_layers", mtp)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if getattr(c, "intermediate_size", None):
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections([2, 1, 1, 0])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
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


def write_qwen35_gguf(path: Path, hf_model, q8_rows: bool = False, mtp: int = 1) -> None:
    """Write hf_model (a Qwen3_5 / Qwen3_5Moe text model) as `qwen35` / `qwen35moe`. `q8_rows`: the
    DeltaNet's row-reordered projections and the MLP in Q8_0, and hf_model set to the values they hold
    (out_proj, whose columns move, stays F32). `mtp` fake MTP layers follow, which a loader must skip."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "qwen35moe" if getattr(c, "num_experts", None) else "qwen35")
    _metadata(w, c, mtp)
    quantized = ("attn_qkv.weight", "attn_gate.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    for hf, param in dict(hf_model.named_parameters()).items():
        if q8_rows and any(_tensors(hf, param.detach().numpy(), c)[0][0].endswith(q) for q in quantized):
            with torch.no_grad():
                held = dequantize(quantize(param.detach().numpy(), QT.Q8_0), QT.Q8_0)
                param.copy_(torch.from_numpy(held.reshape(param.shape)))
        for name, value in _tensors(hf, param.detach().numpy().astype(np.float32), c):
            value = np.ascontiguousarray(value + (1.0 if name.endswith(_OFFSET) else 0.0), dtype=np.float32)
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
