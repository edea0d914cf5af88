"""No output-changing field is silently ignored: every request field of vLLM's and llama.cpp's completion
and chat requests (the lists below, read from vllm/entrypoints/openai/protocol.py at ec3b890 and
llama.cpp's tools/server at 00efb3e) is honoured, accepted because it changes nothing in the output,
or refused with a 400 naming it."""

from __future__ import annotations

import pytest

from live_server import CHAT, MODEL

pytestmark = pytest.mark.slow

VLLM_CHAT = [
    "add_generation_prompt", "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "chat_template",
    "chat_template_kwargs", "continue_final_message", "documents", "echo", "frequency_penalty", "ignore_eos",
    "include_reasoning", "include_stop_str_in_output", "kv_transfer_params", "length_penalty", "logit_bias",
    "logits_processors", "logprobs", "max_completion_tokens", "max_tokens", "messages", "min_p", "min_tokens",
    "mm_processor_kwargs", "model", "n", "parallel_tool_calls", "presence_penalty", "priority", "prompt_logprobs",
    "reasoning_effort", "repetition_penalty", "request_id", "response_format", "return_token_ids",
    "return_tokens_as_token_ids", "seed", "skip_special_tokens", "spaces_between_special_tokens", "stop",
    "stop_token_ids", "stream", "stream_options", "structured_outputs", "temperature", "tool_choice", "tools",
    "top_k", "top_logprobs", "top_p", "truncate_prompt_tokens", "use_beam_search", "user", "vllm_xargs",
    "thinking_token_budget",
    # older vLLM releases
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structural_tag"]
VLLM_COMPLETION = [
    "add_special_tokens", "allowed_token_ids", "cache_salt", "echo", "frequency_penalty", "ignore_eos",
    "include_stop_str_in_output", "kv_transfer_params", "length_penalty", "logit_bias", "logits_processors",
    "logprobs", "max_tokens", "min_p", "min_tokens", "model", "n", "presence_penalty", "priority", "prompt",
    "prompt_embeds", "prompt_logprobs", "repetition_penalty", "request_id", "response_format", "return_token_ids",
    "return_tokens_as_token_ids", "seed", "skip_special_tokens", "spaces_between_special_tokens", "stop",
    "stop_token_ids", "stream", "stream_options", "structured_outputs", "suffix", "temperature", "top_k", "top_p",
    "truncate_prompt_tokens", "use_beam_search", "user", "vllm_xargs", "best_of"]
LLAMA_CPP = [
    "adaptive_decay", "adaptive_target", "add_generation_prompt", "backend_sampling", "cache_prompt", "chat_format",
    "chat_parser", "chat_template_kwargs", "dry_allowed_length", "dry_base", "dry_multiplier", "dry_penalty_last_n",
    "dry_sequence_breakers", "dynatemp_exponent", "dynatemp_range", "echo", "frequency_penalty", "grammar",
    "grammar_lazy", "grammar_triggers", "id_slot", "ignore_eos", "json_schema", "logit_bias", "logprobs", "lora",
    "max_completion_tokens", "max_tokens", "messages", "min_keep", "min_p", "mirostat", "mirostat_eta",
    "mirostat_tau", "model", "n", "n_cache_reuse", "n_cmpl", "n_discard", "n_indent", "n_keep", "n_predict",
    "n_probs", "parallel_tool_calls", "parse_tool_calls", "post_sampling_probs", "presence_penalty",
    "preserved_tokens", "prompt", "reasoning_budget_arm_immediately", "reasoning_budget_end_tag",
    "reasoning_budget_message", "reasoning_budget_start_tag", "reasoning_budget_tokens", "reasoning_format",
    "repeat_last_n", "repeat_penalty", "response_fields", "response_format", "return_progress", "return_tokens",
    "samplers", "seed", "speculative.n_max", "speculative.n_min", "speculative.ngram_m_hits",
    "speculative.ngram_size_m", "speculative.ngram_size_n", "speculative.p_min", "speculative.type", "stop",
    "stream", "stream_options", "t_max_predict_ms", "temperature", "thinking_budget_tokens", "thinking_forced_open",
    "timings_per_token", "tool_choice", "tools", "top_k", "top_logprobs", "top_n_sigma", "top_p", "typical_p",
    "xtc_probability", "xtc_threshold"]

# honoured, with a value this server acts on (each effect is tested elsewhere)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
COMMON = {
    "model": MODEL, "n": 2, "stream": False, "stream_options": {"include_usage": True}, "temperature": 0.5,
    "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 3, "stop": ["\n\n"], "stop_token_ids": [2],
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "ignore_eos": True,
    "min_tokens": 1, "skip_special_tokens": True, "max_tokens": 4, "user": "u",
    "response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a", "b"]},
    "guided_json": {"type": "object"}, "guided_regex": "[a-z]+", "guided_choice": ["a", "b"],
    "guided_grammar": 'root ::= "yes"', "json_schema": {"type": "object"}, "grammar": 'root ::= "yes"',
    "cache_salt": "s"}
HONOURED = {
    "chat": {**COMMON, "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 4, "tools": TOOLS,
             "tool_choice": "auto", "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False},
             "reasoning_effort": "low", "include_reasoning": False, "add_generation_prompt": True,
             "continue_final_message": False, "thinking_token_budget": 8, "thinking_budget_tokens": 8,
             "reasoning_budget_tokens": -1},
    "completion": {**COMMON, "logprobs": 2, "echo": True, "best_of": 1},
}
# accepted, changing nothing in the output: caching, scheduling, request ids, speculation (which keeps the
# output), settings for inputs this server does not take (images)
INERT = {"priority": 1, "request_id": "r1", "cache_prompt": True, "id_slot": 0,
         "n_cache_reuse": 0, "mm_processor_kwargs": {}, "guided_decoding_backend": "guidance",
         "speculative.n_max": 8, "speculative.n_min": 0, "speculative.ngram_m_hits": 1, "speculative.ngram_size_m": 2,
         "speculative.ngram_size_n": 3, "speculative.p_min": 0.5, "speculative.type": "ngram"}
SKIP = {"messages", "prompt", "kv_transfer_params"}    # the body itself; the disaggregation pair's own field
CASES = sorted({("chat", f) for f in VLLM_CHAT + LLAMA_CPP} | {("completion", f) for f in VLLM_COMPLETION + LLAMA_CPP})


@pytest.mark.parametrize("kind, name", [c for c in CASES if c[1] not in SKIP], ids=lambda v: v)
def test_every_field_is_honoured_accepted_or_refused_by_name(server, kind, name):
    body = dict(CHAT) if kind == "chat" else {"model": MODEL, "prompt": "Once upon a time"}
    body["max_tokens"] = 4
    if kind == "chat" and name in ("tool_choice", "parallel_tool_calls", "top_logprobs"):
        body |= {"tools": TOOLS, "logprobs": True}             # what they need beside them
    honoured = name in HONOURED[kind]
    body[name] = HONOURED[kind].get(name, INERT.get(name, 1))
    resp = server.post("/v1/chat/completions" if kind == "chat" else "/v1/completions", body)
    if honoured or name in INERT:
        assert resp.status_code == 200, resp.text
    else:
        assert resp.status_code == 400 and resp.json()["error"]["param"] == name, (name, resp.text)
