"""What `phasewise serve` was told about serving: names, the key, the limits."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ServeOptions:
    """serve's server flags as `build_server` takes them, read once from the CLI's parse or a Serve
    config's (`from_args`)."""
    model: str | None                            # --model as given (a name requests may use)
    served_model_name: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    max_waiting: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    reasoning_parser: str = "auto"
    reasoning_budget: int = -1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(model=args.model, served_model_name=tuple(args.served_model_name or ()),
                   api_keys=tuple(args.api_key or ()), max_waiting=args.max_waiting,
                   max_body_bytes=args.max_body_bytes, reasoning_parser=args.reasoning_parser,
                   reasoning_budget=args.reasoning_budget)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()       # other names a request may use (the model path as given)
    # --api-key: any of them is let in (several: a cache salt per key)
    api_keys: tuple[str, ...] = ()
    max_waiting: int = 1024                   # queued sub-requests past which new ones get 503
    max_body_bytes: int = 4 * 1024 * 1024
    model_root: str = ""
    role: str | None = None                   # "prefill" | "decode": one side of a disaggregated pair
    reasoning_parser: str = "auto"            # thinking.CHOICES: the template's own, none, or a parser's name
    # --reasoning-budget: thinking tokens when a request gives no budget (-1: all)
    reasoning_budget: int = -1
    created: int = field(default_factory=lambda: int(time.time()))


def model_names(served: Sequence[str] | None, model: str | None, path: Path) -> tuple[str, tuple[str, ...]]:
    """(the name reported, the other names a request may use): --served-model-name's first name and the
    rest (as vLLM takes them: Claude Code asks for claude-... names), else the model file's stem; the
    model as given (--model) and its path are accepted too."""
    names = [*served] if served else [path.name if path.is_dir() else path.stem]
    return names[0], tuple(a for a in (*names[1:], model, str(path)) if a)
