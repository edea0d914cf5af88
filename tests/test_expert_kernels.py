"""The mixture-of-experts kernel (kernels/csrc/expert_mlp.cpp) at every ISA level this CPU runs, per
packed format: each expert's rows get, bit for bit, what the dense kernels give them (quant_linear on
the expert's tiles, silu_and_mul, quant_linear down); a row's result does not depend on the rows
beside it, bit for bit; it matches the float experts to the activations' int8 rounding; and
the tiny MoE models of every architecture run their experts in the file's blocks, greedy tokens the
same alone, batched and in chunks."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import random_weight

from phasewise.kernels import quant
from phasewise.layers.expert_linear import ExpertLinear

FORMATS = ["q4", "q8", "q5", "i8", "k4", "q6k", "k6", "k8"]
E, H, I = 6, 256, 64                     # K-quants need whole super-blocks along both H and I


def stacked(fmt: str, experts: int, rows: int, k: int, seed: int) -> ExpertLinear:
    """An ExpertLinear in blocks of `fmt`: every expert's rows drawn at random."""
    layer = ExpertLinear(experts, k, rows)
    if fmt == "i8":
        layer.fill_blocks(quant.quantize_i8(torch.randn(experts * rows, k, generator=torch.Generator().manual_seed(seed)) * 0.05))
    else:
        layer.fill_blocks(random_weight(fmt, experts * rows, k, seed))
    return layer


def experts_of(fmt: str, down_fmt: str | None = None, ops=None) -> tuple[ExpertLinear, ExpertLinear, ExpertLinear]:
    """Gate, up and down of E experts, bound to `ops`; the width I (256 where down is a K-quant)."""
    down_fmt = down_fmt or fmt
    width = 256 if quant.FORMATS[down_fmt].activation_group > quant.QK else I
    gate, up = stacked(fmt, E, width, H, 1), stacked(fmt, E, width, H, 2)
    down = stacked(down_fmt, E, H, width, 3)
    for p in (gate, up, down):
        p.bind_kernels(ops)
    return gate, up, down


def expert_by_expert(ops, x, ids, gate, up, down):
    """Each expert's rows (ascending) through it on the dense kernels, all of them in one call as the
    expert kernel groups them: [T, k, H], choice j of row t at [t, j]."""
    def part(layer, e):
        nt = layer.rows // quant.TILE
        w = layer.packed
        scale = w.scale if w.scale is None else w.scale[e * nt:(e + 1) * nt] if w.scale.dim() == 3 else \
            w.scale[e * layer.rows:(e + 1) * layer.rows]
        return layer.fmt_id, layer.rows, w.blocks[e * nt:(e + 1) * nt].contiguous(), \
            None if scale is None else scale.contiguous()

    T, k = ids.shape
    out = torch.empty(T, k, x.shape[1])
    for e in ids.unique().tolist():
        rows, choice = (ids == e).nonzero(as_tuple=True)
        act = ops.silu_and_mul(torch.cat([ops.quant_linear(x[rows], *part(gate, e)),
                                          ops.quant_linear(x[rows], *part(up, e))], dim=1))
        out[rows, choice] = ops.quant_linear(act, *part(down, e))
    return out


def route(T: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return ids, weights


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_expert_is_the_dense_kernels_over_its_rows(ops, fmt):
    """k = 1 with weight 1: out[t] is exactly what the dense kernels give expert ids[t]'s rows."""
    gate, up, down = experts_of(fmt, ops=ops)
    T = 11
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[0]] * 9 + [[3], [5]])        # 9 rows on expert 0: Q5, Q6K unpack from 8
    out = ops.expert_mlp(x, ids, torch.ones(T, 1), *[p.kernel_part() for p in (gate, up, down)], E)
    assert torch.equal(out, expert_by_expert(ops, x, ids, gate, up, down)[:, 0])


