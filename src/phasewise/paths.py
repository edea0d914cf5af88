"""Where phasewise keeps what it builds and converts (kernels, tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Root of phasewise's cache: $PHASEWISE_CACHE, else $XDG_CACHE_HOME/phasewise, else ~/.cache/phasewise."""
    if os.environ.get("PHASEWISE_CACHE"):
        return Path(os.environ["PHASEWISE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "phasewise"
