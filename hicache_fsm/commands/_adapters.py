"""Load a user's adapter factory named on the command line (``module:attr`` or ``path.py:attr``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache_fsm.commands.args import UsageError


def load_factory(ref: str) -> Callable[..., Any]:
    """``pkg.module:make`` or ``some/file.py:make`` -> the callable ``make`` (UsageError if it cannot be had)."""
    if ":" not in ref:
        raise UsageError(f"--adapter wants MODULE:CALLABLE or FILE.py:CALLABLE, got {ref!r}")
    where, _, attr = ref.rpartition(":")
    if where.endswith(".py") and not Path(where).is_file():
        raise UsageError(f"--adapter: no such file {where}")
    try:
        module = _import(where)
    except Exception as exc:  # the user's module: any failure to import it is a bad --adapter
        raise UsageError(f"--adapter: cannot import {where}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--adapter: {where} has no callable {attr!r}")
    return factory


def _import(where: str) -> Any:
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where)
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def import_lines(ref: str, name: str) -> str:
    """Python source that makes ``name`` the factory ``ref`` names (for generated tests); a file is named by
    its absolute path, so the test runs from whatever directory it is written to or run from."""
    where, _, attr = ref.rpartition(":")
    if where.endswith(".py"):
        stem = Path(where).stem
        where = str(Path(where).resolve())
        return (
            "import importlib.util\n"
            f"_spec = importlib.util.spec_from_file_location({stem!r}, {where!r})\n"
            "_module = importlib.util.module_from_spec(_spec)\n"
            "_spec.loader.exec_module(_module)\n"
            f"{name} = _module.{attr}"
        )
    return f"from {where} import {attr} as {name}"


def make_block_store(factory: Callable[..., Any], variant: dict) -> Any:
    """``factory(**variant)`` when that makes a ``BlockStoreAdapter`` (the block-store profile), else None
    (a prefix-cache factory: ``check`` calls those with the ``Bounds``)."""
    from hicache_fsm.testing.blockstore import BlockStoreAdapter

    try:
        made = factory(**variant)
    except TypeError:
        return None
    if isinstance(made, BlockStoreAdapter):
        return made
    close = getattr(made, "close", None)
    if callable(close):
        close()
    return None
