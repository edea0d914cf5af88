"""Write a Llama-, Qwen2- or mixture-of-experts-shaped GGUF file of a chosen size, filled with random but valid
Q4_K_M-style blocks: the text it generates is noise, but its load time, memory and speed are those
of a real model of that shape. For benchmarking phasewise and llama.cpp at sizes no package ships.

    .venv/bin/python benchmarks/synthetic_gguf.py --size 1.5b --arch qwen2 --out /tmp/syn-1.5b.gguf
    .venv/bin/python benchmarks/synthetic_gguf.py --list

Shapes are the published ones (hidden, layers, heads, kv heads, ffn):
    qwen2 0.5b  Qwen2.5-0.5B   896, 24, 14, 2,  4864, tied embeddings
    qwen2 1.5b  Qwen2.5-1.5B  1536, 28, 12, 2,  8960, tied
    qwen2 3b    Qwen2.5-3B    2048, 36, 16, 2, 11008, tied
    qwen2 7b/8b Qwen2.5-7B    3584, 28, 28, 4, 18944, untied   (Qwen2.5 has no 8B)
    llama 0.5b/1.5b Llama-3.2-1B  2048, 16, 32, 8,  8192, tied   (the smallest Llama 3)
    llama 3b    Llama-3.2-3B  3072, 28, 24, 8,  8192, tied
    llama 7b/8b Llama-3.1-8B  4096, 32, 32, 8, 14336, untied
and mixtures of experts (hidden, layers, heads, kv heads, expert width; experts, active):
    olmoe 1b-7b      OLMoE-1B-7B     2048, 16, 16, 16, 1024; 64, 8 (q, k normed whole)
    qwen3moe 30b-a3b Qwen3-30B-A3B   2048, 48, 32, 4, 768; 128, 8 (head size 128, per-head q/k norms)
    mixtral 8x1b     a small Mixtral 2048, 16, 16, 8, 4096; 8, 2 (GGUF architecture llama)
and Qwen3.5's hybrids (three Gated DeltaNet layers to one gated attention layer; head size 256, RoPE on 64
of it; DeltaNet k heads, v heads of 128, conv of 4 taps; a vocabulary of 248,320, the tokenizer's padded):
    qwen35 0.8b      Qwen3.5-0.8B    1024, 24,  8, 2,  3584, tied; DeltaNet 16 k, 16 v heads
    qwen35 2b        Qwen3.5-2B      2048, 24,  8, 2,  6144, tied; 16, 16
    qwen35 9b        Qwen3.5-9B      4096, 32, 16, 4, 12288, untied; 16, 32
    qwen35moe 35b-a3b Qwen3.5-35B-A3B 2048, 40, 16, 2,  512; 256, 8, a shared expert of 512; 16, 32
and LFM2's short convolutions (3 taps) beside attention in layers 2, 5, 8, 10, 12, 14 (its vocabulary of
65,536 is the copied tokenizer's here):
    lfm2 1.2b        LFM2-1.2B       2048, 16, 32, 8,  8192, tied
The vocabulary is that of the tokenizer copied into the file (all tokenizer.* fields of
--tokenizer-from, by default the Qwen2.5-Coder-0.5B GGUF: 151936 tokens, for Llama too, whose real
vocabulary is 128256). Types follow llama.cpp's Q4_K_M: Q4_K matrices, Q6_K for the untied output
and for attn_v/ffn_down in llama.cpp's "more bits" layers (half of them), Q5_0/Q8_0 instead of
Q4_K/Q6_K where a row is not a multiple of 256 long; F32 norms (near 1) and Qwen2's q/k/v biases.
Block scales make every weight matrix's values spread about 0.02, so activations stay finite.
Tensor data is generated and written 64 MB at a time, whatever the size (peak RSS ~0.6 GB, most of
it reading the tokenizer) and a 4.7 GB file takes well under a minute of CPU.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

CHUNK = 64 << 20            # bytes generated at a time
DEFAULT_TOKENIZER = [Path.home() / ".cache/phasewise/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                     Path("/tmp/qwen05.gguf")]


class Shape(NamedTuple):
    source: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int                 # a dense layer's width, or one expert's
    tied: bool
    experts: int = 0         # a mixture of experts: experts of every layer, and how many a token takes
    active: int = 0
    head_dim: int = 0        # 0: hidden / heads
    delta_net: tuple[int, int] = ()   # a Qwen3.5 hybrid: its DeltaNet's k and v heads (of DELTA_HEAD each)
    shared: int = 0          # the shared expert's width
    attention: tuple[int, ...] = ()   # LFM2: the layers that attend (the others: short convolutions)


def head_dim(s: Shape) -> int:
    return s.head_dim or s.hidden // s.heads


# Published shapes: hidden, layers, heads, kv heads, ffn, tied embeddings.
QWEN_05 = Shape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, True)
QWEN_15 = Shape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, True)
QWEN_3 = Shape("Qwen2.5-3B", 2048, 36, 16, 2, 11008, True)
QWEN_7 = Shape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, False)
LLAMA_1 = Shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, True)
LLAMA_3 = Shape("Llama-3.2-3B", 3072, 28, 24, 8, 8192, True)
LLAMA_8 = Shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, False)
# Mixtures of experts: hidden, layers, heads, kv heads, expert width, tied, experts, active (head size)
OLMOE = Shape("OLMoE-1B-7B", 2048, 16, 16, 16, 1024, False, 64, 8)
QWEN3_30B = Shape("Qwen3-30B-A3B", 2048, 48, 32, 4, 768, False, 128, 8, 128)
MIXTRAL_SMALL = Shape("Mixtral-8x(1B)", 2048, 16, 16, 8, 4096, False, 8, 2)
# Qwen3.5 (the 2B's count, 1.88B without its MTP layer, is llama.cpp's for the published file)
QWEN35_08 = Shape("Qwen3.5-0.8B", 1024, 24, 8, 2, 3584, True, head_dim=256, delta_net=(16, 16))
QWEN35_2 = Shape("Qwen3.5-2B", 2048, 24, 8, 2, 6144, True, head_dim=256, delta_net=(16, 16))
QWEN35_9 = Shape("Qwen3.5-9B", 4096, 32, 16, 4, 12288, False, head_dim=256, delta_net=(16, 32))
QWEN35_35B = Shape("Qwen3.5-35B-A3B", 2048, 40, 16, 2, 512, False, 256, 8, 256, (16, 32), 512)
DELTA_HEAD, DELTA_CONV, ROTARY, FULL_EVERY, QWEN35_VOCAB = 128, 4, 64, 4, 248320
LFM2_12 = Shape("LFM2-1.2B", 2048, 16, 32, 8, 8192, True, attention=(2, 5, 8, 10, 12, 14))
LFM2_TAPS = 3
SHAPES: dict[str, dict[str, Shape]] = {
    "qwen2": {"0.5b": QWEN_05, "1.5b": QWEN_15, "3b": QWEN_3, "7b": QWEN_7, "8b": QWEN_7},
    "llama": {"0.5b": LLAMA_1, "1.5b": LLAMA_1, "3b": LLAMA_3, "7b": LLAMA_8, "8b": LLAMA_8},
    "olmoe": {"1b-7b": OLMOE},
    "qwen3moe": {"30b-a3b": QWEN3_30B},
    "mixtral": {"8x1b": MIXTRAL_SMALL},
    "qwen35": {"0.8b": QWEN35_08, "2b": QWEN35_2, "9b": QWEN35_9},
    "qwen35moe": {"35b-a3b": QWEN35_35B},
    "lfm2": {"1.2b": LFM2_12},
}
# rope theta, context length, RMS norm eps, q/k/v biases
ARCH = {"qwen2": (1e6, 32768, 1e-6, True), "llama": (500000.0, 131072, 1e-5, False),
        "olmoe": (10000.0, 4096, 1e-5, False), "qwen3moe": (1e6, 40960, 1e-6, False),
        "mixtral": (1e6, 32768, 1e-5, False), "qwen35": (1e7, 262144, 1e-6, False),
        "qwen35moe": (1e7, 262144, 1e-6, False), "lfm2": (1e6, 128000, 1e-5, False)}
GGUF_ARCH = {"mixtral": "llama"}            # llama.cpp writes Mixtral as llama with experts
QK_NORM = {"olmoe": "whole", "qwen3moe": "head", "qwen35": "head", "qwen35moe": "head", "lfm2": "head"}   # RMSNorm of q and k: over all of them, or per head

# type -> (bytes a block, values a block, [(byte offset of an fp16 scale, low, high)]). The ranges
# give each type values of std ~0.02: Q8_0 q*d (q int8), Q5_0 (q-16)*d, Q4_K d*sc*q - dmin*m
# (6-bit sc/m, 4-bit q; dmin ~7.5 d centres it), Q6_K d*sc*(q-32) (int8 sc, 6-bit q).
LAYOUT: dict[QT, tuple[int, int, list[tuple[int, float, float]]]] = {
    QT.Q8_0: (34, 32, [(0, 1.5e-4, 4e-4)]),
    QT.Q5_0: (22, 32, [(0, 1.2e-3, 3.2e-3)]),
    QT.Q4_K: (144, 256, [(0, 5e-5, 1.2e-4), (2, 4e-4, 9e-4)]),
    QT.Q6_K: (210, 256, [(208, 1e-5, 2.2e-5)]),
}


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v/ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def qtype(base: QT, row: int) -> QT:
    """llama.cpp's fallback when a row is not a whole number of 256-value K-quant blocks."""
    return base if row % 256 == 0 else {QT.Q4_K: QT.Q5_0, QT.Q6_K: QT.Q8_0}[base]


