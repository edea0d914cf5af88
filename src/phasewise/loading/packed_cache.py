"""The packed-weight cache: a GGUF's layers as `plan_file_weights` packs them, kept on disk so later
loads map them instead of repacking (as OpenVINO's cache_dir keeps compiled blobs).

One file per model under `<cache>/packed/`, named by the GGUF's identity (resolved path, size,
mtime, a hash of its first MiB) and `PACK_VERSION` (the packed layouts of kernels/quant.py; the
layout is the same at every ISA level, so one file serves all). Written to a temporary name and
renamed; read with `torch.load(mmap=True)`, so a load maps the file (the page cache holds it once
for every process) and copies nothing. A file that does not read, or whose weights do not match
the model's layers, is ignored and rewritten. Files under MIN_BYTES (test models) are not cached,
and writing one removes the entries whose GGUF is gone or has changed (each names its source in
a `.src` file beside it), so the directory holds one entry per model file that exists.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

from phasewise.kernels import quant

PACK_VERSION = 3          # bump when kernels/quant.py's layouts change (2: k4 and q6k at the file's width; 3: parts)
MIN_BYTES = 32 << 20      # smaller GGUFs pack in well under a second: not cached


def wanted(gguf_path: Path) -> bool:
    return gguf_path.stat().st_size >= MIN_BYTES


def cache_path(gguf_path: Path) -> Path:
    from phasewise.paths import default_cache_dir

    path = gguf_path.resolve()
    st = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{head}|{PACK_VERSION}".encode()).hexdigest()[:20]
    return default_cache_dir() / "packed" / f"{path.stem}-{key}.pt"


def _record(w: quant.PackedWeight) -> dict:
    return {"fmt": w.fmt, "n": w.n, "k": w.k, "blocks": w.blocks, "scale": w.scale, "u5_tiles": w.u5_tiles,
            "rest": [_record(p) for p in w.rest]}


def _weight(r: dict) -> quant.PackedWeight:
    return quant.PackedWeight(fmt=r["fmt"], n=r["n"], k=r["k"], blocks=r["blocks"], scale=r["scale"],
                              u5_tiles=r["u5_tiles"], rest=tuple(_weight(p) for p in r["rest"]))


def save(path: Path, source: Path, linears: dict[str, quant.PackedWeight], embedding: quant.PackedWeight | None,
         names: set[str]) -> None:
    """Write the packed layers of the GGUF `source` (a tied table is stored once: "embedding" names
    its layer)."""
    tied = next((p for p, w in linears.items() if w is embedding), None)
    data = {"version": PACK_VERSION, "linears": {p: _record(w) for p, w in linears.items()},
            "embedding": tied if tied is not None or embedding is None else _record(embedding),
            "names": sorted(names)}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        _prune(path.parent, source)
        torch.save(data, partial)
        os.replace(partial, path)
        path.with_suffix(".src").write_text(str(source))
    except OSError as e:                     # a full disk costs the next load its speed, nothing else
        partial.unlink(missing_ok=True)
        print(f"phasewise: warning: cannot write the packed-weight cache {path}: {e}", file=sys.stderr)


def _prune(folder: Path, source: Path) -> None:
    """Remove the entries of GGUFs that are gone and the older entries of `source`."""
    for src in folder.glob("*.src"):
        try:
            named = Path(src.read_text())
        except OSError:
            continue
        if named == source.resolve() or not named.is_file():
            src.with_suffix(".pt").unlink(missing_ok=True)
            src.unlink(missing_ok=True)


def load(path: Path) -> tuple[dict[str, quant.PackedWeight], quant.PackedWeight | None, set[str]] | None:
    """(linears by layer path, token table, checkpoint names), mapped from `path`; None when absent
    or unreadable."""
    if not path.is_file():
        return None
    try:
        data = torch.load(path, mmap=True, weights_only=True)
        if data.get("version") != PACK_VERSION:
            return None
        linears = {p: _weight(r) for p, r in data["linears"].items()}
        table = data["embedding"]
        embedding = linears[table] if isinstance(table, str) else None if table is None else _weight(table)
        for w in [p for w in [*linears.values(), *([embedding] if embedding is not None else [])] for p in w.parts]:
            if w.fmt not in quant.FORMAT_IDS or w.blocks.shape[-1] != quant.BLOCK_BYTES[w.fmt] or \
                    w.blocks.shape[0] * quant.TILE < w.n or w.blocks.shape[1] * quant.QK != w.k:
                return None
        return linears, embedding, set(data["names"])
    except Exception as e:  # noqa: BLE001 - a damaged cache file of any kind is repacked, not fatal
        print(f"phasewise: warning: ignoring the packed-weight cache {path} ({type(e).__name__}: {e})",
              file=sys.stderr)
        return None
