"""Read a Hugging Face model folder: config.json and *.safetensors shards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from phasewise.loading.gguf import ModelLoadError


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    return files


def hf_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every shard, one tensor at a time (memory-mapped)."""
    from safetensors import safe_open

    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read {file}: {type(e).__name__}: {e}") from None
