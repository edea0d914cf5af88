"""The compiled CPU ops against their PyTorch reference paths, at every ISA level this CPU runs:
each op alone, then whole models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.layers.attention import AttentionMetadata, paged_attention
from phasewise.layers.norm import RMSNorm
from phasewise.layers.rotary import RotaryEmbedding
from tests.conftest import bind

def test_rms_norm_with_and_without_residual(ops):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data.normal_()
    x, r = torch.randn(7, 96), torch.randn(7, 96)
    ref_out, ref_res = norm(x, r)
    ref_plain = norm(x)
    norm.kernels = ops
    out, res = norm(x, r)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(res, ref_res)
    torch.testing.assert_close(norm(x), ref_plain)


def test_gelu_and_mul(ops):
    x = torch.randn(7, 2 * 200) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x, gelu=True), torch.nn.functional.gelu(gate, approximate="tanh") * up,
                               rtol=1e-5, atol=1e-5)


def test_silu_and_mul(ops):
    x = torch.randn(5, 2 * 40) * 4
    x[0, :16] = torch.linspace(-200, 175, 16)       # gates far past e^x's range both ways
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("V", [1, 15, 16, 49152, 1000])
def test_argmax_rows_matches_torch_even_on_ties(ops, V):
    torch.manual_seed(V)
    x = torch.randn(7, V)
    x[1] = x[1].round()                        # many ties: the first index wins, as in torch
    x[2] = 0.0
    x[3, : V // 2] = float("-inf")
    x[4] = float("-inf")
    x[5, -1] = 1e30                            # the last (maybe partial) vector
    x[6, V // 2:] = x[6, : V - V // 2].clone()  # equal maxima in both halves of the row
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    for r in range(7):                         # one row: cut in a piece per thread, the first still wins
        assert torch.equal(ops.argmax_rows(x[r:r + 1]), x[r:r + 1].argmax(-1)), r


@pytest.mark.parametrize("V", [1, 31, 32, 33, 49152, 1000])
def test_mask_rows_is_the_grammar_bitmask_applied(ops, V):
    """-inf exactly where a bit is clear, the logit itself elsewhere; whole words of 0 and -1 (the common
    case) and mixed ones; the torch path (the reference) gives the same."""
    from phasewise.sampling.sampler import apply_grammar, unpack_bitmask

    torch.manual_seed(V)
    W = (V + 31) // 32
    x = torch.randn(5, V)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, W), dtype=torch.int64).to(torch.int32)
    words[0], words[1, ::2], words[2] = -1, 0, 0
    want = torch.where(unpack_bitmask(words, V, x.device), x, float("-inf"))
    assert torch.equal(ops.mask_rows(x, words), want)
    assert torch.equal(apply_grammar(x, words), want) and torch.isinf(want[2]).all() and torch.equal(want[0], x[0])


def test_rope_and_cache_rotates_and_writes_the_slots(ops):
    torch.manual_seed(1)
    Hq, Hkv, D, T = 6, 2, 32, 5
    rope = RotaryEmbedding(D, 64, 10000.0)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D)
    positions = torch.tensor([0, 3, 9, 10, 63])
    slots = torch.tensor([4, 17, 2, 30, 8])
    kc, vc = torch.zeros(32, Hkv, D), torch.zeros(32, Hkv, D)
    none = torch.zeros(0, 4, dtype=torch.int64)          # tables and sequences: an int8 cache's only
    q, k = ops.rope_and_cache(qkv, positions, rope.cos, rope.sin, [kc, vc], slots, Hq, Hkv, none, none, 16)
    q_ref, k_ref, v_ref = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.reshape(T, Hq, D), k_ref.reshape(T, Hkv, D))
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(kc[slots], k_ref)
    torch.testing.assert_close(vc[slots], v_ref.reshape(T, Hkv, D))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert kc[untouched].abs().sum() == 0 and vc[untouched].abs().sum() == 0


CASES = [
    ([1], [1]),                          # a first decode
    ([1, 1, 1], [17, 64, 3]),            # decode-only, ragged contexts, a full last block
    ([1, 5, 12, 1], [40, 5, 30, 16]),    # mixed: decodes, a fresh prompt, a chunk over a cache
    ([4, 20], [9, 50]),                  # chunks in tiles, one of them ragged
    ([40], [40]),                        # a whole prompt
]


def _tables(context_lens: list[int], bs: int, num_blocks: int) -> list[list[int]]:
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for ctx in context_lens:
        n = -(-ctx // bs)
        tables.append(perm[used:used + n])
        used += n
    return tables


@pytest.mark.parametrize("query_lens, context_lens", CASES)
def test_paged_attention_matches_the_reference(ops, query_lens, context_lens):
    torch.manual_seed(2)
    Hq, Hkv, D, bs, num_blocks = 9, 3, 64, 16, 32
    tables = _tables(context_lens, bs, num_blocks)
    T = sum(query_lens)
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    caches = [torch.randn(num_blocks * bs, Hkv, D) for _ in range(2)]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, bs, torch.device("cpu"))
    ref = paged_attention(q, k, v, (caches[0].clone(), caches[1].clone()), meta)
    out = paged_attention(q, k, v, (caches[0], caches[1]), meta, ops=ops)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def _kernel_against_reference(ops, Hq: int, Hkv: int, head_dim: int, block_size: int, query_lens: list[int],
                              context_lens: list[int], window: int | None = None) -> None:
    """Random q, k, v and an fp32 cache: kernel == reference (the int8 cache: tests/test_kv_int8_kernels.py)."""
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    tables = _tables(context_lens, block_size, num_blocks)
    T = sum(query_lens)
    q, k, v = torch.randn(T, Hq, head_dim), torch.randn(T, Hkv, head_dim), torch.randn(T, Hkv, head_dim)
    caches = [torch.randn(num_blocks * block_size, Hkv, head_dim) * 2 for _ in range(2)]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, torch.device("cpu"))
    ref = paged_attention(q, k, v, tuple(c.clone() for c in caches), meta, window=window)
    out = paged_attention(q, k, v, tuple(caches), meta, ops=ops, window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim, Hq, Hkv", [(256, 4, 1), (64, 9, 3)])
@pytest.mark.parametrize("query_lens, context_lens", [
    ([1, 1, 1], [700, 33, 40]),          # decodes past, at and inside the window
    ([40, 1], [40, 900]),                # a prompt inside its window (tiled), a decode past it
    ([37, 20], [100, 60]),               # chunks whose keys reach past the window: row by row
])
def test_sliding_window_kernel_matches_the_reference(ops, head_dim, Hq, Hkv, query_lens, context_lens):
    """A sliding-window layer (Gemma 3's local layers, Mistral): each row sees its last 40 tokens."""
    torch.manual_seed(8)
    _kernel_against_reference(ops, Hq, Hkv, head_dim, 16, query_lens, context_lens, window=40)


def test_the_reference_window_is_the_masked_softmax():
    """The reference itself, against attention written out for one sequence: the query at position p
    sees keys p - W + 1 .. p."""
    torch.manual_seed(9)
    W, n, ctx, H, D, bs = 5, 6, 12, 2, 8, 4
    cache = [torch.randn(ctx, H, D) for _ in range(2)]
    q, k, v = torch.randn(n, H, D), cache[0][ctx - n:].clone(), cache[1][ctx - n:].clone()
    meta = AttentionMetadata.build([n], [ctx], [[0, 1, 2]], bs, torch.device("cpu"))
    out = paged_attention(q, k, v, (cache[0].clone(), cache[1].clone()), meta, window=W).view(n, H, D)
    for i in range(n):
        p = ctx - n + i
        keys = range(p - W + 1, p + 1)
        scores = torch.einsum("hd,khd->hk", q[i], cache[0][list(keys)]) * D ** -0.5
        expect = torch.einsum("hk,khd->hd", scores.softmax(-1), cache[1][list(keys)])
        torch.testing.assert_close(out[i], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (8, 4), (12, 3), (14, 2)])
