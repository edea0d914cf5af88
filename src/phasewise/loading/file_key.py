"""A model file's identity by its content, for the caches built from it (the tokenizer, the packed
weights): a copied or moved file is the same file, an edited one is not.

The key hashes the size, the first HEAD bytes (a GGUF's header: its metadata, vocabulary and tensor
directory, with room to spare) and SAMPLES blocks spread evenly over the rest. That is about 17 MiB
read and 20 ms of hashing whatever the file's size, where hashing a 5 GB file whole would take
seconds; what it could miss is an edit of tensor data that keeps the size and every sampled block.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HEAD = 16 << 20         # bytes hashed from the start
SAMPLES = 16            # blocks hashed past the head
BLOCK = 64 << 10


def content_key(path: Path, length: int = 24) -> str:
    """Hex digest (`length` characters) of the file's size, head and sampled blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        h.update(size.to_bytes(8, "little"))
        f.seek(0)
        h.update(f.read(HEAD))
        rest = size - HEAD - BLOCK
        for i in range(SAMPLES if rest > 0 else 0):
            f.seek(HEAD + rest * i // (SAMPLES - 1))
            h.update(f.read(BLOCK))
    return h.hexdigest()[:length]
