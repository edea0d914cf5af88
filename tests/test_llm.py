"""The offline API on the default model: sampling end to end, streaming, stop strings, batching, abort."""

from __future__ import annotations

import pytest
import torch

from phasewise import SamplingParams

pytestmark = pytest.mark.slow

STORY = "Write a short story about a robot discovering a flower."


def free_blocks(llm) -> int:
    return llm.engine.core.kv.pool.num_free


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    a, b = llm.generate([STORY, STORY], [p, p])
    c = llm.generate(STORY, SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert c.token_ids != a.token_ids


def test_chat_applies_template_and_finishes_on_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=64))
    assert out.prompt_token_ids[:1] == llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text and out.text.strip()


def test_stream_deltas_add_up_to_generate(llm):
    p = SamplingParams(temperature=0, max_tokens=40)
    ref = llm.generate(STORY, p)[0]
    deltas = list(llm.stream(STORY, p))
    assert "".join(d.text for d in deltas) == ref.text
    assert sum((d.token_ids for d in deltas), []) == ref.token_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert deltas[-1].output.finish_reason == ref.finish_reason


def test_stop_string_is_excluded_and_ends_the_request(llm):
    p = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    full = llm.generate(STORY, p)[0].text
    stop = full[len(full) // 2: len(full) // 2 + 4]
    before = full[: full.index(stop)]
    out = llm.generate(STORY, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop]))[0]
    assert out.text == before
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 60
    assert free_blocks(llm) == llm.engine.core.kv.pool.num_blocks


