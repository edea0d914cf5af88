"""Quantized linear layers: packing (every GGUF block type we run, fused mixes) vs the gguf package, the C++ kernel vs its PyTorch emulation (at
every ISA level this CPU runs), the fallback without kernels, and int8 / q4 on the default model
against fp32 and across levels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from phasewise.kernels import quant
from phasewise.kernels.gguf_blocks import pack_gguf
from phasewise.kernels.weight_formats import BY_GGUF_TYPE, K6_SC
from phasewise.layers.linear import Linear
from phasewise.loading.loader import choose_weight_forms
from tests.conftest import LEVELS, bind
from model_builders import gguf_rows

TEXT = Path(__file__).parent.parent / "benchmarks" / "data" / "lighthouses.txt"


def random_weight(fmt: str, n: int, k: int, seed: int = 0) -> quant.PackedWeight:
    g = torch.Generator().manual_seed(seed)
    if fmt == "i8":
        return quant.quantize_i8(torch.randn(n, k, generator=g) * 0.05)
    if fmt == "k4":                 # K in super-blocks of 256: sc and m 0..63, fp16 d and dmin
        kb = k // 32
        q = torch.randint(0, 16, (n, kb, 32), generator=g)
        sc, m = (torch.randint(0, 64, (n, kb), generator=g) for _ in range(2))
        sc[0, 0], m[-1, -1] = 63, 63
        d, dmin = ((torch.rand(n, kb // 8, generator=g) * 1e-3 + 1e-5).half().float() for _ in range(2))
        return quant.pack(fmt, q, [sc, m], (d, dmin))
    if fmt == "q6k":                # K in super-blocks of 256: int8 sc per half (both ends), fp16 d
        kb = k // 32
        q = torch.randint(-32, 32, (n, kb, 32), generator=g)
        sc = torch.randint(-128, 128, (2, n, kb), generator=g)
        sc[0, 0, 0], sc[1, -1, -1] = 127, -128
        d = (torch.rand(n, kb // 8, generator=g) * 1e-4 + 1e-6).half().float()
        return quant.pack(fmt, q, [sc[0], sc[1]], (d,))
    if fmt in ("k8", "k6"):         # any K (the GGUF K-quants need multiples of 256): values as packed
        kb = k // 32
        q = torch.randint(-32, 32, (n, kb, 32), generator=g) if fmt == "k6" else \
            torch.randint(-127, 128, (n, kb, 32), generator=g)
        scales = [torch.rand(n, kb, generator=g) * 0.01 + 1e-4 for _ in range(2)]
        if fmt == "k6":                # d, then each half's integer sc (both ends of its range included)
            sc = torch.randint(-K6_SC, K6_SC + 1, (2, n, kb), generator=g).float()
            sc[0, 0, 0], sc[1, -1, -1] = K6_SC, -K6_SC
            scales = [scales[0] * 0.02, sc[0], sc[1]]
        return quant.pack(fmt, q, scales + [-torch.rand(n, kb, generator=g) * 0.05])
    type_name = {"q4": "Q4_1", "q8": "Q8_0", "q5": "Q5_0"}[fmt]
    return pack_gguf(type_name, gguf_rows(type_name, n, k, seed))


@pytest.mark.parametrize("type_name", list(BY_GGUF_TYPE))
def test_packing_keeps_the_files_values_exactly(type_name):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    k = 512 if "_K" in type_name else 96
    raw = gguf_rows(type_name, 40, k)             # 40 rows: the last tile is padded
    expected = dequantize(raw, GGMLQuantizationType[type_name])
    packed = pack_gguf(type_name, raw)
    assert packed.format is BY_GGUF_TYPE[type_name] and packed.n_padded == 48
    assert torch.equal(quant.dequantize(packed), torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n", [1, 40, 16])
def test_the_kernels_repack_the_files_blocks_to_the_same_bytes(ops, type_name, n):
    """csrc/repack_gguf.cpp (the loader's path where kernels run) gives the numpy path's bytes,
    padding rows included; random bytes, so every bit pattern of the blocks' fields occurs (but NaN
    d's: the numpy path goes through fp32, which sets a NaN's quiet bit; the kernel copies bits)."""
    size = 144 if type_name == "Q4_K" else 210
    raw = np.random.default_rng(n).integers(0, 256, (n, 4, size), dtype=np.uint8)
    for high in (1, 3) if type_name == "Q4_K" else (209,):
        raw[:, :, high] &= 0xBF                      # an fp16's top exponent bit off: finite
    raw = raw.reshape(n, 4 * size)
    want, got = pack_gguf(type_name, raw), pack_gguf(type_name, raw, kernels=ops)
    assert (got.fmt, got.n, got.k) == (want.fmt, want.n, want.k)
    assert torch.equal(got.blocks, want.blocks)
    assert torch.equal(got.scale.view(torch.int16), want.scale.view(torch.int16))


@pytest.mark.parametrize("types,fmts", [(("Q4_K", "Q4_K"), ["k4"]), (("Q4_K", "Q4_0", "Q4_K"), ["k4", "q4", "k4"]),
                                        (("Q4_K", "Q4_K", "Q6_K"), ["k4", "q6k"]), (("Q6_K", "Q6_K"), ["q6k"]),
                                        (("Q5_0", "Q8_0", "Q6_K"), ["q5", "q8", "q6k"]), (("Q4_1", "Q5_K"), ["q4", "k6"]),
                                        (("Q5_0", "Q8_0"), ["q8"]), (("Q8_0", "Q5_0"), ["q8", "q5"]),
                                        (("Q5_0", "Q4_0"), ["q5", "q4"]), (("Q4_K", "Q8_0"), ["k4", "q8"])])
def test_fused_parts_of_mixed_types_keep_their_values(types, fmts):
    """A Q4_K_M file's q, k (Q4_K) and v (Q6_K) fuse into one projection whose parts keep their own
    formats (runs of one type joined), not re-rounded and no wider than the file."""
    parts = [pack_gguf(t, gguf_rows(t, 32, 256, seed=i)) for i, t in enumerate(types)]
    fused = quant.concat(parts)
    assert [p.fmt for p in fused.parts] == fmts and fused.u5_tiles == (2 if types == ("Q5_0", "Q8_0") else 0)
    assert fused.rows == 32 * len(types)
    assert fused.u5_tiles or fused.nbytes() == sum(p.nbytes() for p in parts)     # U5 bytes: q8's width
    assert torch.equal(quant.dequantize(fused), torch.cat([quant.dequantize(p) for p in parts]))
    with pytest.raises(ValueError, match="fuse"):
        quant.concat([parts[0], random_weight("i8", 16, 256)])


@pytest.mark.parametrize("m", [1, 5, 300])
def test_fused_parts_run_in_their_own_formats(ops, m):
    """The kernel runs each part of a mixed fused weight into its columns of one output (with the
    bias across all of them), each over the activations its format takes (k4, q6k per 256 values,
    q8 per 32), as its emulation does; the last part may be partly padding."""
    types = [("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 16), ("Q4_K", 40)]
    fused = quant.concat([pack_gguf(t, gguf_rows(t, n, 512, seed=i)) for i, (t, n) in enumerate(types)])
    assert [p.fmt for p in fused.parts] == ["k4", "q6k", "q8", "k4"]
    bias = torch.randn(fused.rows)
    layer = Linear.from_blocks(fused, bias)
    assert (layer.out_features, layer.packed.rows) == (152, 152)
    layer.bind_kernels(ops)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    y, expected = layer(x), quant.emulate(x, fused, bias)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    with pytest.raises(RuntimeError, match="whole tiles"):
        ops.quant_linear(x, quant.FORMATS["k4"].id, 88, fused.blocks[:2], fused.scale[:2], None, 0,
                         [(quant.FORMATS["q6k"].id, 64, fused.rest[0].blocks, fused.rest[0].scale)])


@pytest.mark.parametrize("m", [1, 5, 300])
def test_q5_parts_before_q8_keep_their_products(ops, m):
    """Gemma 3's q, k (Q5_0) and v (Q8_0) in one projection: the q5 tiles hold U5 bytes inside the
    q8 weight (u5_tiles), which the kernel multiplies as U5, the rest as Q8, into one output."""
    parts = [pack_gguf(t, gguf_rows(t, n, 96, seed=i)) for i, (t, n) in enumerate([("Q5_0", 64), ("Q5_0", 32),
                                                                                   ("Q8_0", 40)])]
    fused = quant.concat(parts)
    assert (fused.fmt, fused.u5_tiles, fused.n, fused.blocks.shape) == ("q8", 6, 136, (9, 3, 544))
    assert torch.equal(quant.dequantize(fused), torch.cat([quant.dequantize(p) for p in parts]))
    bias = torch.randn(136)
    layer = Linear.from_blocks(fused, bias)
    layer.bind_kernels(ops)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    y, expected = layer(x), quant.emulate(x, fused, bias)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    with pytest.raises(ValueError, match="fuse"):
        quant.concat([fused, parts[2]])
    with pytest.raises(RuntimeError, match="u5_tiles"):
        ops.quant_linear(x, quant.FORMATS["q5"].id, 64, parts[0].blocks, None, None, 1)


def test_narrow_formats_refuse_what_they_cannot_hold():
    """q5 and k6 store q + 16 and q + 32 in 5 and 6 bits that AVX2 multiplies unbiased: values past
    -16..15 and -32..31 would overflow its int16 sums, so packing refuses them."""
    d, one = [torch.full((16, 1), 0.01)], torch.ones(16, 1)
    for fmt, lo in (("q5", -16), ("k6", -32)):
        scales = d if fmt == "q5" else [d[0], one, one, d[0]]
        with pytest.raises(ValueError, match=f"{lo}..{-lo - 1}"):
            quant.pack(fmt, torch.full((16, 1, 32), -lo), scales)
        edges = torch.tensor([lo, -lo - 1]).repeat(16, 1, 16)
        assert torch.equal(quant.pack(fmt, edges, scales).values(), edges)
    for sc in (one * (K6_SC + 1), one * 1.5):     # k6's sub-block scales: integers AVX2's sums hold
        with pytest.raises(ValueError, match="integers"):
            quant.pack("k6", edges, [d[0], one, sc, d[0]])


@pytest.mark.parametrize("type_name,bits", [("Q4_0", 5), ("Q4_1", 5), ("Q5_0", 5.5), ("Q8_0", 8.5), ("Q4_K", 4.625),
                                            ("Q6_K", 6.5625)])
def test_packed_weights_are_no_wider_than_the_file(type_name, bits):
    """Q4_1 at its 5 bits a weight, Q5_0 at its 5.5, Q8_0 at 8.5, Q6_K at its 6.5625, and Q4_K at 4.625
    against its 4.5 (the sub-block scales as bytes: 2.8% wider); Q4_0 keeps an fp16 m (5 against 4.5)."""
    w = pack_gguf(type_name, gguf_rows(type_name, 48, 512))
    assert w.nbytes() * 8 / (48 * 512) == bits


@pytest.mark.parametrize("fmt", ["q4", "q8", "i8", "k4", "k8", "q5", "k6", "q6k"])
def test_dequantize_rows_is_the_rows_of_dequantize(ops, fmt):
    """An embedding kept in its blocks: the kernel's rows (and the reference's) are dequantize's, bit for bit."""
    w = random_weight(fmt, 40, 512, seed=3)
    ids = torch.tensor([[0, 39, 17], [16, 16, 5]])
    expected = quant.dequantize(w)[ids]
    assert torch.equal(quant.dequantize_rows(w, ids), expected)
    assert torch.equal(ops.dequantize_rows(ids, quant.FORMATS[fmt].id, w.n, w.blocks, w.scale), expected)
    with pytest.raises(RuntimeError, match="outside"):
        ops.dequantize_rows(torch.tensor([40]), quant.FORMATS[fmt].id, w.n, w.blocks, w.scale)


