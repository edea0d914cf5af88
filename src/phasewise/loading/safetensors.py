"""Read a Hugging Face model folder: config.json and *.safetensors shards."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from phasewise.loading.gguf import ModelLoadError

if TYPE_CHECKING:
    from safetensors import safe_open


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    return files


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of an open shard, read whole or in part (`get_slice` reads only the part's bytes)."""
    file: Path
    handle: safe_open         # open while the shard is being read
    name: str

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        try:
            if rows is None and cols is None:
                return self.handle.get_tensor(self.name)
            part = self.handle.get_slice(self.name)
            rows = slice(None) if rows is None else rows
            return part[rows] if cols is None else part[rows, cols]
        except Exception as e:
            raise ModelLoadError(f"cannot read {self.name} from {self.file}: {type(e).__name__}: "
                                 f"{e}") from None


def hf_tensors(folder: Path) -> Iterator[tuple[str, SafetensorsTensor]]:
    """(name, tensor to read) for every tensor of every shard, one shard open at a time (memory-mapped):
    read each before asking for the next."""
    from safetensors import safe_open

    for file in safetensors_files(folder):
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:
            raise ModelLoadError(f"cannot read {file}: {type(e).__name__}: {e}") from None
        with handle as f:
            for name in f.keys():
                yield name, SafetensorsTensor(file, f, name)
