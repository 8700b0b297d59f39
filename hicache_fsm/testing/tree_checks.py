"""Checks of a ``HiCache``'s tree that neither the residency spec nor the KV read-back can state."""

from __future__ import annotations

from hicache_fsm.radix import page_key

__all__ = ["hicache_structure_violations"]


def hicache_structure_violations(cache) -> list[str]:
    """Checks of the cache's bookkeeping that the residency spec cannot express.

    - ``tree_well_formed``: every node is reachable from the root through its
      parent's children map, filed there under its first page in its
      namespace, in its parent's namespace (below the root), and every node
      the map names is live;
    - ``hit_counts_monotone``: a match counts every node on its path, so a
      parent has been hit at least as often as each child.
    """
    problems = []
    tree = cache.tree
    seen = {tree.root.id}
    stack = [tree.root]
    while stack:
        p = stack.pop()
        for key, c in p.children.items():
            if key != page_key(c.namespace, c.raw[: tree.page_bytes]):
                problems.append(f"tree_well_formed: node {c.id} is filed under {p.id} by another key than its first "
                                f"page in its namespace {c.namespace!r}")
            if not p.is_root and c.namespace != p.namespace:
                problems.append(f"tree_well_formed: node {c.id} is in namespace {c.namespace!r}, its parent {p.id} "
                                f"in {p.namespace!r}")
            if c.parent is not p:
                problems.append(f"tree_well_formed: node {c.id} is a child of {p.id} but its parent is "
                                f"{getattr(c.parent, 'id', None)}")
            if not tree.owns(c):
                problems.append(f"tree_well_formed: node {c.id} under {p.id} is not a live node")
            if c.id in seen:
                problems.append(f"tree_well_formed: node {c.id} is reachable twice")
                continue
            seen.add(c.id)
            stack.append(c)
    for n in tree.nodes():
        if n.id not in seen:
            problems.append(f"tree_well_formed: node {n.id} ({n.state}) is not reachable from the root (orphaned)")
    for n in tree.nodes():
        p = n.parent
        if p is not None and not p.is_root and p.hit_count < n.hit_count:
            problems.append(f"hit_counts_monotone: node {n.id} was hit {n.hit_count} times, its parent {p.id} only {p.hit_count}")
    return problems
