"""phasewise: an LLM inference engine that shows, for every request, where the time goes."""

from phasewise.llm import LLM
from phasewise.outputs import CompletionOutput, StreamDelta
from phasewise.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "StreamDelta"]
__version__ = "0.1.0"
