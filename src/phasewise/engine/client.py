"""EngineClient: what the server may ask of an engine (`LLMEngine` is one), and nothing more: prompts
in, steps, deltas out, request state and stats, the tokenizer, and KV transfer for disaggregation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from phasewise.config import EngineConfig
from phasewise.core.handoffs import EngineStats
from phasewise.core.request import Request
from phasewise.json_types import JsonObject, JsonValue
from phasewise.engine.kv_transfer import KVTransfer
from phasewise.engine.step_event import StepEvent, ThreadStats
from phasewise.models.config import ModelConfig
from phasewise.outputs import StreamDelta
from phasewise.core.sampling_params import SamplingParams
from phasewise.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from typing_extensions import TypeIs     # typing_extensions >= 4.10 (only mypy reads it here)

Prompt = str | list[int] | list[JsonObject]


def is_chat(prompt: Prompt) -> TypeIs[list[JsonObject]]:
    """The prompt is chat messages (a list of dicts), not text or token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat prompt as the template renders it: the messages (OpenAI's shape), the tools it lists, the
    template's own variables (a request's chat_template_kwargs: enable_thinking), and how it ends: an
    assistant turn opened (add_generation_prompt, the default), nothing after the last message, or inside
    the final assistant message, which the model continues (continue_final: a prefill; vLLM's
    continue_final_message)."""
    messages: list[JsonObject]
    tools: list[JsonObject] | None = None
    template_kwargs: JsonObject | None = None
    add_generation_prompt: bool = True
    continue_final: bool = False
    cache_points: tuple[CachePoint, ...] = ()


@dataclass(frozen=True)
class CachePoint:
    """A cache breakpoint of a chat prompt (Anthropic's cache_control): `cut` is the request cut just after
    the marked part (no turn opened after it); the prompt's tokens within the text the two render alike
    from the start are kept at least `ttl` seconds (LLMEngine.encode_marked turns it into
    SamplingParams.cache_breakpoints)."""
    cut: ChatPrompt
    ttl: float


class EngineBrokenError(RuntimeError):
    """The engine cannot run another step: a rank of its tensor-parallel group failed (or a step failed
    while the ranks ran it, so they are no longer in step). Its requests have ended; close() it."""


class EngineClient(Protocol):
    """Not thread-safe: one thread makes every call (the server's engine thread)."""
    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    kv_transfer: KVTransfer

    def encode_prompt(self, prompt: Prompt | ChatPrompt, chat: bool,
                      tools: Sequence[Mapping[str, JsonValue]] | None = None) -> list[int]:
        """Token ids of a prompt: a ChatPrompt (or chat messages, with OpenAI-style tools) through the chat
        template."""

    def encode_marked(self, prompt: ChatPrompt) -> tuple[list[int], tuple[tuple[int, float], ...]]:
        """A chat prompt's token ids and its cache points (Anthropic's cache_control) in tokens, as
        SamplingParams.cache_breakpoints."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False,
                    request_id: str | None = None,
                    tools: Sequence[Mapping[str, JsonValue]] | None = None) -> str:
        """Queue a prompt (admitted by engine/admission.py: RequestError when it cannot run); its id."""

    def abort(self, request_id: str) -> bool:
        """Stop a request now (its KV blocks are freed)."""

    def step(self) -> list[StreamDelta]:
        """One step; a delta for each request that produced a token or ended (EngineBrokenError when
        no step can run any more)."""

    def has_unfinished(self) -> bool:
        """Any request waiting or running."""

    def stats(self) -> EngineStats:
        """Requests, blocks and counters now."""

    def thread_stats(self) -> ThreadStats:
        """The kernel threads and what other programs took of the CPUs, now."""

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block."""

    @property
    def last_step(self) -> StepEvent | None:
        """The latest step: the core's record and the runner's extras."""

    def request(self, request_id: str) -> Request | None:
        """A live request, None once it has ended."""

    def live_request_ids(self) -> set[str]:
        """The requests still held (waiting or running)."""
