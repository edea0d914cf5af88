"""Cost of a workload from per-million-token prices, with and without prompt caching."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    """US dollars (or any currency) per million tokens."""
    input: float
    output: float
    cache_write: float | None = None   # default: the input price
    cache_read: float | None = None    # default: a tenth of the input price

    @property
    def write(self) -> float:
        return self.input if self.cache_write is None else self.cache_write

    @property
    def read(self) -> float:
        return self.input * 0.1 if self.cache_read is None else self.cache_read


@dataclass(frozen=True)
class Workload:
    requests: int
    input_tokens: int          # per request, the shared prefix included
    output_tokens: int         # per request
    shared_prefix_tokens: int = 0   # the part of the input every request shares (cacheable)

    def __post_init__(self) -> None:
        if self.requests < 0 or self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError("requests and token counts must be >= 0")
        if not 0 <= self.shared_prefix_tokens <= self.input_tokens:
            raise ValueError(f"the shared prefix (--prefix-len {self.shared_prefix_tokens}) must be between "
                             f"0 and the input (--input-len {self.input_tokens})")


@dataclass(frozen=True)
class Cost:
    input: float
    output: float
    cache_write: float = 0.0
    cache_read: float = 0.0

    @property
    def total(self) -> float:
        return self.input + self.output + self.cache_write + self.cache_read


def cost_without_caching(w: Workload, p: Prices) -> Cost:
    return Cost(w.requests * w.input_tokens * p.input / 1e6, w.requests * w.output_tokens * p.output / 1e6)


def cost_with_caching(w: Workload, p: Prices) -> Cost:
    """The first request writes the shared prefix to the cache; every later one reads it."""
    if w.requests == 0:
        return Cost(0.0, 0.0)
    uncached = w.input_tokens - w.shared_prefix_tokens
    return Cost(
        input=w.requests * uncached * p.input / 1e6,
        output=w.requests * w.output_tokens * p.output / 1e6,
        cache_write=w.shared_prefix_tokens * p.write / 1e6,
        cache_read=(w.requests - 1) * w.shared_prefix_tokens * p.read / 1e6,
    )
