"""The Gated DeltaNet's token mixer (kernels/csrc/gated_delta.cpp, `delta_net_mix`) at every ISA level this
CPU runs: against its PyTorch reference (layers/gated_delta.py) over batches of starting and continuing
sequences with one or two v heads per k head; against transformers' own conv and recurrent delta-rule
functions and its gated norm; and a row's bits the same alone, batched, or in chunks of any size."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from phasewise.layers.gated_delta import delta_net_mix


@dataclass(frozen=True)
class Shape:
    Hk: int
    Hv: int
    dk: int
    dv: int
    K: int = 4

    @property
    def C(self) -> int:
        return 2 * self.Hk * self.dk + self.Hv * self.dv


class Layer:
    """One layer's random weights and a pool of S state slots, with the step's inputs made from a seed."""

    def __init__(self, shape: Shape, slots: int = 6, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        s = self.shape = shape
        self.conv_w = torch.randn(s.C, s.K, generator=g) * 0.5
        self.neg_A = -torch.rand(s.Hv, generator=g).mul(3).exp()
        self.dt_bias = torch.randn(s.Hv, generator=g)
        self.norm_w = torch.randn(s.dv, generator=g)
        self.conv_states = torch.randn(slots, s.K - 1, s.C, generator=g)
        self.states = torch.randn(slots, s.Hv, s.dk, s.dv, generator=g) * 0.1

    def inputs(self, T: int, seed: int) -> dict[str, torch.Tensor]:
        g, s = torch.Generator().manual_seed(seed), self.shape
        return dict(qkv=torch.randn(T, s.C, generator=g) * 2, a=torch.randn(T, s.Hv, generator=g) * 2,
                    b=torch.randn(T, s.Hv, generator=g) * 2, z=torch.randn(T, s.Hv * s.dv, generator=g))

    def run(self, mix, x: dict[str, torch.Tensor], query_lens: list[int], context_lens: list[int], slots: list[int],
            states: tuple[torch.Tensor, torch.Tensor], norm: bool = True, tiled: bool = False) -> torch.Tensor:
        """mix (the kernel or the reference) over x from `states` (advanced in place); `tiled`: v head h
        reads q/k head h % Hk (llama.cpp's Qwen3.5 files)."""
        extra = dict(z=x["z"], norm_w=self.norm_w, eps=1e-6, tiled=tiled) if norm else dict(tiled=tiled)
        return mix(x["qkv"], x["a"], x["b"], self.conv_w, self.neg_A, self.dt_bias, *states, query_lens, context_lens,
                   slots, **extra)

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv_states.clone(), self.states.clone()


SHAPES = [Shape(2, 2, 16, 16), Shape(2, 4, 16, 24), Shape(1, 2, 8, 40, K=3), Shape(2, 4, 128, 128)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("norm,tiled", [(True, False), (False, False), (True, True)])
def test_the_kernel_matches_the_reference_over_starts_and_continuations(ops, shape, norm, tiled):
    """Three sequences at once: one starting (its slot's old contents ignored), a decode step and a
    continued chunk; then a second step from the states the first left."""
    layer = Layer(shape)
    ref_states, states = layer.fresh(), layer.fresh()
    for step, (query_lens, context_lens, slots) in enumerate([([5, 1, 7], [5, 9, 12], [3, 0, 5]),
                                                              ([1, 3, 2, 4], [6, 4, 14, 4], [3, 0, 5, 1])]):
        x = layer.inputs(sum(query_lens), seed=step)
        want = layer.run(delta_net_mix, x, query_lens, context_lens, slots, ref_states, norm, tiled)
        got = layer.run(ops.delta_net_mix, x, query_lens, context_lens, slots, states, norm, tiled)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states[1], ref_states[1], rtol=1e-4, atol=1e-6)
        assert torch.equal(states[0], ref_states[0])         # the conv state: copied inputs
    untouched = [s for s in range(6) if s not in (0, 1, 3, 5)]
    assert torch.equal(states[1][untouched], layer.states[untouched])


def test_the_kernel_matches_transformers_functions(ops):
    """A starting sequence and its continuation through transformers' causal_conv1d_fn and _update,
    l2-normed q and k in its torch_recurrent_gated_delta_rule, and its gated RMSNorm."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    s = Shape(2, 4, 16, 24)
    layer, (n1, n2) = Layer(s), (6, 3)
    x = layer.inputs(n1 + n2, seed=3)
    states = layer.fresh()
    got = torch.cat([layer.run(ops.delta_net_mix, {k: v[:n1] for k, v in x.items()}, [n1], [n1], [2], states, False),
                     layer.run(ops.delta_net_mix, {k: v[n1:] for k, v in x.items()}, [n2], [n1 + n2], [2], states,
                               False)])
    first = hf.causal_conv1d_fn(x["qkv"][None, :n1].mT, layer.conv_w, activation="silu")       # [1, C, n1]
    conv_state = x["qkv"][None, n1 - (s.K - 1):n1].mT.contiguous()                          # [1, C, K - 1]
    second = hf.causal_conv1d_update(x["qkv"][None, n1:].mT, conv_state, layer.conv_w, activation="silu")
    mixed = torch.cat([first, second], -1)[0].T                                              # [T, C]
    q, k, v = mixed.split([s.Hk * s.dk, s.Hk * s.dk, s.Hv * s.dv], -1)
    T = n1 + n2
    g = layer.neg_A * torch.nn.functional.softplus(x["a"] + layer.dt_bias)
    want, final = hf.torch_recurrent_gated_delta_rule(
        q.reshape(1, T, s.Hk, s.dk), k.reshape(1, T, s.Hk, s.dk), v.reshape(1, T, s.Hv, s.dv), g[None],
        x["b"].sigmoid()[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[1][2], final[0], rtol=1e-4, atol=1e-6)
    assert torch.equal(states[0][2], conv_state[0].T)
    norm = hf.Qwen3_5RMSNormGated(s.dv, eps=1e-6)
    norm.weight.data.copy_(layer.norm_w)
    normed = layer.run(ops.delta_net_mix, x, [T], [T], [4], layer.fresh())
    torch.testing.assert_close(normed, norm(want[0], x["z"].reshape(T, s.Hv, s.dv)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [Shape(2, 4, 16, 24), Shape(2, 4, 128, 128)], ids=str)
def test_a_rows_bits_are_the_same_alone_batched_and_in_any_chunks(ops, shape):
    """Two sequences (one starting, one continuing) batched in one call, each alone, and each in chunks
    of 1, 3 and mixed sizes, batched with the other's chunks: outputs and final states bit for bit."""
    layer, lens = Layer(shape), [11, 7]
    x = layer.inputs(sum(lens), seed=5)
    rows = [torch.arange(0, 11), torch.arange(11, 18)]
    ctx0, slots = [11, 7 + 20], [4, 1]                # sequence 1 has 20 tokens before this step

    def chunked(sizes: list[list[int]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Each sequence cut into sizes[i] pieces, step j batching piece j of every sequence that has one."""
        states, out = layer.fresh(), torch.empty(sum(lens), shape.Hv, shape.dv)
        done = [0, 0]
        for j in range(max(map(len, sizes))):
            seqs = [i for i in range(2) if j < len(sizes[i])]
            picked = torch.cat([rows[i][done[i]:done[i] + sizes[i][j]] for i in seqs])
            step = layer.run(ops.delta_net_mix, {k: v[picked] for k, v in x.items()}, [sizes[i][j] for i in seqs],
                             [done[i] + sizes[i][j] + (20 if i == 1 else 0) for i in seqs], [slots[i] for i in seqs],
                             states)
            out[picked] = step
            for i in seqs:
                done[i] += sizes[i][j]
        return out, states

    whole = layer.fresh()
    want = layer.run(ops.delta_net_mix, x, lens, ctx0, slots, whole)
    for sizes in ([[11], [7]], [[1] * 11, [1] * 7], [[3, 3, 3, 2], [3, 3, 1]], [[4, 1, 6], [2, 5]], [[11], [1] * 7]):
        got, states = chunked(sizes)
        assert torch.equal(got, want), sizes
        assert torch.equal(states[0], whole[0]) and torch.equal(states[1], whole[1]), sizes
    alone = layer.fresh()
    assert torch.equal(layer.run(ops.delta_net_mix, {k: v[11:] for k, v in x.items()}, [7], [27], [1], alone), want[11:])


def test_the_kernel_takes_column_slices_and_refuses_bad_steps(ops):
    """qkv, a, b and z may be column slices of one fused projection; lengths, slots and shapes are checked."""
    s = Shape(2, 4, 16, 24)
    layer = Layer(s)
    x = layer.inputs(6, seed=7)
    fused = torch.cat([x["qkv"], x["z"], x["b"], x["a"]], -1)
    sliced = dict(zip(["qkv", "z", "b", "a"], fused.split([s.C, s.Hv * s.dv, s.Hv, s.Hv], -1)))
    assert not sliced["qkv"].is_contiguous()
    want = layer.run(ops.delta_net_mix, x, [4, 2], [4, 9], [0, 1], layer.fresh())
    assert torch.equal(layer.run(ops.delta_net_mix, sliced, [4, 2], [4, 9], [0, 1], layer.fresh()), want)
    for lens, ctx, slots in (([4, 1], [4, 9], [0, 1]), ([4, 2], [4, 9], [1, 1]), ([4, 2], [4, 9], [0, 6]),
                             ([4, 2], [3, 9], [0, 1])):
        with pytest.raises(RuntimeError):
            layer.run(ops.delta_net_mix, x, lens, ctx, slots, layer.fresh())
