"""The prompt cache's disk tier in the engine: a new engine on the same directory (as after a restart)
reads a prompt seen before from disk and answers exactly as the cold run did; another precision or
model never reads those blocks; what the disk tier refuses. The files and the core: test_disk_tier.py."""

from __future__ import annotations

import pytest

from phasewise.core.sampling_params import SamplingParams
from phasewise.report import timings
from phasewise.server.timings import timings as api_timings

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _restart_reads_from_disk(kw: dict, prompt: list[int]) -> None:
    """Cold in one engine, then from disk in a fresh one on the same directory: every whole block before the
    last token read from disk, the same greedy tokens; then from RAM in that engine."""
    from phasewise import LLM

    with LLM(**kw) as cold_llm:
        cold = cold_llm.generate(prompt, GREEDY)[0]
        assert cold.cached_tokens == 0
    with LLM(**kw) as llm:
        warm, bs = llm.generate(prompt, GREEDY)[0], llm.engine.kv_cache.block_size
        assert warm.metrics.disk_tokens == (len(prompt) - 1) // bs * bs == warm.cached_tokens
        assert warm.token_ids == cold.token_ids
        t = timings(warm)
        assert t["disk_n"] == warm.metrics.disk_tokens and t["disk_load_ms"] > 0
        body = api_timings(warm)                                # what every API's response says
        assert body["disk_n"] == t["disk_n"] and "disk_n" not in api_timings(cold)
        again = llm.generate(prompt, GREEDY)[0]                 # now in RAM: nothing read from disk
        assert again.metrics.disk_tokens == 0 and again.cached_tokens >= warm.cached_tokens
        assert again.token_ids == cold.token_ids
        stats = llm.engine.stats().disk
        assert stats is not None and stats.blocks_read == warm.metrics.disk_tokens // bs and stats.corrupt == 0


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "model"])
def test_after_a_restart_the_default_model_reads_a_prompt_from_disk(tmp_path, kv_dtype):
    from phasewise.tokenization.tokenizer import Tokenizer
    from phasewise.loading.loader import default_model_path

    text = " ".join(f"Step {i}: check the chain, oil it, and pump the tyres to the pressure on their side."
                    for i in range(24))
    prompt = Tokenizer.load(default_model_path()).encode(text)
    assert len(prompt) >= 400
    kw = dict(kv_cache_memory=0.3, warmup=False, prompt_cache_dir=str(tmp_path), kv_dtype=kv_dtype,
              dtype="fp32" if kv_dtype == "model" else "auto")
    _restart_reads_from_disk(kw, prompt)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from model_builders import build_hf, hf_config, with_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    build_hf(hf_config("llama", max_position_embeddings=1024), seed=5).save_pretrained(folder)
    return str(with_tokenizer(folder))


@pytest.mark.parametrize("kv_dtype", ["int8", "model"])
def test_after_a_restart_a_tiny_random_model_reads_a_prompt_from_disk(tmp_path, tiny_model, kv_dtype):
    from model_builders import prompt_ids

    kw = dict(model=tiny_model, dtype="fp32", kv_dtype=kv_dtype, kv_cache_memory=0.02, warmup=False,
              prompt_cache_dir=str(tmp_path))
    _restart_reads_from_disk(kw, prompt_ids(256, 333, seed=9))


def test_another_precision_or_salt_never_reads_those_blocks(tmp_path, tiny_model):
    from model_builders import prompt_ids
    from phasewise import LLM

    prompt = prompt_ids(256, 100, seed=4)
    kw = dict(model=tiny_model, dtype="fp32", kv_cache_memory=0.02, warmup=False, prompt_cache_dir=str(tmp_path))
    salted = SamplingParams(temperature=0, max_tokens=4, cache_salt="tenant-a")
    with LLM(kv_dtype="int8", **kw) as llm:
        llm.generate(prompt, GREEDY)
        llm.generate(prompt, salted)
        assert llm.generate(prompt, SamplingParams(max_tokens=1, cache_salt="tenant-b"))[0].cached_tokens == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1            # one fingerprint's directory
    with LLM(kv_dtype="model", **kw) as other:                               # fp32 KV: its own directory
        assert other.generate(prompt, GREEDY)[0].metrics.disk_tokens == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
    with LLM(kv_dtype="int8", **kw) as again:
        for salt, expect in ((None, 96), ("tenant-a", 96), ("tenant-c", 0)):
            out = again.generate(prompt, SamplingParams(max_tokens=1, cache_salt=salt))[0]
            assert out.metrics.disk_tokens == expect, salt


def test_what_the_disk_tier_refuses_is_said_at_start(tmp_path, tiny_model):
    from phasewise import LLM

    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="not writable"):
        LLM(tiny_model, warmup=False, prompt_cache_dir=str(tmp_path / "a-file" / "cache"), kv_cache_memory=0.02)
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(tiny_model, warmup=False, prompt_cache_dir=str(tmp_path), enable_prefix_caching=False,
            kv_cache_memory=0.02)