def test_int8_per_channel_error_is_half_a_step():
    w = torch.randn(64, 128)
    packed = quant.quantize_i8(w)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((quant.dequantize(packed) - w).abs() <= step / 2 + 1e-7).all()


def test_activation_quantization_matches_pytorch(ops):
    x = torch.randn(17, 192) * torch.logspace(-3, 2, 192)   # outlier channels
    x[3, :32] = 0                                            # an all-zero block
    x[5, :32] = torch.arange(32) - 15.5                      # halves: ties go to the even integer
    x[5, 0] = 127                                            # (scale 127 / 127: the halves stay halves)
    xq, dx, sx = ops.quantize_activations(x)
    rq, rdx, rsx = quant.quantize_activations(x)
    assert torch.equal(xq, rq)
    torch.testing.assert_close(dx, rdx, rtol=1e-6, atol=0)
    torch.testing.assert_close(sx, rsx, rtol=1e-5, atol=1e-6)


SHAPES = [(1, 576, 576), (3, 960, 576), (17, 3072, 576), (64, 576, 1536), (5, 48, 64), (2, 4096, 576),
          (300, 80, 576)]                                       # 300 rows: three row chunks
SHORT = [(1, 576, 576), (5, 48, 64), (300, 80, 576)]            # the K formats share q4's and q8's loops


