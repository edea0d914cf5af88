"""The request fields this server refuses by name (a 400), never silently ignoring them."""

from __future__ import annotations

# Request fields of OpenAI's, vLLM's and llama.cpp's servers that would change the output and that
# this server does not implement: a 400 naming the field, never silently ignored. Fields that change
# nothing in the output (user, metadata, store, service_tier, cache_prompt ...) pass.
UNSUPPORTED_FIELDS = frozenset({
    # constrained output (vLLM): free whitespace inside JSON, structural tags
    "guided_whitespace_pattern", "structural_tag",
    # formats (OpenAI): the legacy functions, predicted outputs, audio, ...
    "functions", "function_call", "prediction", "audio", "modalities",
    "web_search_options", "verbosity",
    # sampling and penalties (vLLM, llama.cpp)
    "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "logits_processors", "typical_p",
    "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent",
    "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "repeat_last_n", "penalty_last_n", "repeat_penalty",
    "top_n_sigma", "samplers", "n_predict", "n_probs", "truncate_prompt_tokens", "include_stop_str_in_output",
    "adaptive_target", "adaptive_decay", "min_keep", "backend_sampling", "t_max_predict_ms",
    "lora", "vllm_xargs",
    # the prompt: templates and their arguments, tokenization, context shifting (vLLM, llama.cpp; chat
    # requests take add_generation_prompt and continue_final_message, declared there)
    "add_generation_prompt", "continue_final_message", "chat_template", "documents",
    "add_special_tokens", "prompt_embeds", "chat_format", "chat_parser", "parse_tool_calls", "grammar_lazy",
    "grammar_triggers", "preserved_tokens", "thinking_forced_open", "n_keep", "n_discard", "n_indent",
    # reasoning budgets and formats (llama.cpp)
    "reasoning_format", "reasoning_budget_message", "reasoning_budget_start_tag", "reasoning_budget_end_tag",
    "reasoning_budget_arm_immediately",
    # more in the response, or in another shape (vLLM, llama.cpp)
    "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids", "spaces_between_special_tokens",
    "return_tokens", "return_progress", "response_fields", "post_sampling_probs",
    "timings_per_token", "n_cmpl",
    # a chat request's fields sent to /v1/completions, and chat's own echo (only completions echo here)
    "echo", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
    "chat_template_kwargs", "reasoning_effort", "thinking_token_budget", "thinking_budget_tokens",
    "reasoning_budget_tokens",
})