def plan(s: Shape, vocab: int, bias: bool, qk_norm: str = "") -> list[tuple[str, tuple[int, ...], QT]]:
    """(name, numpy shape [rows, row length] or [experts, rows, row length], type) of every tensor,
    in llama.cpp's order."""
    hd = head_dim(s)
    q, kv, h = s.heads * hd, s.kv_heads * hd, s.hidden
    out: list[tuple[str, tuple[int, ...], QT]] = [("token_embd.weight", (vocab, h), qtype(QT.Q4_K, h))]
    for i in range(s.layers):
        big = QT.Q6_K if more_bits(i, s.layers) else QT.Q4_K
        b = f"blk.{i}."
        if s.delta_net:
            out += hybrid_layer(s, i, big)
            continue
        if s.attention and i not in s.attention:       # LFM2's short convolution, then its MLP
            out += [(b + "attn_norm.weight", (h,), QT.F32), (b + "shortconv.conv.weight", (h, LFM2_TAPS), QT.F32),
                    (b + "shortconv.in_proj.weight", (3 * h, h), qtype(QT.Q4_K, h)),
                    (b + "shortconv.out_proj.weight", (h, h), qtype(QT.Q4_K, h)), (b + "ffn_norm.weight", (h,), QT.F32),
                    (b + "ffn_gate.weight", (s.ffn, h), qtype(QT.Q4_K, h)),
                    (b + "ffn_up.weight", (s.ffn, h), qtype(QT.Q4_K, h)),
                    (b + "ffn_down.weight", (h, s.ffn), qtype(big, s.ffn))]
            continue
        out += [(b + "attn_norm.weight", (h,), QT.F32),
                (b + "attn_q.weight", (q, h), qtype(QT.Q4_K, h)),
                (b + "attn_k.weight", (kv, h), qtype(QT.Q4_K, h)),
                (b + "attn_v.weight", (kv, h), qtype(big, h))]
        if bias:
            out += [(b + "attn_q.bias", (q,), QT.F32), (b + "attn_k.bias", (kv,), QT.F32),
                    (b + "attn_v.bias", (kv,), QT.F32)]
        if qk_norm:
            out += [(b + "attn_q_norm.weight", (q if qk_norm == "whole" else hd,), QT.F32),
                    (b + "attn_k_norm.weight", (kv if qk_norm == "whole" else hd,), QT.F32)]
        out += [(b + "attn_output.weight", (h, q), qtype(QT.Q4_K, q)),
                (b + "ffn_norm.weight", (h,), QT.F32)]
        if s.experts:
            e = s.experts
            out += [(b + "ffn_gate_inp.weight", (e, h), QT.F32),
                    (b + "ffn_gate_exps.weight", (e, s.ffn, h), qtype(QT.Q4_K, h)),
                    (b + "ffn_up_exps.weight", (e, s.ffn, h), qtype(QT.Q4_K, h)),
                    (b + "ffn_down_exps.weight", (e, h, s.ffn), qtype(big, s.ffn))]
            continue
        out += [(b + "ffn_gate.weight", (s.ffn, h), qtype(QT.Q4_K, h)),
                (b + "ffn_up.weight", (s.ffn, h), qtype(QT.Q4_K, h)),
                (b + "ffn_down.weight", (h, s.ffn), qtype(big, s.ffn))]
    out.append(("token_embd_norm.weight" if s.attention else "output_norm.weight", (h,), QT.F32))
    if not s.tied:
        out.append(("output.weight", (vocab, h), qtype(QT.Q6_K, h)))
    return out


