"""The lab's calculators on hand-checked numbers."""

from __future__ import annotations

import pytest

from phasewise.lab.cost import Prices, Workload, cost_with_caching, cost_without_caching
from phasewise.lab.memory import GIB, MIB, ModelShape, hybrid_comparison, parameter_count
from phasewise.models.config import ModelConfig


def test_kv_bytes_per_token_of_a_70b_shape():
    shape = ModelShape(layers=80, kv_heads=8, head_dim=128)
    assert shape.kv_bytes_per_token("fp16") == 327_680            # 2 * 80 * 8 * 128 * 2
    assert shape.kv_bytes_per_token("fp16") / MIB == pytest.approx(0.3125)
    assert shape.kv_bytes_per_sequence(4096, "fp16") == 327_680 * 4096
    assert shape.sequences_that_fit(80 * GIB, 4096) == 64           # 1.25 GiB each
    # 80 * 8 * (2 * 128 + V's 4-byte scale + K's midpoint and step, 8 bytes a channel per 16 tokens)
    assert shape.kv_bytes_per_token("int8") == 207_360
    # int4: 4-bit K and V, V's fp16 scale per 32 values and K's fp16 minimum and step per channel per 64 tokens
    assert shape.kv_bytes_per_token("int4") == 80 * 8 * (128 + 128 / 8) == 92_160   # 4.5 bits a value


def test_parameter_count_matches_the_default_model_and_transformers():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    for cls, cfg_cls, extra in ((LlamaForCausalLM, LlamaConfig, {"tie_word_embeddings": True}),
                                (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": False})):
        hf_cfg = cfg_cls(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, **extra)
        with torch.device("meta"):
            n = sum(p.numel() for p in cls(hf_cfg).parameters())
        assert parameter_count(ModelConfig.from_hf(hf_cfg.to_dict())) == n
    smollm = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                         max_position_embeddings=8192, tie_word_embeddings=True)
    assert parameter_count(smollm) == 134_515_008                    # SmolLM2-135M


def test_parameter_count_of_the_mixtures_of_experts_matches_transformers():
    """Every expert, the routers, a shared expert and its gate, OLMoE's whole-q/k norms; the roofline
    counts the experts a token uses."""
    import torch
    import transformers
    from test_moe import BASE, CASES, TOP2

    from phasewise.lab.roofline import linear_params

    for case, (cls, _, _, kw) in CASES.items():
        hf_cfg = getattr(transformers, cls)(**{**BASE, **TOP2, **kw})
        model_cls = getattr(transformers, cls.replace("Config", "ForCausalLM"))
        with torch.device("meta"):
            n = sum(p.numel() for p in model_cls(hf_cfg).parameters())
        cfg = ModelConfig.from_hf(hf_cfg.to_dict())
        assert parameter_count(cfg) == n, case
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        idle = len(cfg.moe_layers) * (cfg.num_experts - cfg.num_experts_per_tok) * expert
        assert linear_params(cfg, active=False) - linear_params(cfg) == idle


def test_weight_memory_needs_a_parameter_count():
    shape = ModelShape(2, 2, 64, params=1_000_000)
    assert shape.weight_bytes("int4") == 500_000 and shape.weight_bytes("fp32") == 4_000_000
    with pytest.raises(ValueError, match="parameter count"):
        ModelShape(2, 2, 64).weight_bytes("fp32")


def test_cost_with_and_without_prompt_caching():
    prices = Prices(input=3.0, output=15.0, cache_write=3.75, cache_read=0.30)
    w = Workload(requests=1000, input_tokens=2000, output_tokens=300, shared_prefix_tokens=1500)
    plain = cost_without_caching(w, prices)
    assert plain.input == pytest.approx(6.0) and plain.output == pytest.approx(4.5)
    cached = cost_with_caching(w, prices)
    assert cached.input == pytest.approx(1000 * 500 * 3 / 1e6)       # 1.5
    assert cached.cache_write == pytest.approx(1500 * 3.75 / 1e6)
    assert cached.cache_read == pytest.approx(999 * 1500 * 0.30 / 1e6)
    assert cached.total < plain.total
    assert Prices(2.0, 8.0).read == pytest.approx(0.2) and Prices(2.0, 8.0).write == 2.0
    with pytest.raises(ValueError):
        Workload(1, 10, 1, shared_prefix_tokens=11)


def test_a_recorded_run_priced_as_the_seeds_price_caching(tmp_path, capsys):
    """Three APIs' usage in one JSON Lines run: Anthropic's reports its writes (at 5m and 1h), chat's and
    Responses' only reads; priced at $3 in and $15 out per million tokens."""
    import json

    from phasewise.cli import main
    from phasewise.lab.run_cost import RunPricing, read_run

    usages = [{"type": "message", "usage": {"input_tokens": 100, "cache_creation_input_tokens": 3000,
                                            "cache_read_input_tokens": 0, "output_tokens": 50,
                                            "cache_creation": {"ephemeral_5m_input_tokens": 1000,
                                                               "ephemeral_1h_input_tokens": 2000}}},
              {"input_tokens": 40, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3000,
               "output_tokens": 50},
              {"prompt_tokens": 1000, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 960}},
              {"input_tokens": 500, "output_tokens": 20, "input_tokens_details": {"cached_tokens": 0}}]
    run = tmp_path / "usage.jsonl"
    run.write_text("\n".join(json.dumps(u) for u in usages) + "\n")
    t = read_run(run)
    assert (t.requests, t.prompt, t.read, t.write_5m, t.write_1h, t.output, t.unreported) == \
        (4, 3100 + 3040 + 1000 + 500, 3960, 1000, 2000, 130, 2)
    assert t.input == 100 + 40 + 40 + 500
    p = RunPricing(t, 3.0, 15.0)
    assert p.without_cache.total == pytest.approx((7640 * 3 + 130 * 15) / 1e6)
    assert p.with_cache.write_5m == pytest.approx(1000 * 3.75 / 1e6)
    assert p.with_cache.write_1h == pytest.approx(2000 * 6 / 1e6)
    assert p.with_cache.read == pytest.approx(3960 * 0.3 / 1e6)
    assert p.premium == pytest.approx((1000 * 0.75 + 2000 * 3) / 1e6)
    saved = (3960 * 2.7 - 1000 * 0.75 - 2000 * 3) / 1e6
    assert p.saved == pytest.approx(saved) and p.roi == pytest.approx(saved / p.premium)
    marked = read_run(run, "1h")                  # the unreported requests' uncached prompt tokens: 1h writes
    assert marked.write_1h == 2000 + 40 + 500 and marked.input == 140

    assert main(["cost", "--from-run", str(run), "--input-price", "3", "--output-price", "15"]) == 0
    assert "ROI" in capsys.readouterr().out
    doc = json.loads((tmp_path / "cost.json").read_text())
    assert doc["roi"] == pytest.approx(p.roi) and doc["tokens"]["read"] == 3960
    assert doc["with_cache"]["total"] == pytest.approx(p.with_cache.total)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}\n')
    with pytest.raises(ValueError, match="cannot have 11 read"):
        read_run(bad)


