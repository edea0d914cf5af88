"""The offline API: LLM.generate (many prompts, batched by the engine), chat, and stream."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from phasewise.config import (CacheConfig, EngineConfig, KernelChoice, KVDtypeChoice, SchedulerConfig,
                              SpeculativeConfig)
from phasewise.core.prompt_store import Clock
from phasewise.engine.llm_engine import LLMEngine
from phasewise.json_types import JsonObject, JsonValue
from phasewise.outputs import CompletionOutput, StreamDelta
from phasewise.engine.precision import weights_setting
from phasewise.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs     # typing_extensions >= 4.10 (only mypy reads it here)

Prompt = str | list[int]
Messages = list[JsonObject]


def _is_token_ids(prompts: Prompt | Sequence[Prompt]) -> TypeIs[list[int]]:
    """One prompt of token ids, not several prompts."""
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)


def _is_conversation(messages: Messages | Sequence[Messages]) -> TypeIs[Messages]:
    """One conversation's messages, not several conversations."""
    return isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)


class LLM:
    """A model ready to generate. `LLM()` loads the default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", quantization: str = "auto",
                 device: str = "cpu",
                 kernels: KernelChoice = "auto", block_size: int = 16, kv_cache_memory: float = 2.0,
                 num_blocks: int | None = None, enable_prefix_caching: bool = True,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 max_model_len: int | None = None, kv_dtype: KVDtypeChoice = "auto",
                 speculative: str | SpeculativeConfig | None = None, num_speculative_tokens: int = 4,
                 tensor_parallel_size: int = 1, warmup: bool = True, packed_cache: bool = True,
                 threads: int | None = None, prompt_cache_dir: str | None = None,
                 prompt_cache_size: float = 10.0, prompt_cache_ttl: float = 3600.0,
                 clock: Clock | None = None) -> None:
        """dtype (the float type) and quantization (the weight format: int8, q4, none) and kv_dtype
        "auto": the fastest precision for this machine within 0.5% perplexity of the file's weights
        (engine/precision.py; `engine.precision` says which). speculative: None,
        "ngram", "draft" (this model's file at q4) or "draft:MODEL", with num_speculative_tokens
        drafts per step; a SpeculativeConfig for the other settings. tensor_parallel_size: split the
        model over that many processes on this machine (close() stops them). packed_cache: map a GGUF's
        packed weights from the cache directory after the first load packs them. threads: the kernels'
        thread count, pinned (None: one per core while the machine is free, fewer while other programs
        keep cores busy). prompt_cache_dir: the prefix cache's disk tier there (blocks survive a restart and
        are shared by the processes using the directory), within prompt_cache_size GiB, each block kept
        prompt_cache_ttl seconds after its last use unless its request's cache_ttl says otherwise (TTLs
        measured by `clock`, the wall clock by default); close() finishes its writes."""
        if not isinstance(speculative, SpeculativeConfig):
            speculative = SpeculativeConfig.parse(speculative, num_speculative_tokens=num_speculative_tokens)
        config = EngineConfig(
            model=model, dtype=weights_setting(dtype, quantization), device=device, kernels=kernels,
            cache=CacheConfig(block_size=block_size, kv_cache_memory_gib=kv_cache_memory,
                              num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching,
                              kv_dtype=kv_dtype, prompt_cache_dir=prompt_cache_dir,
                              prompt_cache_size_gib=prompt_cache_size,
                              prompt_cache_ttl=prompt_cache_ttl),
            scheduler=SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len),
            speculative=speculative, tensor_parallel_size=tensor_parallel_size, packed_cache=packed_cache,
            threads=threads)
        self.engine = LLMEngine(config, clock)
        if warmup:
            self.engine.warmup()
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config

    def close(self) -> None:
        """Finish the prompt cache's disk writes; stop the other ranks of a tensor-parallel model."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def load_ms(self) -> float:
        return self.engine.load_ms

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Raw text (or token ids) in, one output per prompt, all run together through the engine."""
        batch = [prompts] if isinstance(prompts, str) or _is_token_ids(prompts) else list(prompts)
        return self._run(batch, sampling_params, chat=False)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: Sequence[Mapping[str, JsonValue]] | None = None
             ) -> CompletionOutput | list[CompletionOutput]:
        """Chat messages through the model's chat template (with OpenAI-style tools: the template's own
        tool support, or a generic prompt; `phasewise.tool_calling.ToolCallParser(llm.tokenizer.tool_format)`
        finds the calls in the text); one conversation → one output."""
        if _is_conversation(messages):
            return self._run([messages], sampling_params, chat=True, tools=tools)[0]
        return self._run(list(messages), sampling_params, chat=True, tools=tools)

    def stream(self, prompt: Prompt | Messages, sampling_params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[StreamDelta]:
        """Yield text deltas as they are produced; chat messages (or chat=True) use the chat template."""
        rid = self.engine.add_request(prompt, sampling_params, chat=chat)
        try:
            while True:
                for delta in self.engine.step():
                    if delta.request_id == rid:
                        yield delta
                        if delta.finished:
                            return
        finally:
            self.engine.abort(rid)  # a consumer that stops early frees the request's blocks

    def _run(self, prompts: Sequence[Prompt | Messages],
             params: SamplingParams | Sequence[SamplingParams] | None,
             chat: bool, tools: Sequence[Mapping[str, JsonValue]] | None = None) -> list[CompletionOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p, chat=chat, tools=tools))
            return self.engine.run_until_done(ids)
        finally:
            for rid in ids:
                self.engine.abort(rid)  # no-op for finished requests; frees the rest on error