@pytest.mark.parametrize("fmt,down_fmt", [("k4", "q6k"), ("q4", "q8"), ("q8", "k4"), ("q5", "k8")])
def test_rows_are_the_same_whatever_shares_the_call(ops, fmt, down_fmt):
    """k = 3 with the router's weights: each subset of the rows gives what the whole batch gives them,
    bit for bit (the dense kernels are row-invariant at every level),
    and the k terms are the experts' results summed in the router's order."""
    gate, up, down = experts_of(fmt, down_fmt, ops=ops)
    parts = [p.kernel_part() for p in (gate, up, down)]
    T, k = 24, 3
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    ids, weights = route(T, k, seed=6)
    batch = ops.expert_mlp(x, ids, weights, *parts, E)
    for rows in ([0], [5], [3, 17], list(range(0, T, 3)), list(range(9, 20))):
        assert torch.equal(ops.expert_mlp(x[rows], ids[rows], weights[rows], *parts, E), batch[rows])
    terms = expert_by_expert(ops, x, ids, gate, up, down)
    want = terms[:, 0] * weights[:, :1]
    for j in range(1, k):
        want = want + terms[:, j] * weights[:, j:j + 1]
    torch.testing.assert_close(batch, want, rtol=1e-4, atol=1e-6 * batch.abs().max().item())


def test_the_kernel_matches_the_float_experts(ops):
    """Against each expert's stored weights dequantized, in fp32: within the int8 activations' rounding."""
    from phasewise.models.moe import Experts

    experts = Experts(E, H, 256)
    for name, fmt, seed in (("gate_proj", "k4", 1), ("up_proj", "k4", 2), ("down_proj", "q6k", 3)):
        layer = getattr(experts, name)
        layer.fill_blocks(random_weight(fmt, layer.out_features, layer.in_features, seed))
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(8))
    ids, weights = route(7, 2, seed=9)
    experts.bind_kernels(None)
    want = experts(x, ids, weights)                           # the float path: dequantized blocks
    experts.bind_kernels(ops)
    assert experts._parts is not None
    got = experts(x, ids, weights)
    assert (got - want).norm() / want.norm() < 0.02


@pytest.mark.parametrize("renorm, order", [(False, "softmax_topk"), (True, "softmax_topk"), (False, "topk_softmax")])
def test_the_kernels_route_as_transformers_does(ops, renorm, order):
    """moe_route chooses torch.topk's experts with transformers' weights, in each router's order."""
    from phasewise.models.moe import route

    logits = torch.randn(40, 60, generator=torch.Generator().manual_seed(4))
    weights, ids = ops.moe_route(logits, 6, renorm, order == "topk_softmax")
    want_w, want_ids = route(logits, 6, renorm, order)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    alone = ops.moe_route(logits[7:8], 6, renorm, order == "topk_softmax")
    assert torch.equal(alone[0], weights[7:8]) and torch.equal(alone[1], ids[7:8])
    with pytest.raises(RuntimeError, match="k <= experts"):
        ops.moe_route(logits, 61, renorm)


def test_bad_arguments_are_refused(ops):
    gate, up, down = experts_of("q8", ops=ops)
    parts = [p.kernel_part() for p in (gate, up, down)]
    x = torch.randn(2, H)
    with pytest.raises(RuntimeError, match="expert id"):
        ops.expert_mlp(x, torch.tensor([[0], [E]]), torch.ones(2, 1), *parts, E)
    with pytest.raises(RuntimeError, match="whole tiles"):
        ops.expert_mlp(x, torch.tensor([[0], [1]]), torch.ones(2, 1), *parts, 5)
    with pytest.raises(RuntimeError, match="\\[T, k\\]"):
        ops.expert_mlp(x, torch.tensor([[0], [1]]), torch.ones(2, 2), *parts, E)


# ---- the tiny models of every architecture, their experts in a file's blocks ------------------------

# gate and up in Q4_K, down in Q6_K, as a Q4_K_M file has them; the rest in Q8_0 or F32
KQUANTS = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"}


