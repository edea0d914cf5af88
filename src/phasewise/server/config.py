"""What `phasewise serve` was told about serving: names, the key, the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()       # other names a request may use (the model path as given)
    api_key: str | None = None
    max_waiting: int = 1024                   # queued sub-requests past which new ones get 503
    max_body_bytes: int = 4 * 1024 * 1024
    model_root: str = ""
    role: str | None = None                   # "prefill" | "decode": one side of a disaggregated pair
    reasoning_parser: str = "auto"            # thinking.CHOICES: the template's own, none, or a parser's name
    created: int = field(default_factory=lambda: int(time.time()))
