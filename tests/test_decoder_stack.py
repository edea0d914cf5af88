"""The C++ decoder stack against the model's Python layers (the same compiled ops, one by one), at
every ISA level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from phasewise.layers.attention import AttentionMetadata
from phasewise.loading.loader import choose_weight_forms
from phasewise.runner.kv_cache import INT4, KVCache
from tests.conftest import assert_paths_agree, bind


@pytest.fixture(scope="module")
def q4_model(default_model_path):
    from phasewise.loading.loader import load_model

    model, _ = load_model(default_model_path, "q4")
    return model


@pytest.fixture
def q4_stack(q4_model, ops):
    """The q4 model with one level's kernels and its decoder stack."""
    choose_weight_forms(q4_model, "cpu", torch.float32, ops)
    bind(q4_model, ops)
    assert q4_model.model.stack is not None, "no decoder stack for the q4 model"
    return q4_model


KEEP = {3: torch.tensor([0, 2, 5]), 4: torch.tensor([], dtype=torch.int64)}   # step → the rows wanted


@torch.inference_mode()
def run_steps(model, kv_dtype: torch.dtype, use_stack: bool) -> list[torch.Tensor]:
    """Three sequences: a batched prefill, then decode steps and a 4-token chunk over the cache, all
    batched; returns each step's logits: of every row, or of the rows KEEP names (none: the step's keys
    and values only, which the next steps read)."""
    stack = model.model.stack
    model.model.stack = stack if use_stack else None
    calls = []
    hook = model.model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    try:
        bs = 64 if kv_dtype == INT4 else 16
        cache = KVCache(model.config, 48, bs, kv_dtype, "cpu")
        tables = [list(range(0, 16)), list(range(16, 32)), list(range(32, 48))]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 40000, (n,), generator=g).tolist() for n in (37, 5, 120)]
        meta = AttentionMetadata.build([len(p) for p in prompts], [len(p) for p in prompts], tables, bs,
                                       torch.device("cpu"))
        ids = torch.tensor(sum(prompts, []))
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        out = [model.compute_logits(model(ids, pos, meta, cache.layers, torch.tensor([36, 41, 161])))]
        lens = [len(p) for p in prompts]
        for step in range(6):
            query = [4, 1, 1] if step == 3 else [1, 1, 1]      # a short chunk: still the kernel's rows
            new = torch.randint(0, 40000, (sum(query),), generator=g)
            pos = torch.cat([torch.arange(n, n + q) for n, q in zip(lens, query)])
            lens = [n + q for n, q in zip(lens, query)]
            meta = AttentionMetadata.build(query, lens, tables, bs, torch.device("cpu"))
            out.append(model.compute_logits(model(new, pos, meta, cache.layers, KEEP.get(step))))
        assert len(calls) == (0 if use_stack else 7)        # the stack took every step
        return out
    finally:
        hook.remove()
        model.model.stack = stack


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, INT4], ids=["fp32-kv", "int8-kv", "int4-kv"])
def test_stack_matches_the_python_layers(q4_stack, kv_dtype):
    fast = run_steps(q4_stack, kv_dtype, use_stack=True)
    ref = run_steps(q4_stack, kv_dtype, use_stack=False)
    for a, b in zip(fast, ref):
        assert_paths_agree(a, b)


def test_no_stack_without_kernels_or_for_fp32(q4_model, default_model_path, chosen_ops):
    from phasewise.loading.loader import load_model

    fp32, _ = load_model(default_model_path)
    bind(fp32, chosen_ops)
    assert fp32.model.stack is None and fp32.model.norm.kernels is chosen_ops   # its linears are not quantized
    bind(q4_model, chosen_ops)
    assert q4_model.model.stack is not None
    bind(q4_model, None)
    assert q4_model.model.stack is None


# ---- Gemma 3 and Qwen3: QK-norm, sandwich norms, GELU, windows, per-layer RoPE, KV groups ------------

