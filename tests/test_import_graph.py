"""The package's shape holds: no import cycle, parts never reach for the facade, small modules.

The import graph is built from the source with ``ast`` (nothing is imported):
every ``import`` and ``from ... import`` of a ``hicache_fsm`` module, relative
ones resolved, type-only ones (under ``if TYPE_CHECKING:``) and ones inside
functions included. ``from pkg import name`` counts as importing the module
``pkg.name`` when that module exists, else ``pkg`` itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = "hicache_fsm"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
FACADE = "hicache_fsm.cache"
MAX_LINES = 800
# who may import the facade: the engine-facing tools built on top of it
FACADE_USERS = ("hicache_fsm.commands", "hicache_fsm.bench", "hicache_fsm.testing", "hicache_fsm.simulate",
                "hicache_fsm.trace_replay", "hicache_fsm.metrics", "hicache_fsm.integrations",
                "hicache_fsm.events", "hicache_fsm.cluster_replay", "hicache_fsm.cp_world")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules ``name`` (at ``path``) imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    modules = set(files)
    return {name: imports_of(name, path, modules) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def may_import_facade(name: str) -> bool:
    return name == FACADE or any(name == m or name.startswith(m + ".") or name.startswith(m + "_")
                                 for m in FACADE_USERS)


def test_the_graph_sees_type_only_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("from . import a\nfrom .c import f\n")
    (pkg / "c.py").write_text("def f():\n    import pkg.a\n")
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    assert imports_of("pkg.a", pkg / "a.py", modules) == {"pkg.b"}
    assert imports_of("pkg.b", pkg / "b.py", modules) == {"pkg", "pkg.a", "pkg.c"}
    assert imports_of("pkg.c", pkg / "c.py", modules) == {"pkg.a"}
    graph = {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a", "pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (type-only imports included):\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_only_the_tools_on_top_import_the_facade():
    graph = import_graph()
    offenders = sorted(name for name, deps in graph.items() if FACADE in deps and not may_import_facade(name))
    assert not offenders, f"internal modules importing {FACADE} (give them the collaborators instead): {offenders}"


def test_no_module_over_the_line_limit():
    big = {name: n for name, path in source_files().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them along a seam): {big}"


def test_the_architecture_picture_matches_the_imports():
    """Every edge of the mermaid picture in docs/architecture.md is an import, and every import between its parts is drawn."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", doc, re.S)
    assert block, "docs/architecture.md has no mermaid picture"
    nodes: dict[str, str] = {}
    drawn: set[tuple[str, str]] = set()
    for line in block.group(1).splitlines():
        if m := re.fullmatch(r'\s*(\w+)\["([\w.]+)"\]\s*', line):
            nodes[m.group(1)] = m.group(2)
        elif m := re.fullmatch(r"\s*(\w+)\s*-->\s*(\w+)\s*", line):
            drawn.add((m.group(1), m.group(2)))
    assert nodes and drawn, "the picture declares no parts or no edges"
    graph = import_graph()
    unknown = sorted(set(nodes.values()) - set(graph))
    assert not unknown, f"the picture names modules that do not exist: {unknown}"
    by_module = {module: node for node, module in nodes.items()}
    actual = {(by_module[a], by_module[b]) for a in by_module for b in graph[a] if b in by_module}
    named = {(nodes[a], nodes[b]) for a, b in drawn}
    assert drawn == actual, (
        f"drawn but not imported: {sorted((nodes[a], nodes[b]) for a, b in drawn - actual)}; "
        f"imported but not drawn: {sorted((nodes[a], nodes[b]) for a, b in actual - drawn)}; drawn={sorted(named)}"
    )


# the controller's parts and the runtimes that attach to it: built with collaborators, never the facade
PARTS = ("hicache_fsm.residency_driver", "hicache_fsm.eviction", "hicache_fsm.load_back", "hicache_fsm.outbox",
         "hicache_fsm.acks", "hicache_fsm.layer_write", "hicache_fsm.storage.tier", "hicache_fsm.storage.threads",
         "hicache_fsm.storage.admission", "hicache_fsm.storage.prefetch", "hicache_fsm.storage.agreement")


