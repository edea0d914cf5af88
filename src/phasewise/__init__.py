"""phasewise: an LLM inference engine that shows, for every request, where the time goes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phasewise.core.sampling_params import SamplingParams, StructuredOutputs

if TYPE_CHECKING:
    from phasewise.llm import LLM
    from phasewise.outputs import CompletionOutput, StreamDelta

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "CompletionOutput", "StreamDelta"]
__version__ = "0.1.0"

_LAZY = {"LLM": "phasewise.llm", "CompletionOutput": "phasewise.outputs", "StreamDelta": "phasewise.outputs"}


def __getattr__(name: str) -> type[LLM | CompletionOutput | StreamDelta]:
    """Import torch-backed parts on first use, so the engine core stays importable without torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'phasewise' has no attribute {name!r}")