def hybrid_layer(s: Shape, i: int, big: QT) -> list[tuple[str, tuple[int, ...], QT]]:
    """A Qwen3.5 layer as llama.cpp names it: a Gated DeltaNet (three of four layers) or gated attention
    (q_proj twice as wide: each head's q and its gate), then the dense or sparse MLP."""
    b, h, hd = f"blk.{i}.", s.hidden, head_dim(s)
    out: list[tuple[str, tuple[int, ...], QT]] = [(b + "attn_norm.weight", (h,), QT.F32)]
    if (i + 1) % FULL_EVERY:
        k_heads, v_heads = s.delta_net
        key, value = k_heads * DELTA_HEAD, v_heads * DELTA_HEAD
        out += [(b + "attn_qkv.weight", (2 * key + value, h), qtype(QT.Q4_K, h)),
                (b + "attn_gate.weight", (value, h), qtype(QT.Q4_K, h)),
                (b + "ssm_conv1d.weight", (2 * key + value, DELTA_CONV), QT.F32),
                (b + "ssm_dt.bias", (v_heads,), QT.F32), (b + "ssm_a", (v_heads,), QT.F32),
                (b + "ssm_beta.weight", (v_heads, h), QT.Q8_0), (b + "ssm_alpha.weight", (v_heads, h), QT.Q8_0),
                (b + "ssm_norm.weight", (DELTA_HEAD,), QT.F32),
                (b + "ssm_out.weight", (h, value), qtype(QT.Q4_K, value))]
    else:
        q, kv = s.heads * hd, s.kv_heads * hd
        out += [(b + "attn_q.weight", (2 * q, h), qtype(QT.Q4_K, h)), (b + "attn_k.weight", (kv, h), qtype(QT.Q4_K, h)),
                (b + "attn_v.weight", (kv, h), qtype(big, h)), (b + "attn_q_norm.weight", (hd,), QT.F32),
                (b + "attn_k_norm.weight", (hd,), QT.F32), (b + "attn_output.weight", (h, q), qtype(QT.Q4_K, q))]
    out.append((b + "post_attention_norm.weight", (h,), QT.F32))
    if not s.experts:
        return out + [(b + "ffn_gate.weight", (s.ffn, h), qtype(QT.Q4_K, h)),
                      (b + "ffn_up.weight", (s.ffn, h), qtype(QT.Q4_K, h)),
                      (b + "ffn_down.weight", (h, s.ffn), qtype(big, s.ffn))]
    e = s.experts
    return out + [(b + "ffn_gate_inp.weight", (e, h), QT.F32),
                  (b + "ffn_gate_exps.weight", (e, s.ffn, h), qtype(QT.Q4_K, h)),
                  (b + "ffn_up_exps.weight", (e, s.ffn, h), qtype(QT.Q4_K, h)),
                  (b + "ffn_down_exps.weight", (e, h, s.ffn), qtype(big, s.ffn)),
                  (b + "ffn_gate_inp_shexp.weight", (h,), QT.F32),
                  (b + "ffn_gate_shexp.weight", (s.shared, h), qtype(QT.Q4_K, h)),
                  (b + "ffn_up_shexp.weight", (s.shared, h), qtype(QT.Q4_K, h)),
                  (b + "ffn_down_shexp.weight", (h, s.shared), qtype(big, s.shared))]