@pytest.mark.parametrize("name", PARTS)
def test_parts_are_built_without_the_facade(name):
    """A part's module neither imports the facade, nor names it in a type, nor keeps a ``self.cache``."""
    text = source_files()[name].read_text()
    assert FACADE not in import_graph()[name] and "HiCache\"" not in text and ": HiCache" not in text
    kept = [n.lineno for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Attribute) and n.attr == "cache"
            and isinstance(n.value, ast.Name) and n.value.id == "self"]
    assert not kept, f"{name} keeps or reads self.cache (lines {kept}): give it the collaborators instead"


# modules that read collaborators off the cache once, when a runtime attaches -> the protocol naming them
ATTACH_HOSTS = {
    "hicache_fsm.interfaces": "TierHost",  # TierContext.of: what the storage tier is given
    "hicache_fsm.storage.tier": "TierHost",  # attach_storage
    "hicache_fsm.layer_write": "LayerWriteHost",
}


def protocol_members(name: str) -> set[str]:
    """Attributes and methods a protocol of ``interfaces.py`` declares."""
    tree = ast.parse(source_files()["hicache_fsm.interfaces"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} | {
        n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def cache_uses(module: str) -> set[str]:
    """Attributes a module reads or calls on a name ``cache``."""
    return {node.attr for node in ast.walk(ast.parse(source_files()[module].read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cache"}


@pytest.mark.parametrize("module", sorted(ATTACH_HOSTS))
def test_an_attaching_runtime_reads_only_what_its_protocol_names(module):
    """A reader learns everything a runtime is given at attach from its protocol in interfaces.py."""
    extra = cache_uses(module) - protocol_members(ATTACH_HOSTS[module])
    assert not extra, f"{module} reads {sorted(extra)} off the cache, not in {ATTACH_HOSTS[module]}"


@pytest.mark.parametrize("protocol", sorted(set(ATTACH_HOSTS.values())))
def test_the_facade_is_every_host_a_runtime_attaches_to(protocol):
    from hicache_fsm.cache import HiCache
    from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

    shape = KVShape(layers=1, heads=1, head_dim=2)
    cache = HiCache(DeviceKVPool(shape, 8, page_size=2, device="cpu"), HostKVPool(shape, 8, page_size=2))
    missing = sorted(m for m in protocol_members(protocol) if not hasattr(cache, m))
    assert not missing, f"HiCache lacks {missing} of {protocol}"


def holders_of(target: object, root: object) -> list[str]:
    """Paths from ``root``'s attributes (and its records' fields, one level down) to ``target``."""
    def fields(obj: object) -> dict[str, object]:
        names = set(getattr(obj, "__dict__", {})) | {n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())}
        return {n: getattr(obj, n) for n in names if hasattr(obj, n)}

    found = []
    for name, value in fields(root).items():
        if value is target:
            found.append(name)
        elif type(value).__module__.startswith(PACKAGE + ".interfaces") or type(value).__name__.endswith("Context"):
            found += [f"{name}.{n}" for n, v in fields(value).items() if v is target]
    return found


def test_no_part_holds_the_facade():
    """At run time too: no part, attached runtime or context record of a cache keeps the cache itself."""
    from hicache_fsm.cache import HiCache
    from hicache_fsm.cp_world import build_cp_rank
    from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape, PoolConfig

    shape = KVShape(layers=1, heads=1, head_dim=2)
    cache = HiCache(DeviceKVPool(shape, 8, page_size=2, device="cpu"), HostKVPool(shape, 8, page_size=2))
    cache.attach_storage("memory://")
    try:
        parts = {"driver": cache.driver, "eviction": cache.eviction, "loads": cache.loads, "outbox": cache.outbox,
                 "storage": cache.storage, "storage.runtime": cache.storage.runtime,
                 "residency_ctx": cache.residency_ctx, "attached": cache.attached}
        held = {name: paths for name, part in parts.items() if (paths := holders_of(cache, part))}
        assert not held, f"parts holding the facade: {held}"
    finally:
        cache.close()
    rank = build_cp_rank(PoolConfig(shape=shape, device_tokens=8, page_size=2, host_tokens=8), 2, 0)
    assert not holders_of(rank.cache, rank.writes), "the CP layer-write runtime holds the facade"
