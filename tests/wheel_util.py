"""Build the wheel of this checkout offline, for the tests that install it the way a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Offline, quiet pip: nothing here may reach an index.
PIP_ENV = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}


def build_wheel(tmp: Path) -> Path:
    """The wheel built (``--no-deps``, no build isolation) from a clean copy of the package sources under ``tmp``."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "hicache_fsm", src / "hicache_fsm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    args = [sys.executable, "-m", "pip", "-q", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
            str(src)]
    proc = subprocess.run(args, cwd=tmp, env={**env, **PIP_ENV}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip wheel exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    (wheel,) = (tmp / "dist").glob("hicache_fsm-*.whl")
    return wheel