@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def int8_family_model(request, tmp_path_factory):
    """A tiny random checkpoint of the family (6 layers; Gemma 3: five local with a window of 8, then
    a global one), its linear layers int8."""
    from model_builders import build_hf, hf_config

    from phasewise.loading.loader import load_model

    over = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64)
    if request.param == "gemma3":
        over.update(sliding_window=8, query_pre_attn_scalar=48)
    folder = tmp_path_factory.mktemp(request.param)
    build_hf(hf_config(request.param, **over), seed=3).save_pretrained(folder)
    model, cfg = load_model(folder, "int8")
    return model


@torch.inference_mode()
def run_group_steps(model, kv_dtype: torch.dtype) -> list[torch.Tensor]:
    """Three sequences, a batched prefill then six batched steps (one a 4-token chunk), each KV group
    with its own blocks; each step's logits (of the rows KEEP names, as run_steps)."""
    cfg, bs = model.config, 16
    groups = len(cfg.kv_groups)
    cache = KVCache(cfg, 12 * groups, bs, kv_dtype, "cpu")
    tables = [[list(range(12 * g + 4 * s, 12 * g + 4 * s + 4)) for s in range(3)] for g in range(groups)]
    g = torch.Generator().manual_seed(0)
    lens, query, out = [0, 0, 0], [37, 5, 20], []
    for step in range(7):
        new = torch.randint(0, 256, (sum(query),), generator=g)
        pos = torch.cat([torch.arange(n, n + q) for n, q in zip(lens, query)])
        lens = [n + q for n, q in zip(lens, query)]
        meta = AttentionMetadata.build_groups(query, lens, tables, bs, torch.device("cpu"))
        keep = torch.tensor([36, 41, 61]) if step == 0 else KEEP.get(step)
        out.append(model.compute_logits(model(new, pos, meta, cache.layers, keep)))
        query = [4, 1, 1] if step == 2 else [1, 1, 1]
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["fp32-kv", "int8-kv"])
def test_family_stack_matches_the_python_layers(int8_family_model, ops, kv_dtype):
    model = int8_family_model
    choose_weight_forms(model, "cpu", torch.float32, ops)
    bind(model, ops)
    stack = model.model.stack
    assert stack is not None, "no decoder stack for the model"
    try:
        fast = run_group_steps(model, kv_dtype)
        model.model.stack = None
        ref = run_group_steps(model, kv_dtype)
    finally:
        model.model.stack = stack
    for a, b in zip(fast, ref):
        assert_paths_agree(a, b)


# ---- mixtures of experts: routers, experts in their K-quant blocks, a shared expert, a dense layer ---

@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_moe_stack_matches_the_python_layers(ops, case, tmp_path):
    """Each architecture's sparse layers run in the stack (Qwen3-MoE with a dense layer among them,
    Qwen2-MoE's shared expert, OLMoE's QK-norm over all of q and k) as in the Python layers."""
    from test_expert_kernels import kquant_moe

    from phasewise.loading.loader import load_prepared

    kquant_moe(case, tmp_path / "m.gguf", **({"clip_qkv": None} if case == "olmoe" else {}))
    model, cfg = load_prepared(tmp_path / "m.gguf", "q4", kernels=ops)
    model.build_stack(ops)
    stack = model.model.stack
    assert stack is not None, "no decoder stack for the model"
    try:
        fast = run_group_steps(model, torch.float32)
        model.model.stack = None
        ref = run_group_steps(model, torch.float32)
    finally:
        model.model.stack = stack
    for a, b in zip(fast, ref):
        assert_paths_agree(a, b)



def test_python_describes_a_layer_with_the_fields_the_binding_takes(chosen_ops):
    """kernel_api.StackLayer and StackSparse name, in order, the fields of C++'s LayerSpec and SparseArgs
    (decoder_stack.h): a field added on one side and not the other fails here, not in a wrong layer."""
    from phasewise.kernels.kernel_api import StackLayer, StackMixer, StackSparse

    layer, sparse, mixer = chosen_ops.stack_fields()
    assert list(StackLayer._fields) == layer
    assert list(StackSparse._fields) == sparse
    assert list(StackMixer._fields) == mixer