def nbytes(shape: tuple[int, ...], t: QT) -> int:
    n = int(np.prod(shape))
    if t == QT.F32:
        return 4 * n
    block_bytes, block_values, _ = LAYOUT[t]
    return n // block_values * block_bytes


def chunks(rng: np.random.Generator, name: str, shape: tuple[int, ...], t: QT) -> Iterator[np.ndarray]:
    """The tensor's bytes, CHUNK at a time: random blocks with their fp16 scales set in range."""
    if t == QT.F32:
        norm = name.endswith("norm.weight")
        if name.endswith(".ssm_a"):              # a decay rate, -exp(A_log): negative, as trained ones are
            yield -rng.uniform(0.5, 8.0, shape).astype(np.float32)
            return
        yield (rng.uniform(0.95, 1.05, shape) if norm else rng.normal(0.0, 0.02, shape)).astype(np.float32)
        return
    block_bytes, block_values, scales = LAYOUT[t]
    total = nbytes(shape, t) // block_bytes
    step = max(1, CHUNK // block_bytes)
    for start in range(0, total, step):
        n = min(step, total - start)
        raw = rng.bit_generator.random_raw(-(-n * block_bytes // 8)).view(np.uint8)[:n * block_bytes]
        blocks = raw.reshape(n, block_bytes)
        for off, lo, hi in scales:
            blocks[:, off:off + 2] = rng.uniform(lo, hi, (n, 1)).astype(np.float16).view(np.uint8)
        yield blocks


def tokenizer_fields(path: Path) -> list[tuple[str, Any, VT, VT | None]]:
    """Every tokenizer.* field of a GGUF file, with its GGUF types (strings kept as raw bytes)."""
    r = gguf.GGUFReader(str(path))
    out = []
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main, sub = VT(f.types[0]), (VT(f.types[-1]) if f.types[0] == VT.ARRAY else None)
        if VT.STRING in (main, sub):
            vals = [bytes(f.parts[i]) for i in f.data]
            out.append((key, vals if sub else vals[0], main, sub))
        else:
            out.append((key, f.contents(), main, sub))
    return out


def padded(tok: list[tuple[str, Any, VT, VT | None]], vocab: int) -> list[tuple[str, Any, VT, VT | None]]:
    """The tokenizer's fields with its token list padded to `vocab` by control tokens no text reaches
    (Qwen3.5's table is 248,320 rows; the tokenizer copied has fewer)."""
    out = []
    for key, val, main, sub in tok:
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") and len(val) < vocab:
            extra = range(len(val), vocab)
            val = list(val) + ([f"<|pad_{i}|>".encode() for i in extra] if key.endswith("tokens") else [3] * len(extra))
        out.append((key, val, main, sub))
    return out


def hybrid_metadata(w: gguf.GGUFWriter, s: Shape) -> None:
    """Qwen3.5's keys: the DeltaNet's shape, which layers attend, partial RoPE, no MTP layer."""
    k_heads, v_heads = s.delta_net
    w.add_rope_dimension_count(ROTARY)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_ssm_conv_kernel(DELTA_CONV)
    w.add_ssm_state_size(DELTA_HEAD)
    w.add_ssm_group_count(k_heads)
    w.add_ssm_time_step_rank(v_heads)
    w.add_ssm_inner_size(v_heads * DELTA_HEAD)
    w.add_uint32(f"{w.arch}.full_attention_interval", FULL_EVERY)
    w.add_uint32(f"{w.arch}.nextn_predict_layers", 0)
    if s.shared:
        w.add_expert_shared_feed_forward_length(s.shared)


def find_tokenizer() -> Path:
    for p in DEFAULT_TOKENIZER:
        if p.is_file():
            return p
    sys.exit("no tokenizer source found (Qwen2.5-Coder-0.5B GGUF): pass --tokenizer-from PATH")


def params_of(tensors: list[tuple[str, tuple[int, ...], QT]]) -> int:
    return sum(int(np.prod(shape)) for _, shape, _ in tensors)


def active_bytes(tensors: list[tuple[str, tuple[int, ...], QT]], s: Shape) -> int:
    """Bytes of weights a token reads: every tensor but the experts, and `active` of each layer's
    experts (the token table counts one row: a lookup)."""
    total = 0
    for name, shape, t in tensors:
        if name == "token_embd.weight":
            total += nbytes(shape, t) // shape[0]
        elif "_exps." in name:
            total += nbytes(shape, t) * s.active // s.experts
        else:
            total += nbytes(shape, t)
    return total


def list_shapes(vocab: int) -> None:
    print(f"{'arch':6} {'size':5} {'shape of':13} {'hidden':>6} {'layers':>6} {'heads':>5} {'kv':>3} "
          f"{'ffn':>6} {'tied':>5} {'params':>7} {'file':>8}   (vocab {vocab})")
    for arch, sizes in SHAPES.items():
        for size, s in sizes.items():
            t = plan(s, QWEN35_VOCAB if s.delta_net else vocab, ARCH[arch][3], QK_NORM.get(arch, ""))
            mb = sum(nbytes(shape, q) for _, shape, q in t) / 1e6
            print(f"{arch:6} {size:5} {s.source:13} {s.hidden:6} {s.layers:6} {s.heads:5} {s.kv_heads:3} "
                  f"{s.ffn:6} {str(s.tied):>5} {params_of(t) / 1e9:6.2f}B {mb:6.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted({size for sizes in SHAPES.values() for size in sizes}))
    ap.add_argument("--arch", choices=list(SHAPES), default="qwen2")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, help="GGUF file whose tokenizer.* fields to copy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = ap.parse_args()
    if args.list:
        list_shapes(151936)
        return
    if args.size is None or args.out is None:
        ap.error("--size and --out are required (or --list)")
    if args.out.exists() and not args.force:
        print(f"error: {args.out} exists (pass --force to overwrite)", file=sys.stderr)
        sys.exit(2)
    if not args.out.resolve().parent.is_dir():
        print(f"error: no directory {args.out.resolve().parent}", file=sys.stderr)
        sys.exit(2)

    t0 = time.time()
    tok_path = args.tokenizer_from or find_tokenizer()
    tok = tokenizer_fields(tok_path)
    if args.arch in ("qwen35", "qwen35moe"):
        tok = padded(tok, QWEN35_VOCAB)
    vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    if args.size not in SHAPES[args.arch]:
        print(f"error: --arch {args.arch} has sizes {', '.join(SHAPES[args.arch])}", file=sys.stderr)
        sys.exit(2)
    s, (theta, ctx, eps, bias) = SHAPES[args.arch][args.size], ARCH[args.arch]
    tensors = plan(s, vocab, bias, QK_NORM.get(args.arch, ""))
    data_bytes = sum(nbytes(shape, t) for _, shape, t in tensors)
    free = shutil.disk_usage(args.out.resolve().parent).free + (args.out.stat().st_size if args.out.exists() else 0)
    if free < data_bytes + (64 << 20):
        print(f"error: {args.out.parent} has {free / 1e9:.1f} GB free, the file needs "
              f"{data_bytes / 1e9:.1f} GB", file=sys.stderr)
        sys.exit(2)

    w = gguf.GGUFWriter(str(args.out), GGUF_ARCH.get(args.arch, args.arch))
    w.add_name(f"synthetic-{args.arch}-{args.size}")
    w.add_type("model")
    w.add_file_type(15)                                  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(ctx)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    if s.attention:                                     # LFM2: KV heads per layer, 0 for a short convolution
        w.add_head_count_kv([s.kv_heads if i in s.attention else 0 for i in range(s.layers)])
        w.add_uint32("lfm2.shortconv.l_cache", LFM2_TAPS)
    else:
        w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(vocab)
    if args.arch in ("llama", "mixtral"):
        w.add_rope_dimension_count(head_dim(s))
    if s.head_dim:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.active)
        w.add_expert_feed_forward_length(s.ffn)
    if s.delta_net:
        hybrid_metadata(w, s)
    for key, val, main, sub in tok:
        w.add_key_value(key, val, main, sub)
    for name, shape, t in tensors:       # numpy shapes [rows, row length]; the writer reverses them
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, t), None if t == QT.F32 else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    assert w.fout is not None
    f, rng, done, shown = w.fout[0], np.random.default_rng(args.seed), 0, -1
    print(f"writing {args.out}: {args.arch} {args.size} ({s.source} shape), {len(tensors)} tensors, "
          f"{data_bytes / 1e6:.0f} MB, tokenizer from {tok_path}", file=sys.stderr)
    for i, (name, shape, t) in enumerate(tensors, 1):
        w.write_padding(f, f.tell())                     # each tensor starts at the alignment
        for part in chunks(rng, name, shape, t):
            f.write(memoryview(part).cast("B"))
            done += part.nbytes
        w.write_padding(f, nbytes(shape, t))
        if 20 * done // data_bytes > shown or i == len(tensors):
            shown = 20 * done // data_bytes
            print(f"  tensor {i}/{len(tensors)}  {done / 1e6:7.0f} / {data_bytes / 1e6:.0f} MB  "
                  f"{time.time() - t0:5.1f} s", file=sys.stderr)
    w.close()

    size, n = args.out.stat().st_size, params_of(tensors)
    active = f", {active_bytes(tensors, s) / 1e6:.0f} MB read a token" if s.experts else ""
    print(f"{args.out}: {size / 1e6:.0f} MB, {n / 1e9:.3f}B parameters, {size / n:.3f} bytes/weight "
          f"({8 * size / n:.2f} bits){active}, {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
