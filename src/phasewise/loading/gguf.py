"""Read a GGUF file with the `gguf` package: metadata, config, and its tensors under HF names."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sized
from dataclasses import replace
from pathlib import Path

import numpy as np

from phasewise.loading.gguf_header import GGUFFormatError, GGUFValue, TensorInfo, read_header
from phasewise.loading.gguf_tensor import GGUFTensor
from phasewise.models.config import ModelConfig
from phasewise.models.gguf_config import config_from_gguf

# GGUF tensor name (after "blk.N.") → HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",      # Phi-3: fused in the file
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, all experts' weights as one 3-D tensor each, Qwen2-MoE's shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Qwen3 and Gemma 3: QK-norm; Gemma 3: four norms a layer (ffn_norm is the one before the MLP).
_LAYER_NAMES_QK = {**_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LAYER_NAMES_GEMMA3 = {**_LAYER_NAMES_QK, "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Qwen3.5: gated attention (post_attention_norm before the MLP) and the Gated DeltaNet's tensors
_LAYER_NAMES_HYBRID = {**_LAYER_NAMES_QK, "post_attention_norm": "post_attention_layernorm",
                       "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                       "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                       "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
                       "ssm_out": "linear_attn.out_proj"}
# Qwen3-Next: b and a in one weight, grouped per key head as its checkpoints hold them (models/qwen3_next.py)
_LAYER_NAMES_QWEN3_NEXT = {**_LAYER_NAMES_HYBRID, "ssm_ba": "linear_attn.in_proj_ba"}
# LFM2: straight to our module names (models/lfm2.py), its short convolutions beside Llama attention
_LAYER_NAMES_LFM2 = {**_LAYER_NAMES_QK, "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                     "shortconv.out_proj": "conv.out_proj"}
# whole names after "blk.N." with no HF twin of that shape: the decay rate -exp(A_log) (named for what it
# holds; the model takes its log), and the time-step bias
_LAYER_WHOLE_HYBRID = {"ssm_a": "linear_attn.neg_A", "ssm_dt.bias": "linear_attn.dt_bias"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIP = {"rope_freqs.weight"}
# llama.cpp stores these families' norms as 1 + w (the DeltaNet's gated norm, ssm_norm, excepted)
_OFFSET_NORM_ARCHS = {"gemma3", "qwen3_5", "qwen3_5_moe", "qwen3_next"}  # read into the config instead
# llama.cpp's converter permutes Q/K rows of these architectures for its interleaved RoPE.
_PERMUTED_ARCHS = {"llama", "mistral"}


class ModelLoadError(ValueError):
    """The model file is missing, unreadable or not what it claims to be."""


class GGUFFile:
    """An opened GGUF file: its metadata, and tensors dequantized on demand from a memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        try:
            st = self.path.stat()
            fields, tensors = _header(str(self.path.resolve()), st.st_size, st.st_mtime_ns)
            self.fields, self.tensors = dict(fields), dict(tensors)
        except (GGUFFormatError, OSError) as e:
            raise ModelLoadError(f"not a valid GGUF file: {self.path} ({e})") from None
        arch = self.fields.get("general.architecture", "")
        tokens = self.fields.get("tokenizer.ggml.tokens")
        if f"{arch}.vocab_size" not in self.fields and isinstance(tokens, Sized):
            self.fields[f"{arch}.vocab_size"] = len(tokens)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")

    def model_config(self) -> ModelConfig:
        rope_freqs = None
        if "rope_freqs.weight" in self.tensors:
            rope_freqs = self._tensor("rope_freqs.weight").read().reshape(-1).tolist()
        cfg = config_from_gguf(self.fields, set(self.tensors), rope_freqs)
        self._check_shapes(cfg)
        return cfg

    def _check_shapes(self, cfg: ModelConfig) -> None:
        """The metadata against the tensors the file holds, before anything is built from it: a
        corrupt count would otherwise size the model (and its allocation) by the metadata alone."""
        h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        final_norm = "token_embd_norm.weight" if cfg.architecture == "lfm2" else "output_norm.weight"
        expect = {"token_embd.weight": (cfg.vocab_size, h),
                  "blk.0.attn_q.weight": (cfg.num_heads * cfg.head_dim, h),
                  "blk.0.attn_k.weight": (kv, h), "blk.0.attn_v.weight": (kv, h),
                  "blk.0.ffn_down.weight": (h, cfg.intermediate_size), final_norm: (h,)}
        for name, shape in expect.items():
            t = self.tensors.get(name)
            if t is None and name in ("token_embd.weight", final_norm):
                raise ModelLoadError(f"{self.path}: the file has no {name}")
            if t is not None and tuple(t.shape) != shape:
                raise ModelLoadError(f"{self.path}: {name} is {list(t.shape)}, but the metadata "
                                     f"makes it {list(shape)}")
        self._check_experts(cfg)
        unreadable = sorted({_type_name(t.ggml_type) for t in self.tensors.values()
                             if not _readable(t.ggml_type)})
        if unreadable:
            raise ModelLoadError(f"{self.path}: phasewise cannot read GGUF tensor type "
                                 f"{', '.join(unreadable)}")
        layers = {n.split(".")[1] for n in self.tensors if n.startswith("blk.") and not self._mtp(n, cfg)}
        if layers != {str(i) for i in range(cfg.num_layers)}:
            raise ModelLoadError(f"{self.path}: the metadata says {cfg.num_layers} layers, the file has "
                                 f"tensors for {len(layers)}")

    def _check_experts(self, cfg: ModelConfig) -> None:
        """Each sparse layer's router and experts against the metadata (E experts of width I)."""
        h, e = cfg.hidden_size, cfg.num_experts
        i, s = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        expect = {"ffn_gate_inp": (e, h), "ffn_gate_exps": (e, i, h), "ffn_up_exps": (e, i, h),
                  "ffn_down_exps": (e, h, i)}
        if s:
            expect |= {"ffn_gate_inp_shexp": (h,), "ffn_up_shexp": (s, h), "ffn_down_shexp": (h, s)}
        for layer in cfg.moe_layers:
            for base, shape in expect.items():
                t = self.tensors.get(f"blk.{layer}.{base}.weight")
                if t is None or tuple(t.shape) != shape:
                    have = "none" if t is None else list(t.shape)
                    raise ModelLoadError(f"{self.path}: blk.{layer}.{base}.weight is {have}, but the "
                                         f"metadata makes it {list(shape)}")

    def _tensor(self, name: str, cfg: ModelConfig | None = None) -> GGUFTensor:
        """The stored tensor `name`, to be read in HF's layout (Q/K permutation undone, Gemma 3's
        norms back to HF's convention)."""
        from gguf.constants import GGMLQuantizationType

        t = self.tensors[name]
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        data = self._data[t.offset:t.offset + t.nbytes].reshape(rows, t.nbytes // rows)
        heads, offset = 0, 0.0
        if cfg is not None and self.fields.get("general.architecture") in _PERMUTED_ARCHS and (
                ".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
        if cfg is not None and cfg.architecture in _OFFSET_NORM_ARCHS and name.endswith("norm.weight") \
                and not name.endswith(".ssm_norm.weight"):
            offset = -1.0        # llama.cpp stores Gemma's and Qwen3.5's norms as 1 + w; HF's convention is w
        return GGUFTensor(GGMLQuantizationType(t.ggml_type).name, data, tuple(t.shape), heads, offset)

    def weight(self, hf_name: str, cfg: ModelConfig) -> GGUFTensor | None:
        """The HF-named 2-D weight of a linear layer or the token table (a tied output head: the
        embedding), an expert tensor [E, rows, in] as its stacked [E rows, in]; None if absent."""
        name = _gguf_name(hf_name, cfg)
        if name not in self.tensors and hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            name = "token_embd.weight"
        if name is None or name not in self.tensors:
            return None
        shape = tuple(self.tensors[name].shape)
        if len(shape) == 3 and "_exps." in name:
            return replace(self._tensor(name, cfg), shape=(shape[0] * shape[1], shape[2]))
        return self._tensor(name, cfg) if len(shape) == 2 else None

    def hf_tensors(self, cfg: ModelConfig) -> Iterator[tuple[str, GGUFTensor]]:
        """(HF name, tensor to read whole or in part) for every weight."""
        for name in self.tensors:
            if name not in _SKIP and not self._mtp(name, cfg):
                yield _hf_name(name, cfg), self._tensor(name, cfg)

    def _mtp(self, name: str, cfg: ModelConfig) -> bool:
        """A tensor of Qwen3.5's multi-token-prediction layers, which follow the model's own layers within
        `block_count` (any other layer past the model's is the file's error, which _check_shapes names)."""
        architecture = self.fields.get("general.architecture")
        parts, blocks = name.split("."), self.fields.get(f"{architecture}.block_count")
        return parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() and isinstance(blocks, int) and \
            cfg.num_layers <= int(parts[1]) < blocks


@functools.lru_cache(maxsize=4)
def _header(path: str, size: int, mtime_ns: int) -> tuple[dict[str, GGUFValue], dict[str, TensorInfo]]:
    """read_header, once per file version: an engine opens its file three times (config, precision,
    weights), and a 150k-token vocabulary takes ~0.4 s to walk."""
    return read_header(Path(path))


def _readable(ggml_type: int) -> bool:
    """Whether the gguf package dequantizes this tensor type."""
    from gguf.constants import GGMLQuantizationType as QT
    from gguf.quants import _type_traits

    try:
        qt = QT(ggml_type)
    except ValueError:
        return False
    return qt in (QT.F32, QT.F16) or qt in _type_traits


def _type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType as QT

    try:
        return QT(ggml_type).name
    except ValueError:
        return f"#{ggml_type}"


def _hf_name(name: str, cfg: ModelConfig) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and cfg.recurrent_layers and ".".join(parts[2:]) in _LAYER_WHOLE_HYBRID:
        return f"model.layers.{parts[1]}.{_LAYER_WHOLE_HYBRID['.'.join(parts[2:])]}"
    if parts[0] == "blk" and len(parts) == 5 and cfg.architecture == "lfm2":     # blk.N.shortconv.X.weight
        parts = [*parts[:2], f"{parts[2]}.{parts[3]}", parts[4]]
    if parts[0] == "blk" and len(parts) == 4:
        layer, base, suffix = parts[1], parts[2], parts[3]
        names = _layer_names(cfg)
        if base not in names:
            raise ModelLoadError(f"unexpected tensor {name!r} in GGUF file")
        hf = names[base]
        if cfg.architecture == "phi3" and base == "ffn_up":
            hf = "mlp.gate_up_proj"  # Phi-3 keeps gate and up fused
        return f"model.layers.{layer}.{hf}.{suffix}"
    if name == "token_embd_norm.weight" and cfg.architecture == "lfm2":   # LFM2's norm after the last layer
        return "model.norm.weight"
    if parts[0] in _TOP_NAMES and len(parts) == 2:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ModelLoadError(f"unexpected tensor {name!r} in GGUF file")


def _gguf_name(hf_name: str, cfg: ModelConfig) -> str | None:
    """Inverse of _hf_name for the weights of linear layers; None when the name has no GGUF twin."""
    parts = hf_name.split(".")
    if hf_name == "lm_head.weight":
        return "output.weight"
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if len(parts) >= 6 and parts[:2] == ["model", "layers"]:
        hf = ".".join(parts[3:-1])
        if cfg.architecture == "phi3" and hf == "mlp.gate_up_proj":
            return f"blk.{parts[2]}.ffn_up.{parts[-1]}"
        for base, name in _layer_names(cfg).items():
            if name == hf:
                return f"blk.{parts[2]}.{base}.{parts[-1]}"
    return None


def _layer_names(cfg: ModelConfig) -> dict[str, str]:
    if cfg.architecture == "lfm2":
        return _LAYER_NAMES_LFM2
    if cfg.architecture == "qwen3_next":
        return _LAYER_NAMES_QWEN3_NEXT
    if cfg.recurrent_layers:
        return _LAYER_NAMES_HYBRID
    if cfg.architecture == "gemma3":
        return _LAYER_NAMES_GEMMA3
    return _LAYER_NAMES_QK if cfg.qk_norm or cfg.qk_norm_whole else _LAYER_NAMES
