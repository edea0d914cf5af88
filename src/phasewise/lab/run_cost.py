"""A recorded run priced as the seeds price prompt caching (`phasewise cost --from-run`): what its requests
cost with the prompt cache as it served them, against every prompt token at the input price.

A run is the load generator's `requests.csv` (`phasewise bench serve --result-dir`: a row per request
with prompt_tokens, cached_tokens and output_tokens, as each server's usage reported them; failed rows
are skipped), its folder, or a JSON Lines file of usage objects, one a request, in any of the three APIs'
shapes (or whole response bodies holding one): Anthropic's (input_tokens past the cache,
cache_read_input_tokens, cache_creation_input_tokens split in cache_creation by ttl), chat completions'
(prompt_tokens, prompt_tokens_details.cached_tokens) and Responses' (input_tokens,
input_tokens_details.cached_tokens). Only Anthropic's usage reports cache writes; for a request whose
usage reports none, `unmarked` says how its prompt tokens not read from the cache are priced: as input
("none", OpenAI's automatic caching) or as writes at "5m" or "1h" (the whole prompt marked, as Anthropic's
automatic caching marks it).

Prices, per million tokens: the input and output prices given; a write costs 1.25x the input price at a
5-minute ttl and 2x at an hour, a read 0.1x. ROI: what caching saved (what the reads saved against plain
input, less the write premium: what the writes cost beyond plain input) over the write premium; None when
no premium was paid.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from phasewise.json_types import JsonObject, JsonValue

WRITE_5M, WRITE_1H, READ = 1.25, 2.0, 0.1      # the seeds' prices, times the input price
Unmarked = Literal["none", "5m", "1h"]


@dataclass
class RunTokens:
    """A run's tokens over its requests: every prompt token is input, a read or a write."""
    requests: int = 0
    prompt: int = 0
    read: int = 0
    write_5m: int = 0
    write_1h: int = 0
    output: int = 0
    unreported: int = 0                 # requests whose usage reports no cache writes

    @property
    def input(self) -> int:
        """Prompt tokens neither read from nor written to the cache."""
        return self.prompt - self.read - self.write_5m - self.write_1h

    def add(self, prompt: int, read: int, output: int, writes: tuple[int, int] | None,
            unmarked: Unmarked) -> None:
        """One request; writes: (5m, 1h) as its usage reports them, None when it reports none."""
        if writes is None:
            self.unreported += 1
            rest = prompt - read
            writes = (rest, 0) if unmarked == "5m" else (0, rest) if unmarked == "1h" else (0, 0)
        if min(prompt, read, output, *writes) < 0 or read + sum(writes) > prompt:
            raise ValueError(f"request {self.requests + 1}: a usage of {prompt} prompt tokens cannot have "
                             f"{read} read and {sum(writes)} written")
        self.requests += 1
        self.prompt, self.read, self.output = self.prompt + prompt, self.read + read, self.output + output
        self.write_5m, self.write_1h = self.write_5m + writes[0], self.write_1h + writes[1]


@dataclass(frozen=True)
class RunCost:
    input: float
    write_5m: float
    write_1h: float
    read: float
    output: float

    @property
    def total(self) -> float:
        return self.input + self.write_5m + self.write_1h + self.read + self.output


@dataclass(frozen=True)
class RunPricing:
    tokens: RunTokens
    input_price: float
    output_price: float
    with_cache: RunCost = field(init=False)
    without_cache: RunCost = field(init=False)

    def __post_init__(self) -> None:
        t, p = self.tokens, self.input_price / 1e6
        out = t.output * self.output_price / 1e6
        object.__setattr__(self, "with_cache", RunCost(t.input * p, t.write_5m * p * WRITE_5M,
                                                       t.write_1h * p * WRITE_1H, t.read * p * READ, out))
        object.__setattr__(self, "without_cache", RunCost(t.prompt * p, 0.0, 0.0, 0.0, out))

    @property
    def saved(self) -> float:
        return self.without_cache.total - self.with_cache.total

    @property
    def read_savings(self) -> float:
        """What the reads saved against the same tokens as plain input."""
        return self.tokens.read * self.input_price / 1e6 * (1 - READ)

    @property
    def premium(self) -> float:
        """What the writes cost beyond the same tokens as plain input."""
        p = self.input_price / 1e6
        return self.tokens.write_5m * p * (WRITE_5M - 1) + self.tokens.write_1h * p * (WRITE_1H - 1)

    @property
    def roi(self) -> float | None:
        """(read savings - write premium) / write premium, the caching's return (None: no premium paid)."""
        return self.saved / self.premium if self.premium > 0 else None

    def as_json(self) -> JsonObject:
        t = self.tokens
        costs: JsonObject = {name: {**vars(c), "total": c.total}
                             for name, c in (("with_cache", self.with_cache),
                                             ("without_cache", self.without_cache))}
        return {"tokens": {**vars(t), "input": t.input},
                "prices_per_million": {"input": self.input_price, "output": self.output_price,
                                       "cache_write_5m": self.input_price * WRITE_5M,
                                       "cache_write_1h": self.input_price * WRITE_1H,
                                       "cache_read": self.input_price * READ},
                **costs, "saved": self.saved, "read_savings": self.read_savings,
                "write_premium": self.premium, "roi": self.roi,
                "read_share": t.read / t.prompt if t.prompt else 0.0}


def read_run(path: Path, unmarked: Unmarked = "none") -> RunTokens:
    """The tokens of a recorded run (see the module's docstring); ValueError for a file of another kind."""
    path = path / "requests.csv" if path.is_dir() else path
    tokens = RunTokens()
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row.get("ok", "True") != "True":
                    continue
                if "prompt_tokens" not in row or "output_tokens" not in row:
                    raise ValueError(f"{path}: not a requests.csv of phasewise bench serve (no "
                                     "prompt_tokens column)")
                tokens.add(int(row["prompt_tokens"]), int(row.get("cached_tokens") or 0),
                           int(row["output_tokens"]), None, unmarked)
        return tokens
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                value = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            tokens.add(*usage_tokens(value, f"{path}:{n}"), unmarked)
    return tokens


def usage_tokens(value: JsonValue, where: str) -> tuple[int, int, int, tuple[int, int] | None]:
    """(prompt, read, output, (5m, 1h) writes or None) of one usage object or a body holding one."""
    u = value.get("usage", value) if isinstance(value, dict) else None
    if not isinstance(u, dict):
        raise ValueError(f"{where}: not a usage object")

    def n(obj: JsonValue, key: str) -> int:
        got = obj.get(key) if isinstance(obj, dict) else None
        return got if isinstance(got, int) and not isinstance(got, bool) else 0

    if "cache_read_input_tokens" in u or "cache_creation_input_tokens" in u:        # Anthropic's
        created, split = n(u, "cache_creation_input_tokens"), u.get("cache_creation")
        hour = n(split, "ephemeral_1h_input_tokens") if isinstance(split, dict) else 0
        read = n(u, "cache_read_input_tokens")
        return n(u, "input_tokens") + read + created, read, n(u, "output_tokens"), (created - hour, hour)
    if "prompt_tokens" in u:                                                          # chat / completions
        return n(u, "prompt_tokens"), n(u.get("prompt_tokens_details"), "cached_tokens"), \
            n(u, "completion_tokens"), None
    if "input_tokens" in u:                                                           # Responses
        return n(u, "input_tokens"), n(u.get("input_tokens_details"), "cached_tokens"), \
            n(u, "output_tokens"), None
    raise ValueError(f"{where}: a usage object names prompt_tokens or input_tokens")
