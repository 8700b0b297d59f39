"""Import a script from examples/ as a module, the way the adapter loader does (registered in sys.modules)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(filename: str) -> ModuleType:
    """The module of ``examples/<filename>``, registered under its stem (dataclasses and typing look it up there)."""
    path = EXAMPLES / filename
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