def test_logprobs_of_chosen_and_top_n(llm):
    out = llm.generate(STORY, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok and lp.logprob == pytest.approx(lp.top[0][1])   # greedy picks the top
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob <= 0


def test_many_prompts_together_equal_each_alone(llm):
    prompts = [STORY, "The capital of France is", "List three fruits:", "def add(a, b):"]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    together = llm.generate(prompts, p)
    for prompt, t in zip(prompts, together):
        alone = llm.generate(prompt, p)[0]
        for i, (x, y) in enumerate(zip(t.token_ids, alone.token_ids)):
            if x != y:   # a floating-point batch effect may flip a near tie; then both must be top-5
                assert x in dict(alone.logprobs[i].top) and y in dict(t.logprobs[i].top)
                break


def test_abandoned_stream_frees_its_blocks(llm):
    total = llm.engine.core.kv.pool.num_blocks
    stream = llm.stream(STORY, SamplingParams(max_tokens=100, ignore_eos=True))
    for _, _ in zip(range(5), stream):
        pass
    assert free_blocks(llm) < total
    stream.close()
    assert free_blocks(llm) == total and not llm.engine.has_unfinished()


def test_metrics_account_for_the_request(llm):
    out = llm.generate(STORY, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    m = out.metrics
    assert m.arrival <= m.first_scheduled <= m.first_token <= m.token_times[-1] <= m.finished
    assert len(m.token_times) == 16 and len(m.itl_ms) == 15
    assert sum(n for _, _, n in m.prefill_chunks) == len(out.prompt_token_ids) - out.cached_tokens
    assert m.ttft_ms == pytest.approx(m.queue_ms + m.prompt_ms)


def test_llm_on_a_hugging_face_folder(llm, tmp_path):
    """LLM(model=folder): config.json + safetensors + tokenizer files, end to end (tiny random weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from phasewise import LLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=llm.model_config.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    llm.tokenizer.hf.save_pretrained(tmp_path)
    tiny = LLM(str(tmp_path), kv_cache_memory=0.01, warmup=False)
    out = tiny.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert tiny.model_config.max_position_embeddings == 256 and tiny.model_config.num_layers == 2


def test_default_precision_is_the_fast_path(default_model_path):
    """LLM() on a machine with compiled kernels: the file's own 4-bit blocks and the int8 KV cache,
    every linear layer on the kernels and the decoder stack in use; the text is still right."""
    from phasewise import LLM
    from phasewise.layers.linear import Linear

    llm = LLM(kv_cache_memory=0.05, warmup=False)
    p = llm.engine.precision
    assert (p.weights, p.kv, p.chosen) == ("q4", "int8", True), p
    assert llm.engine.kv_cache.dtype == torch.int8
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert {m.form for m in layers} == {"blocks"}
    assert layers and all(m.kernels is llm.engine.kernels for m in layers)
    assert llm.engine.model.model.stack is not None
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.text


def test_precision_choices(default_model_path, tmp_path):
    from phasewise.engine.precision import choose

    class Kernels:
        isa = "avx2"

    assert choose(default_model_path, "auto", "auto", Kernels(), "llama").weights == "q4"
    folder = choose(tmp_path, "auto", "auto", Kernels(), "llama")       # a safetensors folder: int8 per channel
    assert (folder.weights, folder.kv) == ("int8", "int8")
    none = choose(default_model_path, "auto", "auto", None, "llama")   # no kernels: the float weights as they are
    assert (none.weights, none.kv, none.chosen) == ("fp32", "model", True)
    asked = choose(default_model_path, "q4", "auto", Kernels(), "llama")
    assert (asked.weights, asked.kv, asked.chosen) == ("q4", "model", False)
    assert choose(default_model_path, "fp32", "int8", None, "llama").kv == "int8"
    with pytest.raises(ValueError, match="dtype"):
        choose(default_model_path, "q3", "auto", None, "llama")
    with pytest.raises(ValueError, match="kv_dtype"):
        choose(default_model_path, "auto", "fp8", None, "llama")


def test_the_default_kv_cache_holds_the_measured_perplexity_of_each_file(default_model_path, tmp_path, monkeypatch):
    """The int8 KV cache beside a GGUF's blocks only where that pair was measured within 0.5% on the file
    (the shipped figures, or benchmarks/quality.py --record's in the cache); the line says what was measured."""
    from phasewise.engine.precision import choose, record_path

    class Kernels:
        isa = "avx512"

    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path))
    shipped = choose(default_model_path, "auto", "auto", Kernels(), "llama")     # the default model's shipped figures
    assert shipped.kv == "int8" and "+0.11% perplexity against fp32 as measured on this file" in shipped.why
    assert "the int8 KV cache measured SmolLM2-135M +0.03% on a held-out text" in shipped.why
    record = record_path(default_model_path)
    record.parent.mkdir(parents=True)
    record.write_text('{"q4/int8": 0.0186, "q4": 0.0036, "int8_kv": 2}')   # an int8 cache over the limit
    float_kv = choose(default_model_path, "auto", "auto", Kernels(), "llama")
    assert float_kv.kv == "model" and "+0.36%" in float_kv.why and "int8 KV cache measured +1.86%" in float_kv.why
    assert choose(default_model_path, "auto", "int8", Kernels(), "llama").kv == "int8"   # asked for: kept, and over the limit
    assert "over 0.5%" in choose(default_model_path, "auto", "int8", Kernels(), "llama").why
    record.write_text('{"q4/int8": 0.0186, "q4": 0.0036}')            # the per-token int8 cache's: not this one's
    old = choose(default_model_path, "auto", "auto", Kernels(), "llama")
    assert old.kv == "int8" and "not measured for this file" in old.why
    record.write_text("{}")                                             # nobody measured this file
    unknown = choose(default_model_path, "auto", "auto", Kernels(), "llama")
    assert unknown.kv == "int8" and "not measured for this file" in unknown.why


def test_the_default_kv_cache_is_float_where_the_family_does_not_hold_int8(default_model_path, tmp_path, monkeypatch):
    """A family whose int8 KV cache was not measured within 0.5% on a held-out text gets a float cache by
    default, whatever the file's own figures say; asking for int8 still gives it. Qwen2 holds it now."""
    from phasewise.engine.precision import choose, record_path

    class Kernels:
        isa = "avx512"

    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path))
    record = record_path(default_model_path)
    record.parent.mkdir(parents=True)
    for figures in ("{}", '{"q4/int8": 0.0026, "int8_kv": 2}'):      # unmeasured, or measured within on its own text
        record.write_text(figures)
        gemma = choose(default_model_path, "auto", "auto", Kernels(), "gemma3")
        assert gemma.kv == "model" and "not measured to hold 0.5% on gemma3 models" in gemma.describe()
        qwen = choose(default_model_path, "auto", "auto", Kernels(), "qwen2")
        assert qwen.kv == "int8" and "Qwen2.5-Coder-0.5B -0.04%" in qwen.describe()
    assert choose(default_model_path, "auto", "int8", Kernels(), "gemma3").kv == "int8"
    assert choose(tmp_path, "auto", "auto", Kernels(), "qwen3").kv == "model"      # a folder: int8 weights, float KV
    assert choose(tmp_path, "auto", "auto", Kernels(), "llama").kv == "int8"