@pytest.mark.parametrize("fmt,m,n,k", [(f, *s) for f in ("q4", "q8", "i8", "q5") for s in SHAPES] +
                                      [(f, *s) for f in ("k8", "k6") for s in SHORT] +
                                      [(f, *s) for f in ("k4", "q6k") for s in [(1, 576, 512), (5, 48, 256), (300, 80, 768)]])
def test_kernel_matches_its_emulation(ops, fmt, m, n, k):
    w = random_weight(fmt, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    y = ops.quant_linear(x, quant.FORMATS[fmt].id, n, w.blocks, w.scale, None)
    expected = quant.emulate(x, w)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # and near the weight-only product: activations lose ~1% per block to int8
    exact = torch.nn.functional.linear(x, quant.dequantize(w))
    assert (y - exact).norm() < 0.02 * exact.norm()


@pytest.mark.parametrize("fmt", ["q4", "q8", "i8", "q5", "k4", "q6k", "k6", "k8"])
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(ops, fmt):
    """Batch invariance of the dense kernels at every level: 9 and 20 rows together (register tiles of
    every height; q5 and q6k unpacked from 8 rows, run in place below) give each row its bits alone."""
    w = random_weight(fmt, 64, 512, seed=1)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([ops.quant_linear(x[i:i + 1], quant.FORMATS[fmt].id, 64, w.blocks, w.scale, None)
                       for i in range(20)])
    for m in (9, 20):
        assert torch.equal(ops.quant_linear(x[:m], quant.FORMATS[fmt].id, 64, w.blocks, w.scale, None), alone[:m])


@pytest.mark.parametrize("fmt", ["q4", "i8", "k8", "k6", "q5"])
def test_quant_linear_bias_padding_and_batch_dims(ops, fmt):
    w = random_weight(fmt, 40, 64)                  # N = 40: padded to 48 inside
    bias = torch.randn(40)
    layer = Linear.from_blocks(w, bias)
    x = torch.randn(2, 3, 64)
    ref = layer(x)                                  # kernels unset: the reference path
    layer.bind_kernels(ops)
    out = layer(x)
    assert out.shape == (2, 3, 40) and out.is_contiguous()
    torch.testing.assert_close(out, quant.emulate(x.reshape(6, 64), w, bias).reshape(2, 3, 40),
                               rtol=1e-5, atol=1e-5)
    assert (out - ref).norm() < 0.02 * ref.norm()


def test_int8_peak_is_measured_and_checks_its_argument(ops):
    assert 0.1 < ops.int8_peak_gops(20_000) < 1e6      # GOP/s: 12 chains of 64 int8 products per round
    with pytest.raises(RuntimeError, match="iters"):
        ops.int8_peak_gops(0)


def test_without_kernels_the_weights_are_dequantized_once():
    """No kernels (another device, kernels off): plain linear layers holding the exact weights, so
    a quantized model runs at float speed instead of dequantizing every weight on every call."""
    packed = random_weight("q4", 32, 64)
    bias = torch.randn(32)
    model = torch.nn.Sequential(Linear.from_blocks(packed, bias))
    layer = model[0]
    with pytest.warns(UserWarning, match="dequantized"):
        choose_weight_forms(model, "cpu", torch.float32, kernels=None)
    assert model[0] is layer                             # the layer's weight changed form, the layer stayed
    assert model[0].form in ("dense", "onednn") and model[0].packed is None and not list(model[0].buffers())
    x = torch.randn(3, 64)
    torch.testing.assert_close(model(x), x @ quant.dequantize(packed).T + bias)
    layer = Linear.from_blocks(packed)                   # the layer's own reference path, any dtype
    assert layer(x.bfloat16()).dtype == torch.bfloat16


# ---- the default model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_ids(default_model_path):
    from phasewise.tokenization.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path).encode(TEXT.read_text())[:384]


