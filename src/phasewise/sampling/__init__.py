"""Sampling: per-request parameters (plain Python) and the batched sampler (torch, in sampler.py)."""

from phasewise.sampling.params import SamplingParams, StructuredOutputs

__all__ = ["SamplingParams", "StructuredOutputs"]
