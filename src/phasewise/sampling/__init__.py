"""Sampling: the batched sampler (sampler.py) and speculative verification (rejection.py, verify.py).

A request's parameters, `SamplingParams`, are plain Python and live with the request in
`core/sampling_params.py`."""