def test_paged_attention_kernel_at_every_group_size(ops, head_dim, Hq, Hkv):
    """Decode rows: group sizes 1 to 4 have kernels with G fixed at compile time (1, 2 at head size
    128), the others the kernel that takes G at run time."""
    torch.manual_seed(6)
    _kernel_against_reference(ops, Hq, Hkv, head_dim, 16, [1, 1, 1], [300, 17, 64])


@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 32), (256, 8), (32, 16), (80, 16)])
@pytest.mark.parametrize("query_lens, context_lens", [
    ([1], [1000]),                       # one long decode: the context is cut into parts and merged
    ([1, 1], [70, 300]),                 # parts of unequal length, some of them empty
    ([3, 1, 1, 1, 1, 1, 1], [129, 1, 2, 64, 65, 33, 17]),   # many rows: one part each
])
def test_paged_attention_kernel_at_every_head_size_and_context(ops, head_dim, block_size, query_lens, context_lens):
    """The vectorised head sizes (64, 128, 256), the scalar fallback (32, 80), split long contexts."""
    torch.manual_seed(5)
    _kernel_against_reference(ops, 8, 2, head_dim, block_size, query_lens, context_lens)


@pytest.mark.slow
def test_default_model_logits_and_greedy_tokens_with_and_without_the_ops(llm, chosen_ops):
    """The engine's model, with the compiled ops and with the reference code, on a mixed batch."""
    from phasewise import SamplingParams

    model = llm.engine.model
    assert model.model.norm.kernels is not None, "the engine did not install the compiled ops"
    prompts = [list(range(300, 340)), list(range(500, 503)), list(range(700, 790))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    fast = llm.generate(prompts, params)
    bind(model, None)
    try:
        slow = llm.generate(prompts, params)
    finally:
        bind(model, chosen_ops)
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-3)


