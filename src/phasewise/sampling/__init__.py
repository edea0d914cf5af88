"""Sampling: per-request parameters (plain Python) and the batched sampler (torch, in sampler.py)."""

from phasewise.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
