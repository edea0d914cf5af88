"""Sampling: per-request parameters and the batched sampler."""

from phasewise.sampling.params import SamplingParams
from phasewise.sampling.sampler import SamplerOutput, SamplingMetadata, sample

__all__ = ["SamplingParams", "SamplingMetadata", "SamplerOutput", "sample"]
