"""Load a user's adapter factory named on the command line (``module:attr`` or ``path.py:attr``) and tell
which profile it belongs to (block store or prefix cache)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
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
    except (Exception, SystemExit) as exc:  # the user's module: any failure (a sys.exit too) is a bad --adapter
        raise UsageError(f"--adapter: cannot import {where}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--adapter: {where} has no callable {attr!r}")
    return factory


_LOADED: dict[Path, Any] = {}  # FILE.py adapters imported by this process, by resolved path: imported once


def _import(where: str) -> Any:
    """The module ``where`` names, importable as ``python -m`` and ``python FILE.py`` would make it: a module
    from the current directory, and a file's sibling modules (its directory first on the path)."""
    if not where.endswith(".py"):
        _on_path(os.getcwd())
        return importlib.import_module(where)
    path = Path(where).resolve()
    if path in _LOADED:
        return _LOADED[path]
    _on_path(str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses and pickling look their module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[path.stem]
        raise
    _LOADED[path] = module
    return module


def _on_path(directory: str) -> None:
    if directory not in sys.path:
        sys.path.insert(0, directory)


def import_lines(ref: str, name: str) -> str:
    """Python source that makes ``name`` the factory ``ref`` names (for generated tests); a file is named by
    its absolute path, so the test runs from whatever directory it is written to or run from."""
    where, _, attr = ref.rpartition(":")
    if where.endswith(".py"):
        stem = Path(where).stem
        where = str(Path(where).resolve())
        return (
            "import importlib.util\n"
            "import sys\n"
            f"sys.path.insert(0, {str(Path(where).parent)!r})  # the adapter's sibling modules\n"
            f"_spec = importlib.util.spec_from_file_location({stem!r}, {where!r})\n"
            "_module = importlib.util.module_from_spec(_spec)\n"
            f"sys.modules[{stem!r}] = _module  # dataclasses look their module up by name\n"
            "_spec.loader.exec_module(_module)\n"
            f"{name} = _module.{attr}"
        )
    return f"from {where} import {attr} as {name}"


FUZZ_CALLS = "fuzz calls the factory with the keywords of a --variant, none by default"
CHECK_CALLS = "check calls a prefix-cache factory with the explorer's Bounds"


def make_block_store(factory: Callable[..., Any], variant: dict, ref: str, takes_bounds: bool = True) -> Any:
    """``factory(**variant)`` when ``factory`` makes ``BlockStoreAdapter``s; None when it makes prefix caches
    (``CacheAdapter``s, or, where ``takes_bounds`` (``check``), it wants the explorer's ``Bounds``).
    ``UsageError`` when the variant does not fit a block-store factory, the factory fails, or it makes
    something else (None included)."""
    from hicache_fsm.testing.adapter import CacheAdapter
    from hicache_fsm.testing.blockstore import BlockStoreAdapter

    try:
        made = factory(**variant)
    except TypeError as exc:
        probe = _probe(factory)  # a block-store factory without the variant? then the variant is what is wrong
        if isinstance(probe, BlockStoreAdapter) or (variant and isinstance(probe, CacheAdapter)):
            raise UsageError(f"--variant {_short(variant)} does not fit {ref}: {exc}") from None
        if not takes_bounds:  # fuzz: a factory wanting other arguments (the explorer's Bounds) cannot be run
            raise UsageError(f"--adapter {ref}{_with(variant)} raised TypeError: {exc} ({FUZZ_CALLS})") from None
        return None  # a prefix-cache factory taking the Bounds
    except (Exception, SystemExit) as exc:  # the user's factory: any failure is a bad --adapter / --variant
        raise UsageError(f"--adapter {ref}{_with(variant)} raised {type(exc).__name__}: {exc}") from None
    if isinstance(made, BlockStoreAdapter):
        return made
    if isinstance(made, CacheAdapter):
        _close(made)
        return None
    raise UsageError(f"--adapter {ref}{_with(variant)} returned {type(made).__name__}, "
                     "not a BlockStoreAdapter or CacheAdapter")


def check_explorer_factory(factory: Callable[..., Any], ref: str, bounds: Any) -> None:
    """Make (and close) one adapter as ``check`` will, ``factory(bounds)``: ``UsageError`` before anything runs
    when it raises, makes something other than a ``CacheAdapter`` (``fuzz``'s factory, say), or makes one
    without the operations the explorer needs: a mistake in ``--adapter``, not a finding of the run."""
    from hicache_fsm.errors import ConfigError
    from hicache_fsm.testing.adapter import CacheAdapter
    from hicache_fsm.testing.checks import UseOrder
    from hicache_fsm.testing.explorer import missing_ops

    try:
        made = factory(bounds)
    except (Exception, SystemExit) as exc:  # the user's factory: any failure to make one is a bad --adapter
        raise UsageError(f"--adapter {ref} raised {type(exc).__name__}: {exc} ({CHECK_CALLS})") from None
    _close(made)
    if not isinstance(made, CacheAdapter):
        raise UsageError(f"--adapter {ref} returned {type(made).__name__}, not a CacheAdapter ({CHECK_CALLS})")
    missing = missing_ops(made)
    if missing:
        raise UsageError(f"--adapter {ref} makes {type(made).__name__}, which lacks {' and '.join(missing)}: "
                         f"check needs them (the explorer's visited set and node bound)")
    for what, ask in (("describe", made.describe), ("eviction_policy", lambda: UseOrder.of(made))):
        try:  # the explorer asks both before the search
            ask()
        except ConfigError as exc:  # a policy the toolkit cannot judge
            raise UsageError(f"--adapter {ref}: {exc}") from None
        except (Exception, SystemExit) as exc:  # the user's code: its failure is a bad --adapter
            raise UsageError(f"--adapter {ref}: the adapter's {what} raised {type(exc).__name__}: {exc}") from None
    if bounds.namespaces > 1 and getattr(made, "namespaces", 1) != bounds.namespaces:
        raise UsageError(f"--namespaces {bounds.namespaces}: the {type(made).__name__} --adapter {ref} makes has "
                         f"namespaces={getattr(made, 'namespaces', 1)} (its factory must read Bounds.namespaces "
                         f"and file prompts under that many namespaces, as HiCacheAdapter(namespaces=N) does)")
    config = getattr(made, "config", None)
    differ = [f"{k}={v!r}" for k, v in bounds.cache_options if getattr(config, k, object()) != v]
    if differ:
        raise UsageError(f"--cache-option {', '.join(differ)}: the {type(made).__name__} --adapter {ref} makes does "
                         f"not report them in its config (its factory must pass Bounds.cache_options to the cache, as "
                         f"HiCacheAdapter(**options) does)")
    _check_storage_bounds(made, ref, bounds)


STORAGE_STEPS = ("prefetch", "store_remote", "complete_storage")  # what ``--storage`` adds to the explored steps


def _check_storage_bounds(made: Any, ref: str, bounds: Any) -> None:
    """``UsageError`` when ``--storage`` or a storage limit would be ignored by the adapter (the run would pass
    without them): it must take storage steps, and report the limits and the tenant as attributes."""
    name = type(made).__name__
    if bounds.storage and not any(made.supports(op) for op in STORAGE_STEPS):
        raise UsageError(f"--storage: the {name} --adapter {ref} makes takes none of the storage steps "
                         f"({', '.join(STORAGE_STEPS)}): its factory must attach storage when Bounds.storage is set")
    wanted = list(bounds.storage_options)
    if bounds.remote_tenant is not None:
        wanted.append(("remote_tenant", bounds.remote_tenant))
    differ = [f"{k}={v!r}" for k, v in wanted if getattr(made, k, object()) != v]
    if differ:
        raise UsageError(f"--storage-option/--remote-tenant {', '.join(differ)}: the {name} --adapter {ref} makes "
                         f"does not report them as attributes (its factory must pass Bounds.storage_options and "
                         f"Bounds.remote_tenant on, as HiCacheAdapter does)")


def _probe(factory: Callable[..., Any]) -> Any:
    try:
        made = factory()
    except (Exception, SystemExit):  # noqa: BLE001 - only asking whether it makes a block store without arguments
        return None
    _close(made)
    return made


def _close(made: Any) -> None:
    close = getattr(made, "close", None)
    if callable(close):
        try:
            close()
        except (Exception, SystemExit) as exc:  # the user's close: its failure is a bad --adapter
            raise UsageError(f"--adapter: the adapter's close raised {type(exc).__name__}: {exc}") from None


def _with(variant: dict) -> str:
    return f" with --variant {_short(variant)}" if variant else ""


def _short(variant: dict) -> str:
    text = json.dumps(variant, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
