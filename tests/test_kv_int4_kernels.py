"""The int4 KV cache's kernels (csrc/kv_write.cpp, csrc/attention.h's readers) against their PyTorch
reference (layers/kv_int4.py) at every ISA level this CPU runs: the writer's bytes, attention over
histories written in steps of every size, partial groups and group boundaries, and a row's bits alone,
in a run or beside others (what greedy speculation and prefix hits rest on)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.layers import kv_int4
from phasewise.layers.attention import AttentionMetadata, paged_attention
from tests.kv_int8_world import CPU, int4_cache, key_offsets, keys, tables_for, write_history

CASES = [
    ([1], [1]),                          # a first decode
    ([1, 1, 1], [65, 128, 3]),           # decode-only: just past a group, at a group's end, inside the first
    ([1, 5, 12, 1], [70, 5, 100, 64]),   # mixed: decodes, a fresh prompt, a chunk over a cache
    ([4, 70], [69, 150]),                # chunks in tiles, one across three groups from inside one
    ([130], [130]),                      # a whole prompt
    ([65, 1], [128, 1000]),              # a chunk of 65 ending at a group's end; a long decode cut in parts
]
CHUNKS = (1, 3, 16, 40, 70)


def step(query_lens: list[int], context_lens: list[int], Hq: int, Hkv: int, D: int, bs: int, seed: int):
    """A cache holding each sequence's history, the step's metadata and its q, k, v."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = tables_for(context_lens, bs, g)
    kv, off = int4_cache(num_blocks, bs, Hkv, D), key_offsets(Hkv, D, g)
    write_history(kv, tables, [c - n for n, c in zip(query_lens, context_lens)], bs, off, g, CHUNKS)
    T = sum(query_lens)
    q, k, v = torch.randn(T, Hq, D, generator=g), keys(T, off, g), torch.randn(T, Hkv, D, generator=g)
    return kv, AttentionMetadata.build(query_lens, context_lens, tables, bs, CPU), q, k, v


def kernel_against_reference(ops, query_lens, context_lens, Hq=9, Hkv=3, D=64, bs=64, window=None, seed=0):
    kv, meta, q, k, v = step(query_lens, context_lens, Hq, Hkv, D, bs, seed)
    ref_kv, ker_kv = [t.clone() for t in kv], [t.clone() for t in kv]
    ref = paged_attention(q, k, v, tuple(ref_kv), meta, window=window)
    out = paged_attention(q, k, v, tuple(ker_kv), meta, ops=ops, window=window)
    for name, a, b in zip(("k", "v", "k_groups", "v_scale", "tails", "tail_groups"), ref_kv, ker_kv):
        assert torch.equal(a, b), name
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-4)


