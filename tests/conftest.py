"""Shared fixtures and helpers: run a loaded model over the paged KV cache without the engine."""

from __future__ import annotations

import torch
import pytest

from phasewise.kernels.isa import runnable_levels
from phasewise.layers.attention import AttentionMetadata
from phasewise.runner.kv_cache import KVCache

# Every ISA level this CPU can run (PHASEWISE_ISA caps it): the kernel tests run at each.
LEVELS = [lv.name for lv in runnable_levels()]


class PagedRunner:
    """Drives one sequence through a model with a small paged KV cache (shuffled block ids)."""

    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 64, seed: int = 0) -> None:
        """num_blocks per KV group; each group gets its own shuffled blocks of one pool."""
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        groups = len(model.config.kv_groups)
        hybrid = bool(model.config.recurrent_layers)            # its recurrent state: one slot, 0
        self.cache = KVCache(model.config, num_blocks * groups, block_size, dtype, "cpu", num_state_slots=int(hybrid))
        self.state_slots = [0] if hybrid else None
        perm = torch.randperm(num_blocks * groups, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables = [perm[g::groups] for g in range(groups)]

    @torch.inference_mode()
    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Compute tokens ids at positions start.. (context start + len(ids)); logits [len(ids), V]."""
        n = len(ids)
        meta = AttentionMetadata.build_groups([n], [start + n], [[t] for t in self.tables], self.block_size,
                                              torch.device("cpu"))
        meta.state_slots = self.state_slots
        hidden = self.model(torch.tensor(ids), torch.arange(start, start + n), meta, self.cache.layers)
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: list[int], n: int, chunk: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """Prefill (in chunks of `chunk` tokens if given), then n greedy tokens: (prompt logits, tokens)."""
        chunk = chunk or len(prompt)
        logits = torch.cat([self.forward(prompt[i:i + chunk], i) for i in range(0, len(prompt), chunk)])
        out = [int(logits[-1].argmax())]
        while len(out) < n:
            step = self.forward([out[-1]], len(prompt) + len(out) - 1)
            out.append(int(step[-1].argmax()))
        return logits, out


def transformers_from_gguf(path):
    """transformers' fp32 model of a GGUF file, the parity reference. Its conversion (20-60 s: gguf-py
    reads the metadata and dequantizes every tensor in Python) is kept in phasewise's cache as
    safetensors, keyed by the file's size and first MiB and transformers' version, so fresh clones
    and venvs reuse it (transformers will not save a model it loaded from a GGUF: its config and
    weights are saved here)."""
    import hashlib
    import shutil

    import transformers
    from safetensors.torch import load_model, save_model

    from phasewise.config import default_cache_dir

    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    key = f"{path.stem}-{path.stat().st_size}-{head}-transformers-{transformers.__version__}"
    kept = default_cache_dir() / "transformers" / key
    if (kept / "model.safetensors").exists():
        config = transformers.AutoConfig.from_pretrained(kept)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        load_model(model, kept / "model.safetensors")
        return model.eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    partial = kept.with_name(kept.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(partial)
    save_model(model, str(partial / "model.safetensors"))
    shutil.rmtree(kept, ignore_errors=True)
    partial.rename(kept)
    return model.eval()


@pytest.fixture(scope="session")
def default_model_path():
    from phasewise.loading.loader import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def llm():
    """The default model in the full engine at fp32 (the transformers parity the tests check), loaded
    once for the whole session."""
    from phasewise import LLM

    return LLM(dtype="fp32", kv_dtype="model", kv_cache_memory=0.25)


def _capped_levels() -> list[str]:
    """LEVELS up to PHASEWISE_ISA when it is set (to show a lower machine's suite on this one)."""
    import os

    cap = os.environ.get("PHASEWISE_ISA")
    return LEVELS[: LEVELS.index(cap) + 1] if cap in LEVELS else LEVELS


@pytest.fixture(scope="session", params=_capped_levels())
def ops(request):
    """The compiled kernels of one ISA level; tests that take it run once per level."""
    from phasewise.kernels import build

    kernels = build.load(request.param)
    assert kernels is not None, f"the {request.param} kernels failed to build"
    assert kernels.isa.startswith(request.param)
    return kernels


@pytest.fixture(scope="session")
def chosen_ops():
    """The kernels an engine on this machine uses (PHASEWISE_ISA, else the best level)."""
    from phasewise.kernels import build

    kernels = build.load()
    assert kernels is not None, "the kernels failed to build"
    return kernels


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One live `phasewise serve` for the server tests (tests/live_server.py)."""
    from live_server import MAX_BODY, start_server, stop_server

    s = start_server(tmp_path_factory.mktemp("server"), "--max-body-bytes", str(MAX_BODY))
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="session")
def guarded(tmp_path_factory):
    """A second server: an API key, four running requests at most, eight waiting at most."""
    from live_server import KEY, start_server, stop_server

    s = start_server(tmp_path_factory.mktemp("guarded"), "--api-key", KEY, "--max-waiting", "8",
                     "--max-num-seqs", "4")
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="session")
def qwen_server(tmp_path_factory):
    """`phasewise serve` on Qwen2.5-Coder-0.5B-Instruct at its default precision, served as "qwen": a chat
    template with tool support (Hermes <tool_call> blocks). Skipped where the model is not installed
    (make qwen2.5-coder-0.5b; make test installs it)."""
    from live_server import start_server, stop_server
    from phasewise.loading.gguf import ModelLoadError
    from phasewise.loading.loader import resolve_model_path

    try:
        path = resolve_model_path("qwen2.5-coder-0.5b")
    except ModelLoadError as e:
        pytest.skip(str(e))
    s = start_server(tmp_path_factory.mktemp("qwen"), "--model", str(path), "--served-model-name", "qwen")
    yield s
    stop_server(s)
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def bind(model, kernels) -> None:
    """Kernels into a model and its C++ decoder stack, as the loader and the engine builder do."""
    from phasewise.kernels import bind_kernels

    bind_kernels(model, kernels)
    model.build_stack(kernels)


def assert_paths_agree(fast: torch.Tensor, ref: torch.Tensor, what: str = "logits") -> None:
    """Two paths through the same int8 kernels (the decoder stack and the Python layers) agree.

    They sum in other orders, so values differ in their last bits; where one sits on a rounding
    boundary of the per-32 int8 activation quantisation, one path rounds up and the other down, a
    one-quantum difference that reaches the logits as up to ~1% of their norm (compilers differ in
    which values those are). A wrong wiring (a missed norm or gate, a wrong state slot, a skipped
    snapshot) is tens of percent: the check bounds the relative error at 3%, and argmax agrees on
    every row whose top two are further apart than the largest difference."""
    fast, ref = fast.nan_to_num(), ref.nan_to_num()
    if not ref.numel():
        assert not fast.numel()
        return
    rel = ((fast - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert rel < 3e-2, f"{what}: the paths differ by {rel:.2%} of the reference's norm"
    if what == "logits":
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (fast - ref).abs().max()
        assert (fast.argmax(-1) == ref.argmax(-1))[clear].all(), f"{what}: argmax differs on a clear row"