def test_no_kernels_env_turns_the_build_off(monkeypatch):
    from phasewise.kernels import build

    monkeypatch.setenv("PHASEWISE_NO_KERNELS", "1")
    assert build.load() is None


@settings(max_examples=30, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 700), st.sampled_from([1, 1, 2, 5, 20])), min_size=1, max_size=5),
       heads=st.sampled_from([(9, 3, 64), (8, 2, 64), (14, 2, 64), (12, 2, 128), (40, 2, 64), (4, 1, 256)]),
       window=st.sampled_from([0, 0, 40]), threads=st.sampled_from([1, 2]))
def test_a_rows_attention_is_the_same_bits_alone_in_a_run_or_beside_others(ops, seqs, heads, window, threads):
    """A query row gets the same bits whether it comes alone (a decode step), in a run of its
    sequence's positions (a prompt chunk, a speculative verify) or beside other sequences' rows: the
    speculative-decoding and prefix-cache exactness rests on it; on any thread count (a row's context
    is cut into parts by its own positions, not by the batch). seqs: (context length, run length).
    (An int8 cache: tests/test_kv_int8_kernels.py.)"""
    Hq, Hkv, D = heads
    bs = 16
    runs = [(max(n, r), r) for n, r in seqs]
    g = torch.Generator().manual_seed(sum(n * 31 + r for n, r in runs) + Hq + window)
    blocks = [-(-n // bs) for n, _ in runs]
    tables = torch.zeros(len(runs), max(blocks), dtype=torch.int64)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.arange(sum(blocks[:i]), sum(blocks[:i]) + n)
    slots = sum(blocks) * bs
    kv = [torch.randn(slots, Hkv, D, generator=g), torch.randn(slots, Hkv, D, generator=g)]
    seq = torch.tensor([i for i, (n, r) in enumerate(runs) for _ in range(r)])
    length = torch.tensor([n - r + 1 + j for n, r in runs for j in range(r)])
    q = torch.randn(len(seq), Hq, D, generator=g)
    none = torch.zeros(len(runs), 4, dtype=torch.int64)     # an int8 cache's sequences: unused
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = ops.paged_attention(q, kv, tables, seq, length, none, bs, D ** -0.5, window=window)
        torch.set_num_threads(3 - threads)
        for t in range(len(seq)):
            alone = ops.paged_attention(q[t:t + 1].contiguous(), kv, tables, seq[t:t + 1], length[t:t + 1], none, bs,
                                        D ** -0.5, window=window)
            assert torch.equal(alone[0], together[t]), t
    finally:
        torch.set_num_threads(before)