def test_the_layout_round_trips_and_holds_its_values():
    """Codes pack two a byte and back; values come back within half a step (q4_0's rounding: but for those
    past 7 steps opposite the largest value), keys of a group within half their channel's step (fp16 minimum
    and step)."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (5, 3, 128), generator=g, dtype=torch.uint8)
    assert torch.equal(kv_int4.unpack(kv_int4.pack(codes)), codes)
    v = torch.randn(7, 2, 128, generator=g) * 3
    packed, scales = kv_int4.quantize_values(v)
    d = scales.float().abs().repeat_interleave(32, -1)
    clipped = (v.abs() - 7 * d).clamp(min=0)             # past 7 steps on the side opposite the largest value
    assert ((kv_int4.values(packed, scales) - v).abs() <= d / 2 + clipped + 1e-6).all()
    x = keys(64, key_offsets(2, 64, g), g)
    packed, params = kv_int4.quantize_group(x)
    lo, step = params.float().unbind(-2)
    back = lo + step * kv_int4.unpack(packed).float()
    assert ((back - x).abs() <= step / 2 + 1e-3 * (1 + x.abs())).all()


@pytest.mark.parametrize("query_lens, context_lens", CASES)
def test_the_int4_cache_kernels_write_and_read_as_the_reference(ops, query_lens, context_lens):
    kernel_against_reference(ops, query_lens, context_lens)


@pytest.mark.parametrize("D, bs, Hq, Hkv", [(64, 64, 14, 2), (128, 64, 8, 2), (256, 64, 4, 1), (192, 64, 6, 3),
                                             (64, 128, 12, 3), (128, 192, 16, 2)])
def test_every_head_size_group_size_and_block_size(ops, D, bs, Hq, Hkv):
    """The vectorised head sizes (64, 128, 256), the scalar loop (192); decode rows of every group size;
    blocks of one to three key groups."""
    kernel_against_reference(ops, [3, 1, 1, 1, 1], [129, 1, 65, 300, 47], Hq, Hkv, D, bs, seed=D + bs)


@pytest.mark.parametrize("query_lens, context_lens", [([1, 1, 1], [700, 65, 80]), ([40, 1], [40, 900]),
                                                      ([37, 20], [150, 90])])
def test_a_sliding_window_over_an_int4_cache(ops, query_lens, context_lens):
    kernel_against_reference(ops, query_lens, context_lens, Hq=4, Hkv=1, D=256, window=40, seed=3)


def test_rope_and_cache_writes_an_int4_cache_as_write_kv(ops):
    """The fused rotate-and-write gives the writer's bytes: a group that fills in the step quantized, the
    sequence's partial groups in its tail."""
    from phasewise.layers.rotary import RotaryEmbedding

    Hq, Hkv, D = 6, 2, 64
    kv, meta, _, _, _ = step([5, 70], [69, 70], Hq, Hkv, D, 64, seed=4)
    qkv = torch.randn(75, (Hq + 2 * Hkv) * D) * 3
    positions = torch.tensor(list(range(64, 69)) + list(range(70)))
    rope = RotaryEmbedding(D, 128, 10000.0)
    fused = [t.clone() for t in kv]
    rows = meta.kernel_rows
    q, k = ops.rope_and_cache(qkv, positions, rope.cos, rope.sin, fused, meta.slot_mapping, Hq, Hkv, rows.tables,
                              rows.seqs, 64)
    v = qkv[:, (Hq + Hkv) * D:].reshape(-1, Hkv, D)
    kv_int4.write(kv, meta, k, v)
    for a, b in zip(kv, fused):
        assert torch.equal(a, b)


def test_a_verify_that_fills_a_group_with_rejected_drafts_then_refills_it(ops):
    """Drafts past a group's end quantize it with their keys; after they are rejected the sequence is back
    inside the group, reads its keys as floats from the tail, and the group is quantized again from the
    accepted ones when it really fills: the cache then holds what a plain decode writes."""
    g = torch.Generator().manual_seed(7)
    Hq, Hkv, D, bs = 4, 2, 64, 64
    tables, num_blocks = tables_for([192], bs, g)
    kv, off = int4_cache(num_blocks, bs, Hkv, D), key_offsets(Hkv, D, g)
    write_history(kv, tables, [61], bs, off, g, CHUNKS)
    plain = [t.clone() for t in kv]
    drafts = keys(6, off, g)                                   # positions 61..66 (a verify of 5 drafts)
    vals = torch.randn(6, Hkv, D, generator=g)
    verify = AttentionMetadata.build([6], [67], tables, bs, CPU)
    ops.write_kv(drafts, vals, kv, verify.slot_mapping, verify.kernel_rows.tables, verify.kernel_rows.seqs, bs)
    accepted = keys(5, off, g)                                 # one accepted: positions 61, 62 are right
    accepted[:2] = drafts[:2]
    for p in range(61, 66):                                     # the plain path decodes them one by one
        meta = AttentionMetadata.build([1], [p + 1], tables, bs, CPU)
        ops.write_kv(accepted[p - 61:p - 60].contiguous(), vals[p - 61:p - 60].contiguous(), plain,
                     meta.slot_mapping, meta.kernel_rows.tables, meta.kernel_rows.seqs, bs)
    after = AttentionMetadata.build([3], [66], tables, bs, CPU)   # the next step: 63, 64, 65 anew
    ops.write_kv(accepted[2:].contiguous(), vals[2:5].contiguous(), kv, after.slot_mapping, after.kernel_rows.tables,
                 after.kernel_rows.seqs, bs)
    group = tables[0][0] * bs
    assert torch.equal(kv[0][group:group + 64], plain[0][group:group + 64])
    assert torch.equal(kv[2][group // 64], plain[2][group // 64])
    assert torch.equal(kv[1][group:group + 64], plain[1][group:group + 64])
    assert torch.equal(kv[3][group:group + 64], plain[3][group:group + 64])
    q = torch.randn(1, Hq, D, generator=g)
    meta = AttentionMetadata.build([1], [66], tables, bs, CPU)
    fresh, fresh_v = accepted[4:5].contiguous(), vals[4:5].contiguous()
    a = ops.paged_attention(q, kv, meta.kernel_rows.tables, meta.kernel_rows.seq, meta.kernel_rows.length,
                            meta.kernel_rows.seqs, bs, D ** -0.5, fresh=fresh, fresh_v=fresh_v)
    b = ops.paged_attention(q, plain, meta.kernel_rows.tables, meta.kernel_rows.seq, meta.kernel_rows.length,
                            meta.kernel_rows.seqs, bs, D ** -0.5, fresh=fresh, fresh_v=fresh_v)
    assert torch.equal(a, b)


def _alone(ops, kv, tables, start, t_pos, k, v, q, bs, window):
    """Row at position t_pos of a sequence whose cache holds its first `start` tokens: the tokens between
    written as one step, then the row decoded alone (the engine's plain path)."""
    D = q.shape[-1]
    if t_pos > start:
        meta = AttentionMetadata.build([t_pos - start], [t_pos], tables, bs, CPU)
        rows = meta.kernel_rows
        ops.write_kv(k[:t_pos - start].contiguous(), v[:t_pos - start].contiguous(), kv, meta.slot_mapping, rows.tables,
                     rows.seqs, bs)
    meta = AttentionMetadata.build([1], [t_pos + 1], tables, bs, CPU)
    rows, i = meta.kernel_rows, t_pos - start
    ops.write_kv(k[i:i + 1].contiguous(), v[i:i + 1].contiguous(), kv, meta.slot_mapping, rows.tables, rows.seqs, bs)
    return ops.paged_attention(q.contiguous(), kv, rows.tables, rows.seq, rows.length, rows.seqs, bs, D ** -0.5,
                               fresh=k[i:i + 1].contiguous(), window=window, fresh_v=v[i:i + 1].contiguous())[0]


@settings(max_examples=20, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 400), st.sampled_from([1, 1, 2, 5, 17, 20, 66])), min_size=1,
                     max_size=3),
       heads=st.sampled_from([(9, 3, 64), (8, 2, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256)]),
       window=st.sampled_from([0, 0, 40]), threads=st.sampled_from([1, 2]))