def test_the_flags_reach_the_engine_config(tmp_path):
    from phasewise.cli import build_parser
    from phasewise.deploy.options import app_options
    from phasewise.engine.args import engine_config_from_args

    args = build_parser().parse_args(["serve", "--prompt-cache-dir", str(tmp_path), "--prompt-cache-size", "2.5",
                                      "--prompt-cache-ttl", "300"])
    cache = engine_config_from_args(args, kv_role=None, kv_peer=None, threads=None).cache
    assert (cache.prompt_cache_dir, cache.prompt_cache_size_gib, cache.prompt_cache_ttl) == (str(tmp_path), 2.5, 300)
    replica_cache = app_options({"prompt_cache_dir": str(tmp_path), "prompt_cache_size": 1}).engine.cache  # Ray's
    assert (replica_cache.prompt_cache_dir, replica_cache.prompt_cache_size_gib) == (str(tmp_path), 1.0)
    with pytest.raises(ValueError, match="prompt_cache_size"):
        type(cache)(prompt_cache_size_gib=0)


def test_windows_and_tensor_parallelism_are_refused_for_now(tmp_path):
    from types import SimpleNamespace

    from phasewise.config import CacheConfig, EngineConfig
    from phasewise.engine.prompt_cache import check_supported

    config = EngineConfig(cache=CacheConfig(prompt_cache_dir=str(tmp_path)))
    plain = SimpleNamespace(architecture="LlamaForCausalLM", recurrent_layers=[], kv_group_windows=(None,))
    check_supported(config, plain)
    with pytest.raises(ValueError, match="sliding-window"):
        check_supported(config, _like(plain, kv_group_windows=(None, 512)))
    with pytest.raises(ValueError, match="tensor parallelism"):
        check_supported(EngineConfig(cache=config.cache, tensor_parallel_size=2), plain)
    check_supported(EngineConfig(), _like(plain, kv_group_windows=(None, 512)))    # no disk tier: fine


def _like(model, **over):
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(model), **over})


def test_a_restart_past_the_ttl_reads_nothing_but_a_longer_request_ttl_holds(tmp_path, tiny_model):
    from model_builders import prompt_ids
    from phasewise import LLM

    class Clock:
        t = 2_000_000.0

        def now(self) -> float:
            return self.t

    clock = Clock()
    short, long = prompt_ids(256, 80, seed=1), prompt_ids(256, 80, seed=2)
    kw = dict(model=tiny_model, dtype="fp32", kv_cache_memory=0.02, warmup=False, prompt_cache_dir=str(tmp_path),
              prompt_cache_ttl=300, clock=clock)
    one = SamplingParams(max_tokens=1)
    with LLM(**kw) as llm:
        llm.generate([short, long], [one, SamplingParams(max_tokens=1, cache_ttl=3600)])
    clock.t += 299
    with LLM(**kw) as llm:
        assert [o.metrics.disk_tokens for o in llm.generate([short, long], one)] == [64, 64]   # read: refreshed
    clock.t += 299                                      # 1 s before the refreshed expiry
    with LLM(**kw) as llm:
        assert [o.metrics.disk_tokens for o in llm.generate([short, long], one)] == [64, 64]
        llm.engine.core.disk.sweep()
        assert llm.engine.stats().disk.evicted_ttl == 0
    clock.t += 300                                      # refreshed again at the last read: expired now
    with LLM(**kw) as llm:
        assert [o.metrics.disk_tokens for o in llm.generate([short, long], one)] == [0, 64]
        llm.engine.core.disk.sweep()
        assert llm.engine.stats().disk.evicted_ttl >= 4


def test_a_full_disk_costs_only_the_cache(tmp_path, tiny_model, monkeypatch):
    import errno
    import os

    from model_builders import prompt_ids
    from phasewise import LLM

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")
    prompt = prompt_ids(256, 70, seed=6)
    with LLM(model=tiny_model, dtype="fp32", kv_cache_memory=0.02, warmup=False) as plain:
        ref = plain.generate(prompt, GREEDY)[0].token_ids
    kw = dict(model=tiny_model, dtype="fp32", kv_cache_memory=0.02, warmup=False, prompt_cache_dir=str(tmp_path))
    with LLM(**kw) as llm:
        monkeypatch.setattr(os, "replace", full)   # where a full disk fails the write
        assert llm.generate(prompt, GREEDY)[0].token_ids == ref
        llm.engine.core.disk.flush()
        stats = llm.engine.stats().disk
        assert stats.write_errors == 4 and stats.blocks_written == 0
    monkeypatch.undo()
    with LLM(**kw) as llm:                              # nothing was written: computed again, the same
        out = llm.generate(prompt, GREEDY)[0]
        assert out.metrics.disk_tokens == 0 and out.token_ids == ref