def test_a_bench_serve_run_priced_from_its_requests_csv(tmp_path):
    from phasewise.lab.run_cost import RunPricing, read_run

    (tmp_path / "requests.csv").write_text(
        "max_concurrency,ok,prompt_tokens,cached_tokens,output_tokens,ttft_ms,tpot_ms,e2e_ms,error\n"
        "4,True,512,0,64,10,1,80,\n4,True,512,496,64,5,1,70,\n4,False,0,0,0,,,3,HTTP 503\n")
    t = read_run(tmp_path, "5m")
    assert (t.requests, t.prompt, t.read, t.write_5m, t.input) == (2, 1024, 496, 512 + 16, 0)
    assert RunPricing(t, 1.0, 2.0).with_cache.write_5m == pytest.approx(528 * 1.25 / 1e6)


def test_roofline_arithmetic_and_binding_resource():
    from phasewise.lab.roofline import Machine, analyse, linear_params, request_flops, token_costs

    cfg = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=512)
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    assert linear_params(cfg) == 2 * per_layer + 1000 * 64
    costs = token_costs(cfg, 4, context=100)
    assert costs.weight_bytes == 4 * linear_params(cfg)
    assert costs.flops_per_token == 2 * linear_params(cfg) + 4 * 2 * 100 * 64
    machine = Machine(dram_gbs=20.0, cache_gbs=60.0, matmul_gflops=100.0)
    prefill, decode = analyse(cfg, machine, 4, 512, prompt_tokens=200, prefill_s=0.01,
                              decode_tokens=10, decode_s=0.5)
    # the prompt's rows skip the output head, except the last one
    assert prefill.flops == (token_costs(cfg, 4, 100).flops_per_token - 2 * 1000 * 64) * 200 + 2 * 1000 * 64
    assert request_flops(cfg, 200, 11) == prefill.flops + 10 * token_costs(cfg, 4, 205).flops_per_token
    assert decode.bytes_moved == (4 * linear_params(cfg) + 512 * 205) * 10
    assert decode.achieved_gbs == pytest.approx(decode.bytes_moved / 0.5 / 1e9)
    slow_decode = analyse(cfg, Machine(1e-3, 1e-3, 1e9), 4, 512, 200, 0.01, 10, 0.5)[1]
    assert slow_decode.binds == "memory bandwidth"
    assert analyse(cfg, Machine(1e9, 1e9, 1e-3), 4, 512, 200, 0.01, 10, 0.5)[0].binds == "compute"


