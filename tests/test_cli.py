"""The `phasewise` command as a user runs it: a real process, its output, its exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LONG_PROMPT = "tell me a long story " * 20


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "phasewise.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("phasewise: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize("flags, needle", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--min-p", "2"], "min_p"),
])
def test_invalid_sampling_values_fail_fast(flags, needle):
    assert_one_line_error(run("generate", "hi", *flags), needle)


def test_threads_flag_is_checked_and_applied(monkeypatch):
    from phasewise import cli

    assert_one_line_error(run("generate", "hi", "--threads", "0"), "--threads: must be at least 1")
    assert_one_line_error(run("generate", "hi", "--threads", "many"), "--threads: auto or a count", "generate -h")
    seen = []
    monkeypatch.setattr("torch.set_num_threads", seen.append)
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--threads", "3"])
    args.func = lambda a: 0
    monkeypatch.setattr(cli, "build_parser", lambda: _Fixed(args))
    assert cli.main([]) == 0 and seen == [3]


class _Fixed:
    def __init__(self, args):
        self.args = args

    def parse_args(self, argv):
        return self.args


def test_missing_model_file():
    assert_one_line_error(run("generate", "hi", "--model", "/nonexistent/model.gguf"), "model not found")


def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    assert_one_line_error(run("generate", "hi", "--model", str(bad)), "not a valid GGUF", "broken.gguf")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    assert_one_line_error(run("generate", "hi", "--model", str(tmp_path)), "unsupported architecture", "gpt2")


@pytest.mark.slow
def test_prompt_longer_than_context():
    assert_one_line_error(run("generate", LONG_PROMPT, "--raw", "--max-model-len", "32"),
                          "maximum context length is 32")


@pytest.mark.slow
def test_max_tokens_past_the_context_is_refused_as_the_server_refuses_it():
    assert_one_line_error(run("generate", "hi", "--max-tokens", "9000"), "maximum context length is 8192",
                          "9000 max_tokens")


@pytest.mark.parametrize("device, needle", [("foo", "unknown device 'foo'"), ("cuda", "no CUDA device")])
def test_a_device_this_torch_cannot_use_is_one_line(device, needle):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_one_line_error(run("generate", "hi", "--device", device), needle)


@pytest.mark.slow
def test_json_output_and_trace(tmp_path):
    trace = tmp_path / "gen.trace.json"
    proc = run("generate", "The capital of France is", "--raw", "--json", "--temperature", "0",
               "--max-tokens", "6", "--ignore-eos", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["completion_tokens"] == len(out["token_ids"]) == 6
    assert out["finish_reason"] == "length" and out["prompt_tokens"] > 3 and out["text"]
    t = out["timings"]
    for key in ("load_ms", "prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second", "ttft_ms"):
        assert t[key] > 0, key
    assert len(t["itl_ms"]) == 5
    events = json.loads(trace.read_text())["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X"]
    assert names.count("prefill chunk") == 1 and "decode" in names and "queued" in names
    steps = [e for e in events if e["name"].startswith("step")]
    assert len(steps) == 6 and sum(e["args"]["decode_tokens"] for e in steps) == 5


@pytest.mark.slow
def test_generate_follows_a_json_schema_file_and_a_regex(tmp_path):
    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 20}}}
    (tmp_path / "city.json").write_text(json.dumps(schema))
    proc = run("generate", "Which city is the capital of France?", "--json-schema", str(tmp_path / "city.json"),
               "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(json.loads(out["text"])) == {"city"} and out["finish_reason"] == "stop"
    proc = run("generate", "A year:", "--regex", "(19|20)[0-9]{2}", "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch("(19|20)[0-9]{2}", json.loads(proc.stdout)["text"])


@pytest.mark.parametrize("flags, needle", [
    (["--json-schema", "/no/such/schema.json"], "/no/such/schema.json"),
    (["--regex", "(a"], "invalid regex"),
    (["--regex", "a", "--choice", "b"], "not allowed with"),
])
def test_a_bad_constraint_is_one_line(flags, needle):
    assert_one_line_error(run("generate", "hi", *flags), needle)    # argparse's own errors too


@pytest.mark.slow
def test_streams_text_then_prints_where_the_time_went():
    proc = run("generate", "Say hi.", "--max-tokens", "12", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    for label in ("load time", "prompt eval time", "eval time", "time to first token", "total time"):
        assert label in proc.stderr
    # the default is the fast path, and the command says which precision it chose
    assert "precision: q4 weights, int8 KV cache (chosen for this machine" in proc.stderr


def test_an_isa_level_the_cpu_cannot_run_is_one_line(monkeypatch):
    from phasewise.kernels.isa import machine_arch

    other = "neon-dotprod" if machine_arch() == "x86_64" else "avx512"   # a level of the other architecture
    monkeypatch.setenv("PHASEWISE_ISA", other)
    assert_one_line_error(run("generate", "hi", "--max-tokens", "2"), f"PHASEWISE_ISA={other}")


def test_memory_from_numbers():
    shape = ("--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--context", "4096")
    proc = run("memory", *shape, "--kv-dtype", "fp16")
    assert proc.returncode == 0, proc.stderr
    assert "0.3125 MiB per token" in proc.stdout and "1,280.0 MiB" in proc.stdout
    proc = run("memory", *shape)             # the engine's default: int8, V's and K's scales beside
    assert proc.returncode == 0, proc.stderr
    assert "KV cache (int8): 0.1978 MiB per token" in proc.stdout
    proc = run("memory", *shape, "--kv-dtype", "int4")
    assert proc.returncode == 0, proc.stderr
    assert "KV cache (int4): 0.08789 MiB per token" in proc.stdout


def test_memory_of_the_default_model():
    proc = run("memory", "--context", "8192")
    assert proc.returncode == 0, proc.stderr
    assert "2 x 30 layers x 3 kv heads x 64 head dim" in proc.stdout and "134.5 M parameters" in proc.stdout


def test_cost_with_prompt_caching():
    proc = run("cost", "--requests", "1000", "--input-len", "2000", "--output-len", "300",
               "--prefix-len", "1500", "--input-price", "3", "--output-price", "15")
    assert proc.returncode == 0, proc.stderr
    assert "10.5000" in proc.stdout and "saves" in proc.stdout


def test_lab_bad_input_is_one_line():
    assert_one_line_error(run("memory", "--layers", "3"), "--layers")
    assert_one_line_error(run("cost", "--requests", "1", "--input-len", "5", "--output-len", "1",
                              "--prefix-len", "9", "--input-price", "1", "--output-price", "1"),
                          "--prefix-len 9")


@pytest.mark.slow
def test_roofline_runs_and_names_the_binding_resource():
    proc = run("roofline", "--input-len", "32", "--output-len", "4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("machine: DRAM read")
    assert lines[2].startswith("prefill") and lines[3].startswith("decode")
    assert lines[3].endswith(("memory bandwidth", "compute"))
    saved = Path(lines[-1].removeprefix("machine figures kept in ").split(" (")[0])
    figures = json.loads(saved.read_text())       # what the server's dashboard reads for its roofs
    assert any(key.endswith("threads / float32") and value["dram_gbs"] > 0 for key, value in figures.items())


@pytest.mark.parametrize("flags, weights", [
    ([], "auto"),
    (["--quantization", "q4"], "q4"),
    (["--quantization", "int8", "--dtype", "fp32"], "int8"),
    (["--quantization", "none"], "fp32"),
    (["--dtype", "bf16"], "bf16"),
])
def test_quantization_is_its_own_option_and_dtype_keeps_the_float_type(flags, weights):
    from phasewise.cli import build_parser
    from phasewise.engine.args import resolve_weights

    args = build_parser().parse_args(["generate", "hi", *flags])
    resolve_weights(args)
    assert args.dtype == weights


def test_disagreeing_weight_options_are_one_line():
    assert_one_line_error(run("generate", "hi", "--dtype", "bf16", "--quantization", "q4"), "quantization")


def test_a_weight_format_given_as_dtype_is_refused():
    """One spelling: int8 and q4 are --quantization's (argparse's one-line usage error, exit 2); the
    Python API says where they go."""
    from phasewise import LLM

    assert_one_line_error(run("generate", "hi", "--dtype", "q4"), "invalid choice: 'q4'")
    with pytest.raises(ValueError, match="quantization='q4'"):
        LLM(dtype="q4")