KILLED_WRITER = """
import sys
import time
from pathlib import Path
from phasewise import LLM
from phasewise.core.sampling_params import SamplingParams
llm = LLM(model=sys.argv[1], dtype="fp32", kv_cache_memory=0.02, warmup=False, prompt_cache_dir=sys.argv[2])
for seed in range(6):
    prompt = [(seed * 37 + i * 11) % 256 for i in range(300)]
    llm.generate(prompt, SamplingParams(max_tokens=1))
while not any(p.suffix == ".kvb" for p in Path(sys.argv[2]).rglob("*")):   # one block written at least
    time.sleep(0.01)
print("ran", flush=True)
sys.stdin.read()                                     # killed here, the writer still busy or done
"""


def test_kill_9_while_writing_loses_only_the_cache(tmp_path, tiny_model):
    """A process killed (SIGKILL) while its writer works leaves whole entries or none: a fresh engine on
    the directory reads what is there and answers as a cold engine does."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from phasewise import LLM

    import phasewise

    env = {**os.environ, "PYTHONPATH": str(Path(phasewise.__file__).parents[1]), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, tiny_model, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ran"
    proc.kill()
    proc.wait()
    prompts = [[(seed * 37 + i * 11) % 256 for i in range(300)] for seed in range(6)]
    with LLM(model=tiny_model, dtype="fp32", kv_cache_memory=0.02, warmup=False) as plain:
        ref = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    with LLM(model=tiny_model, dtype="fp32", kv_cache_memory=0.02, warmup=False, prompt_cache_dir=str(tmp_path)) as llm:
        outs = [llm.generate(p, GREEDY)[0] for p in prompts]
        assert [o.token_ids for o in outs] == ref
        assert llm.engine.stats().disk.corrupt == 0 and sum(o.metrics.disk_tokens for o in outs) > 0


@pytest.mark.parametrize("case", ["qwen3_5", "lfm2"])
def test_after_a_restart_a_hybrid_resumes_from_its_state_on_disk(tmp_path, case):
    """A hybrid's state checkpoints go to disk with its KV blocks: a fresh engine reads both and answers as
    the cold run did (a Gated DeltaNet's state, LFM2's short convolutions)."""
    import transformers
    from model_builders import build_hf, prompt_ids, with_tokenizer

    base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, bos_token_id=None, eos_token_id=None)
    config = transformers.Qwen3_5TextConfig(**base, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                            linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=128) \
        if case == "qwen3_5" else transformers.Lfm2Config(**base, intermediate_size=168, block_multiple_of=16,
                                                          pad_token_id=None,
                                                          layer_types=["conv", "conv", "conv", "full_attention"])
    folder = tmp_path / case
    build_hf(config, seed=3).save_pretrained(folder)
    kw = dict(model=str(with_tokenizer(folder)), dtype="fp32", kv_dtype="model", kv_cache_memory=0.02,
              warmup=False, prompt_cache_dir=str(tmp_path / "cache"))
    _restart_reads_from_disk(kw, prompt_ids(256, 337, seed=8))


def test_the_metrics_counters_read_the_disk_counters():
    from phasewise.core.handoffs import EngineStats
    from phasewise.core.store_writer import DiskStats
    from phasewise.server.metrics import ENGINE_COUNTERS
    from phasewise.server.server_stats import ServerStats

    rows = {(name, value): read for name, _, _, reads in ENGINE_COUNTERS for value, read in reads}
    disk = DiskStats(blocks_read=3, bytes_read=300, load_seconds=0.5, blocks_written=7, bytes_written=700,
                     evicted_ttl=2, evicted_lru=5, write_errors=1, corrupt=4, dropped=6)
    stats = ServerStats(engine=EngineStats(disk=disk))
    assert [rows[f"phasewise:prompt_cache_disk_{k}", v](stats) for k, v in
            (("hit_blocks", ""), ("read_bytes", ""), ("load_seconds", ""), ("written_blocks", ""),
             ("written_bytes", ""), ("evictions", "ttl"), ("evictions", "size"), ("errors", "write"),
             ("errors", "corrupt"), ("errors", "dropped"))] == [3, 300, 0.5, 7, 700, 2, 5, 1, 4, 6]
    assert all(read(ServerStats()) == 0 for (name, _), read in rows.items() if "prompt_cache" in name)


def test_the_next_turn_after_a_restart_reads_the_last_turn_and_its_reply(tmp_path, tiny_model):
    """An agent's next turn resends the last prompt and reply: after a restart, every whole block of them
    that had KV (all but the reply's last token) comes from disk, and the answer is the cold one."""
    from model_builders import prompt_ids
    from phasewise import LLM

    kw = dict(model=tiny_model, dtype="fp32", kv_cache_memory=0.02, warmup=False)
    first = prompt_ids(256, 203, seed=11)
    with LLM(**kw, prompt_cache_dir=str(tmp_path)) as llm:
        reply = llm.generate(first, GREEDY)[0].token_ids
    second = first + reply + prompt_ids(256, 31, seed=12)
    with LLM(**kw) as cold:
        want = cold.generate(second, GREEDY)[0].token_ids
    with LLM(**kw, prompt_cache_dir=str(tmp_path)) as llm:
        out = llm.generate(second, GREEDY)[0]
    assert out.metrics.disk_tokens == (len(first) + len(reply) - 1) // 16 * 16 and out.token_ids == want