def kquant_moe(case: str, path, seed: int = 30, **over):
    """A tiny `case` model of hidden size and expert width 256 (and config `over`) written as a
    Q4_K_M-like GGUF at `path`; the transformers model (its values now the file's)."""
    from gguf import GGMLQuantizationType as QT
    from model_builders import write_gguf
    from test_moe import CASES, hf_moe

    _, arch, permute, kw = CASES[case]
    width = {"moe_intermediate_size": 256} if "moe_intermediate_size" in kw else {"intermediate_size": 256}
    if "shared_expert_intermediate_size" in kw:
        width["shared_expert_intermediate_size"] = 64      # int8 blocks (a width of 32s), not float
    hf_model = hf_moe(case, seed=seed, hidden_size=256, **width, **over)
    types = lambda n: QT[KQUANTS[n.split(".")[-2]]] if "_exps." in n else QT.Q8_0 if n.endswith("attn_q.weight") \
        else QT.F32  # noqa: E731
    write_gguf(path, hf_model, arch, permute=permute, types=types)
    return hf_model


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_tiny_models_run_their_experts_in_the_files_blocks(ops, case, tmp_path):
    """q4 keeps the experts in the file's K-quant blocks on the kernels; the logits match the float
    model's to the int8 activations' rounding, and a prompt's rows in one pass equal them one at a time."""
    from conftest import PagedRunner
    from model_builders import prompt_ids

    from phasewise.loading.loader import load_model, load_prepared

    path = tmp_path / "m.gguf"
    kquant_moe(case, path)
    model, cfg = load_prepared(path, "q4", kernels=ops)
    model.build_stack(ops)
    for layer in cfg.moe_layers:
        experts = model.model.layers[layer].mlp.experts
        assert (experts.gate_proj.fmt, experts.up_proj.fmt, experts.down_proj.fmt) == ("k4", "k4", "q6k")
        assert experts._parts is not None
    prompt = prompt_ids(cfg.vocab_size, 12, seed=3)
    together, tokens = PagedRunner(model).greedy(prompt, 4)
    one_by_one, tokens1 = PagedRunner(model).greedy(prompt, 4, chunk=1)
    assert torch.equal(together, one_by_one) and tokens == tokens1   # every format row-invariant
    float_logits, _ = PagedRunner(load_model(path)[0]).greedy(prompt, 1)
    assert median_error(together, float_logits) < 0.05


def median_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The median over rows of |a - b| / |b| (a few rows whose router flipped do not decide it)."""
    return ((a - b).norm(dim=1) / b.norm(dim=1)).median().item()


def test_the_packed_cache_holds_the_experts(tmp_path, monkeypatch, chosen_ops):
    """Expert tensors pack straight into the cache file as they pack in memory, one stacked weight each."""
    from phasewise.loading import packed_cache, quantize
    from phasewise.loading.gguf import GGUFFile
    from phasewise.models.registry import model_class

    path = tmp_path / "m.gguf"
    kquant_moe("olmoe", path)
    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path))
    gguf = GGUFFile(path)
    cfg = gguf.model_config()
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    want = quantize.plan_file_weights(model, cfg, gguf, cache=False, kernels=chosen_ops)
    got = quantize.plan_file_weights(model, cfg, gguf, kernels=chosen_ops, min_bytes=0)
    gate = "model.layers.0.mlp.experts.gate_proj"
    assert {gate, "model.layers.1.mlp.experts.down_proj"} <= got.linears.keys()
    assert "model.layers.0.mlp.experts.gate_proj.weight" in got.names
    assert (got.linears[gate].fmt, got.linears[gate].n) == ("k4", cfg.num_experts * 256)
    for name, w in want.linears.items():
        assert torch.equal(w.blocks, got.linears[name].blocks)
        assert w.scale is None or torch.equal(w.scale, got.linears[name].scale)
    packed, stored = quantize.packed_bytes(model, cfg, gguf)
    experts = sum(t.nbytes for n, t in gguf.tensors.items() if "_exps." in n)
    assert stored >= experts and packed >= experts
    packed_cache.cache_path(path).unlink()