def test_quantized_phases_are_measured_against_the_int8_peak():
    from phasewise.lab.roofline import Machine, analyse, report
    cfg = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=512)
    machine = Machine(dram_gbs=20.0, cache_gbs=60.0, matmul_gflops=100.0, int8_gops=400.0)
    fp32 = analyse(cfg, machine, 4, 512, 200, 0.01, 10, 0.5)[0]
    q4 = analyse(cfg, machine, 0.6, 512, 200, 0.01, 10, 0.5, quantized=True)[0]
    assert q4.flops == fp32.flops
    assert q4.compute_share == pytest.approx(fp32.compute_share / 4)
    no_vnni = Machine(20.0, 60.0, 100.0)                 # no int8 kernels: the matmul stays the roof
    assert analyse(cfg, no_vnni, 0.6, 512, 200, 0.01, 10, 0.5, quantized=True)[0].compute_share \
        == pytest.approx(fp32.compute_share)
    assert any("int8 dot products 400 GOP/s" in line for line in report(machine, [q4]))


def test_the_windowed_kv_figure_counts_global_layers_whole_and_local_ones_to_their_window():
    from phasewise.lab.memory import ModelShape

    gemma = ModelShape(layers=18, kv_heads=1, head_dim=256, window=512, window_layers=15)
    per_layer_token = 2 * 256 * 2
    assert gemma.windowed_kv_bytes_per_sequence(8192) == per_layer_token * (3 * 8192 + 15 * 512)
    assert gemma.windowed_kv_bytes_per_sequence(320) == gemma.kv_bytes_per_sequence(320)   # inside the window
    assert gemma.windowed_kv_bytes_per_sequence(8192) / gemma.kv_bytes_per_sequence(8192) < 0.25


def test_a_hybrid_counts_its_parameters_as_transformers_and_its_state_beside_its_kv():
    """Qwen3.5 (dense and MoE), Qwen3-Next and LFM2 parameters as transformers counts them, and their
    state per sequence as the runner allocates it and as transformers' cache holds it (which keeps
    one more convolution input than we need); at 32k tokens a Qwen3.5-9B shape (transformers' default
    config: 8 attention layers of 32, a 50 MiB state) holds at most a third of the KV of an
    attention-only model of its size (Qwen3-8B's shape), and its state does not grow."""
    import torch
    import transformers
    from test_hybrid import CASES

    from phasewise.runner.kv_cache import KVCache

    for case, make in CASES.items():
        hf_cfg = make()
        with torch.device("meta"):
            n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
        cfg = ModelConfig.from_hf(hf_cfg.to_dict())
        assert parameter_count(cfg) == n, case
        cache = KVCache(cfg, 4, 4, torch.float32, "cpu", num_state_slots=1)
        allocated = sum(t.numel() * t.element_size() for layer in cache.states for t in layer)
        with torch.no_grad():
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)(torch.tensor([[1, 2, 3]]), use_cache=True)
        layers = [layer for layer in hf.past_key_values.layers if hasattr(layer, "conv_states")]
        conv = [layer.conv_states[0][0] for layer in layers]                                  # [C, K] each
        rec = [layer.recurrent_states[0][0] for layer in layers if layer.recurrent_states[0] is not None]
        held = sum(c.shape[0] * (c.shape[1] - 1) for c in conv) * 4 + sum(r.numel() for r in rec) * 4
        assert ModelShape.from_config(cfg).state_bytes == cache.state_bytes == allocated == held, case
    hybrid = ModelShape.from_config(ModelConfig.from_hf(transformers.Qwen3_5TextConfig().to_dict()))
    dense = ModelShape.from_config(ModelConfig.from_hf(transformers.Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936).to_dict()))
    assert hybrid.layers == 8 and round(hybrid.state_bytes / MIB) == 50
    assert hybrid.kv_bytes_per_sequence(32768, "bf16") <= dense.kv_bytes_per_sequence(32768, "bf16") / 3
    grown = hybrid.kv_bytes_per_sequence(8192, "bf16") - hybrid.kv_bytes_per_sequence(4096, "bf16")
    assert grown == 4096 * hybrid.kv_bytes_per_token("bf16")
    lines = hybrid_comparison(hybrid, 32, "bf16")          # what `phasewise memory` prints for it
    assert [line.split()[0] for line in lines[1:]] == ["4k", "32k", "128k"]
    assert lines[2].endswith("(26%)") and "8 of 32 layers" in lines[0]