def test_the_int4_kv_cache_only_where_measured_to_hold(default_model_path, tmp_path, monkeypatch):
    """auto never picks an unmeasured int4 cache; a file whose q4/int4 pair was measured within 0.5% with the
    current int4 layout gets it, and the line says what it measured; asking for int4 gives it whatever was
    measured, and the line says it was asked for and what the family measured."""
    from phasewise.engine.precision import INT4_KV_MEASURED, choose, record_path

    class Kernels:
        isa = "avx512"

    monkeypatch.setenv("PHASEWISE_CACHE", str(tmp_path))
    for family in ("llama", "qwen2", "gemma3"):
        assert choose(default_model_path, "auto", "auto", Kernels(), family).kv != "int4"
    record = record_path(default_model_path)
    record.parent.mkdir(parents=True)
    record.write_text('{"q4/int8": 0.0011, "q4/int4": 0.0121, "int8_kv": 2, "int4_kv": 1}')   # over the limit: int8
    assert choose(default_model_path, "auto", "auto", Kernels(), "llama").kv == "int8"
    asked = choose(default_model_path, "auto", "int4", Kernels(), "llama")
    assert asked.kv == "int4" and "+1.21%" in asked.why and "int4 KV cache" in asked.describe()
    assert f"as --kv-dtype int4 asks (measured {INT4_KV_MEASURED['llama']})" in asked.why
    record.write_text('{"q4/int8": 0.0011, "q4/int4": 0.0042, "int8_kv": 2, "int4_kv": 1}')   # within: int4
    held = choose(default_model_path, "auto", "auto", Kernels(), "llama")
    assert held.kv == "int4" and "+0.42% perplexity against fp32" in held.describe()
    record.write_text('{"q4/int8": 0.0011, "q4/int4": 0.0042, "int8_kv": 2}')   # another int4 layout's figure
    assert choose(default_model_path, "auto", "auto", Kernels(), "llama").kv == "int8"
    for weights, kernels in (("fp32", None), ("auto", None), ("q4", Kernels())):
        chosen = choose(default_model_path, weights, "int4", kernels, "gemma3")
        assert chosen.kv == "int4" and "the int4 KV cache as --kv-dtype int4 asks (not measured on gemma3" in chosen.why
    line = choose(default_model_path, "fp32", "auto", None, "llama").describe()
    assert "float KV cache" in line and "the weights' float type" in line


def _full_forward_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position, the whole prompt in one forward pass."""
    from phasewise.layers.attention import AttentionMetadata
    from phasewise.runner.kv_cache import KVCache

    model = llm.engine.model
    blocks = -(-len(ids) // 16)
    cache = KVCache(model.config, blocks, 16, llm.engine.kv_cache.data.dtype, "cpu")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], 16, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta, cache.layers)
        return torch.log_softmax(model.compute_logits(hidden), dim=-1)


def test_prompt_logprobs_score_every_prompt_token_in_chunks_and_past_the_prefix_cache(llm, monkeypatch):
    """max_tokens 0 + prompt_logprobs: the prompt is scored (as one forward pass over it scores it),
    nothing is generated; in 16-token chunks, and again once its prefix is cached (a cached prefix
    has no logits, so such requests skip the cache). Every block is free afterwards."""
    import dataclasses

    scheduler = llm.engine.core.scheduler
    monkeypatch.setattr(scheduler, "config", dataclasses.replace(scheduler.config, max_num_batched_tokens=16))
    ids = llm.tokenizer.encode(" ".join([STORY] * 5))
    ref = _full_forward_logprobs(llm, ids)
    free = free_blocks(llm)
    params = SamplingParams(max_tokens=0, prompt_logprobs=3)
    first, again = llm.generate([ids], params)[0], llm.generate([ids], params)[0]
    for out in (first, again):
        assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) > 48 and lps[0] is None
        got = torch.tensor([lp.logprob for lp in lps[1:]])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
        for p in (1, 20, len(ids) - 1):
            top_ids = [i for i, _ in lps[p].top]
            assert len(top_ids) == 3 and top_ids[0] == ref[p - 1].argmax().item()
    generated = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0))[0]
    assert len(generated.token_ids) == 4 and len(generated.prompt_logprobs) == len(ids)
    assert generated.prompt_logprobs[5].top == []
    assert free_blocks(llm) == free
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
