"""Sampling: per-request parameters (plain Python) and the batched sampler (torch, in sampler.py)."""

from phasewise.sampling.params import ConstraintError, SamplingParams, StructuredOutputs

__all__ = ["ConstraintError", "SamplingParams", "StructuredOutputs"]
