"""Speculative decoding: proposers (n-gram lookup, a draft model), the rejection rule, verification.

The engine core only sees chunks that carry draft token ids (and opaque draft
probabilities); everything that needs torch lives here and in the runner.
"""