@pytest.fixture(scope="module")
def fp32_logits(default_model_path, text_ids):
    from phasewise.loading.loader import load_model
    from tests.conftest import PagedRunner

    model, _ = load_model(default_model_path)
    return PagedRunner(model, block_size=16).forward(text_ids, 0)


def teacher_forced(default_model_path, dtype: str, ids: list[int], kernels) -> torch.Tensor:
    """Logits of ids through the model at `dtype`, on `kernels` (None: the layers' own reference path)."""
    from phasewise.loading.loader import load_model
    from tests.conftest import PagedRunner

    model, _ = load_model(default_model_path, dtype)
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.form == "blocks"]
    assert len(layers) == 4 * model.config.num_layers + 1      # the tied output head too
    if kernels is not None:
        bind(model, kernels)
        assert all(m.kernels is kernels for m in layers) and model.model.stack is not None
    return PagedRunner(model, block_size=16).forward(ids, 0)


@pytest.mark.slow
def test_q4_reference_is_exactly_the_files_weights(default_model_path, text_ids, fp32_logits):
    """The fp32 model is the file dequantized; q4 keeps the same values, so weight-only q4 = fp32."""
    logits = teacher_forced(default_model_path, "q4", text_ids, kernels=None)
    torch.testing.assert_close(logits, fp32_logits, rtol=1e-4, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,min_agree,max_nll_rise", [("int8", 0.92, 0.01), ("q4", 0.95, 0.01)])
def test_quantized_model_agrees_with_fp32(default_model_path, text_ids, fp32_logits, chosen_ops, dtype,
                                          min_agree, max_nll_rise):
    """Measured on these 384 tokens: top-1 agreement 0.930-0.948 (int8, over levels and builds: a last-bit
    change in one layer flips some activation's int8 rounding, which moves logits by up to ~1.5 and
    agreement by ~2%), 0.979 (q4); mean NLL -0.1% / +0.1%."""
    logits = teacher_forced(default_model_path, dtype, text_ids, chosen_ops)
    agree = (logits.argmax(-1) == fp32_logits.argmax(-1)).float().mean().item()
    target = torch.tensor(text_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1], target).item()
    base = torch.nn.functional.cross_entropy(fp32_logits[:-1], target).item()
    assert agree >= min_agree, agree
    assert nll <= base * (1 + max_nll_rise), (nll, base)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_every_level_gives_the_same_greedy_tokens(default_model_path, text_ids, level):
    """q4 teacher-forced at each ISA level against the best one: the same argmax wherever the best
    level's choice is not a near tie (2% of the logits' range, as the bf16 test has it). The levels
    differ in the last bits of their float sums (Q8's offset term, reduction orders), and activation
    quantization turns a last-bit change into a whole int8 step now and then: measured on 64 tokens,
    mean |logit difference| 0.16, disagreements only where the top two were within 0.2 of 64."""
    from phasewise.kernels import build

    best = teacher_forced(default_model_path, "q4", text_ids[:128], build.load(LEVELS[-1]))
    logits = teacher_forced(default_model_path, "q4", text_ids[:128], build.load(level))
    span = (best.max() - best.min()).item()
    top2 = best.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * span
    assert clear.sum() >= 40
    assert torch.equal(logits.argmax(-1)[clear], best.argmax(-1)[clear])
    assert (logits - best).abs().mean() < 0.01 * span


def test_bf16_without_onednn_bf16_kernels_falls_back_with_a_warning(monkeypatch):
    """On a CPU whose oneDNN has no bf16 kernels (Zen 3: its weight reorder needs AVX-512), bf16 layers
    stay plain PyTorch linears, with a warning, instead of dying in oneDNN."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    model = torch.nn.Sequential(Linear(64, 32).bfloat16())
    torch.nn.init.normal_(model[0].weight)
    with pytest.warns(UserWarning, match="bf16"):
        assert choose_weight_forms(model, "cpu", torch.bfloat16) == 0
    assert model[0].form == "dense"
    assert model(torch.randn(3, 64).bfloat16()).dtype == torch.bfloat16