def test_a_rows_attention_is_the_same_bits_alone_in_a_run_or_beside_others(ops, seqs, heads, window, threads):
    """Over an int4 cache a row reads the groups below its length as int4 and its own group's keys as
    floats, whichever rows share its call: a run of a prompt chunk or a verify (where later rows see a
    group that fills as int4) gives each row what decoding it alone gives. seqs: (context, run length)."""
    Hq, Hkv, D = heads
    bs = 64
    runs = [(max(n, r), r) for n, r in seqs]
    g = torch.Generator().manual_seed(sum(n * 31 + r for n, r in runs) + Hq + window)
    tables, num_blocks = tables_for([n for n, _ in runs], bs, g)
    kv, off = int4_cache(num_blocks, bs, Hkv, D), key_offsets(Hkv, D, g)
    write_history(kv, tables, [n - r for n, r in runs], bs, off, g, CHUNKS)
    T = sum(r for _, r in runs)
    q, k, v = torch.randn(T, Hq, D, generator=g), keys(T, off, g), torch.randn(T, Hkv, D, generator=g)
    meta = AttentionMetadata.build([r for _, r in runs], [n for n, _ in runs], tables, bs, CPU)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together_kv = [t.clone() for t in kv]
        together = paged_attention(q, k, v, tuple(together_kv), meta, ops=ops, window=window or None).view(T, Hq, D)
        torch.set_num_threads(3 - threads)
        row = 0
        for i, (n, r) in enumerate(runs):
            for j in range(r):
                alone_kv = [t.clone() for t in kv]
                # the sequence alone, in tail slot 0 as a single-sequence engine step would hold it
                alone_kv[5][0] = kv[5][i]
                alone_kv[4][:2] = kv[4][2 * i:2 * i + 2]
                got = _alone(ops, alone_kv, [tables[i]], n - r, n - r + j, k[row - j:row - j + r],
                             v[row - j:row - j + r], q[row:row + 1], bs, window)
                assert torch.equal(got, together[row]), (i, j)
                row += 1
    finally:
        torch.set_num_threads(before)
