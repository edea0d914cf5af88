"""The C++ decoder stack (csrc/decoder_stack.cpp): every decoder layer of a quantized Llama-family
model in one call per step (prefill chunks and decodes alike: the compiled attention kernel
serves every row).

A decode step of a 30-layer model makes about 300 small op calls; from Python each costs
microseconds of dispatch, which at batch 1 was a third of the step. `build` gathers the
layers' weights once; `LlamaModel.forward` then hands every step to the stack, and keeps its
Python layers for everything else (other devices and dtypes, no compiled ops) and as the
reference the tests compare against.
"""

from __future__ import annotations

from types import ModuleType

import torch

from phasewise.layers.quant_linear import QuantLinear


def _linear_args(layer) -> tuple | None:
    if not isinstance(layer, QuantLinear) or layer.ext is None:
        return None
    return (layer.fmt_id, layer.out_features, layer.blocks, layer.scale, layer.bias)


def build(model: torch.nn.Module, ops: ModuleType | None):
    """A DecoderStack for `model` (a LlamaModel), or None when it cannot run one: no compiled ops,
    a linear layer that is not quantized with the kernels, weights not fp32 on the CPU."""
    if ops is None or not ops.has_vnni:
        return None
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [_linear_args(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if any(a is None for a in linears) or any(not _fp32_cpu(w) for w in norms):
            return None
        layers.append((*(w.detach() for w in norms), *linears))
    rotary, cfg = model.layers[0].self_attn.rotary, model.layers[0].self_attn.cfg
    if not all(_fp32_cpu(t) for t in (model.norm.weight, rotary.cos, rotary.sin)):
        return None
    return ops.DecoderStack(layers, model.norm.weight.detach(), rotary.cos, rotary.sin, cfg.num_heads,
                            cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)


def _fp32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
