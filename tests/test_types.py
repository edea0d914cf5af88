"""The annotations are checked, not only written: mypy (pyproject.toml's [tool.mypy], Python 3.10 rules)
reports no error in src/phasewise. A type that lies fails here, as a wrong import fails
test_architecture.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_mypy_finds_no_error_in_src():
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".cache" / "mypy"),
                           "src/phasewise"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
