"""SamplingMetadata: one step's batch of sampling settings as tensors, built once per step for
sampler.py's functions."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import Tensor

from phasewise.core.sampling_params import SamplingParams
from phasewise.kernels.kernel_api import Kernels


def _index_pairs(id_lists: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Flatten per-row id lists into (rows, cols) int64 index tensors, both [sum of lengths]."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    cols = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    return rows.to(device), cols.to(device)


def _column(values: Sequence[float], off: float, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """[B] tensor of a setting, or None when every row has its "off" value."""
    if all(v == off for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def _counts(output_ids: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[B, V] int32: how often each row's output holds each token."""
    rows, cols = _index_pairs(output_ids, device)
    counts = torch.zeros((len(output_ids), vocab_size), dtype=torch.int32, device=device)
    counts.index_put_((rows, cols), torch.ones_like(cols, dtype=torch.int32), accumulate=True)
    return counts


def _mask(id_lists: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[B, V] bool, True where row b's list contains the token."""
    mask = torch.zeros((len(id_lists), vocab_size), dtype=torch.bool, device=device)
    mask[_index_pairs(id_lists, device)] = True
    return mask


@dataclass(kw_only=True)
class SamplingMetadata:
    """Tensors for one step's batch of B rows, built once per step."""

    temperature: Tensor                 # [B] float32; rows with 0 are greedy
    top_k: Tensor | None                # [B] int64, V where disabled; None when no row uses top-k
    top_p: Tensor | None                # [B] float32; None when all rows are 1
    min_p: Tensor | None                # [B] float32; None when all 0
    repetition_penalty: Tensor | None   # [B] float32; None when all 1
    presence_penalty: Tensor | None     # [B] float32; None when all 0
    frequency_penalty: Tensor | None    # [B] float32; None when all 0
    # [B, V] bool, token in prompt; rows without repetition_penalty stay False
    prompt_mask: Tensor | None
    output_counts: Tensor | None        # [B, V] int32, occurrences in the output so far
    banned_mask: Tensor | None          # [B, V] bool, tokens forbidden this step (min_tokens)
    grammar_words: Tensor | None        # [B, ceil(V / 32)] int32, bit t % 32 of word t // 32 set where the
                                        # row's grammar allows token t (all set: no grammar); None: no row has
                                        # one
    generators: list[torch.Generator | None]  # per row; None = default generator
    all_greedy: bool
    max_num_logprobs: int | None        # max over rows of params.logprobs; None when no row wants them
    kernels: Kernels | None = None      # the engine's compiled CPU kernels (argmax), or None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        eos_token_ids: set[int] | frozenset[int],
        device: torch.device | str = "cpu",
        kernels: Kernels | None = None,
        grammar_bitmask: np.ndarray | Tensor | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's settings into tensors; filters and penalties nobody uses stay None.

        While a row has fewer than min_tokens outputs, its stop_token_ids are banned, and so
        are the eos ids unless ignore_eos (eos cannot end such a request anyway, as in vLLM).
        grammar_bitmask ([B, ceil(V / 32)] int32, numpy or torch; None: no grammar): bit t % 32 of word
        t // 32 is set where the row's grammar allows token t.
        """
        V = vocab_size
        if not len(prompt_ids) == len(output_ids) == len(generators) == len(params):
            raise ValueError("params, prompt_ids, output_ids and generators must have one entry per row")
        device = torch.device(device)
        column = partial(_column, device=device)
        f32 = torch.float32
        rep = column([p.repetition_penalty for p in params], 1.0, f32)
        presence = column([p.presence_penalty for p in params], 0.0, f32)
        frequency = column([p.frequency_penalty for p in params], 0.0, f32)
        prompt_mask = None if rep is None else _mask(
            [ids if p.repetition_penalty != 1.0 else [] for p, ids in zip(params, prompt_ids)], V, device)
        penalized = rep is not None or presence is not None or frequency is not None
        output_counts = _counts(output_ids, V, device) if penalized else None
        eos = sorted(eos_token_ids)
        banned = [p.stop_token_ids + ([] if p.ignore_eos else eos) if len(out) < p.min_tokens else []
                  for p, out in zip(params, output_ids)]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=f32, device=device),
            top_k=column([p.top_k if 0 < p.top_k < V else V for p in params], V, torch.long),
            top_p=column([p.top_p for p in params], 1.0, f32),
            min_p=column([p.min_p for p in params], 0.0, f32),
            repetition_penalty=rep,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            banned_mask=_mask(banned, V, device) if any(banned) else None,
            grammar_words=None if grammar_bitmask is None else torch.as_tensor(grammar_bitmask).to(device),
            generators=list(generators),
            all_greedy=all(p.temperature == 0 for p in params),
            max_num_logprobs=max(wanted, default=None),
            kernels=kernels,
        )
