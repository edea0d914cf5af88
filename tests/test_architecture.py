"""The layering of docs/architecture.md, as import-linter contracts (pyproject.toml): the engine core
imports no torch and nothing above it; models, layers, kernels and loading know nothing of the
engine, server or lab; the server and the lab import only the public API; no package cycles."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
