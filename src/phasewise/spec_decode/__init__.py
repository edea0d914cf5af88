"""Speculative decoding's proposers: n-gram prompt lookup and a draft model.

The engine core only sees chunks that carry draft token ids (and opaque draft
probabilities); the target verifies them in the runner with the rejection sampler,
which lives beside the sampler (`sampling/rejection.py`, `sampling/verify.py`).
"""
