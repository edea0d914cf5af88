"""Opening the prefix cache's disk tier for an engine (`--prompt-cache-dir`): what it may run with, and
the fingerprint that keeps each model's blocks apart (core/disk_tier.py, core/prompt_store.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from phasewise.config import EngineConfig
from phasewise.core.disk_tier import DiskTier
from phasewise.core.prompt_store import Clock, PromptStore, WallClock, check_writable
from phasewise.loading.file_key import content_key
from phasewise.models.config import ModelConfig
from phasewise.runner.kv_cache import KVCache

FORMAT = "phasewise-kv-1"     # bump when what a block's bytes mean changes (the fingerprint changes with it)


def model_key(path: Path) -> str:
    """The model's content key: a file's (loading/file_key.py), or a folder's weights and config."""
    if path.is_file():
        return content_key(path)
    files = sorted(p for p in path.iterdir()
                   if p.suffix in (".safetensors", ".bin", ".gguf") or p.name == "config.json")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}:{content_key(p)};".encode())
    return h.hexdigest()[:24]


def fingerprint(model_path: Path, weights: str, cache: KVCache, kernels: bool) -> bytes:
    """16 bytes naming the blocks an engine writes and may read: the model file's content, the weights'
    precision, the KV cache's dtype, block size and layout, and whether compiled kernels computed them."""
    text = f"{FORMAT}|{model_key(model_path)}|{weights}|{cache.block_layout}|kernels={kernels}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def check_supported(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError (one line) for what the disk tier does not run with yet, or a directory that cannot be
    written (checked before the model loads)."""
    if config.cache.prompt_cache_dir is None:
        return
    if not config.cache.enable_prefix_caching:
        raise ValueError("--prompt-cache-dir needs prefix caching (the disk tier sits under it)")
    if any(w is not None for w in model.kv_group_windows):
        raise ValueError(f"--prompt-cache-dir: {model.architecture} has sliding-window layers, "
                         "which the disk tier does not store yet")
    if config.tensor_parallel_size > 1:
        raise ValueError("--prompt-cache-dir is not implemented under tensor parallelism yet")
    check_writable(Path(config.cache.prompt_cache_dir or ".").expanduser())


def open_disk_tier(config: EngineConfig, model_path: Path, weights: str, cache: KVCache, kernels: bool,
                   clock: Clock | None = None) -> DiskTier | None:
    """The engine's disk tier, or None without --prompt-cache-dir. ValueError for a directory that
    cannot be written (a clear error at start rather than a silent RAM-only cache)."""
    c = config.cache
    if c.prompt_cache_dir is None:
        return None
    key = fingerprint(model_path, weights, cache, kernels)
    store = PromptStore(Path(c.prompt_cache_dir).expanduser(), key,
                        int(c.prompt_cache_size_gib * 2**30), clock or WallClock())
    return DiskTier(store, cache, c.block_size, c.prompt_cache_ttl)
