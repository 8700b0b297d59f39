"""Plain-text tables: one column per configuration, one row per figure (``simulate``'s report)."""

from __future__ import annotations


def columns(names: list[str], rows: list[tuple[str, list[str]]]) -> str:
    """``rows`` of (label, one cell per name) under a header of ``names``, right-aligned, dashed rule below."""
    head = ["", *names]
    width0 = max(len(r[0]) for r in rows)
    widths = [max(len(head[i + 1]), *(len(r[1][i]) for r in rows)) for i in range(len(names))]
    lines = ["  ".join([head[0].ljust(width0), *(h.rjust(wd) for h, wd in zip(head[1:], widths))])]
    lines.append("  ".join(["-" * width0, *("-" * wd for wd in widths)]))
    for label, cells in rows:
        lines.append("  ".join([label.ljust(width0), *(c.rjust(wd) for c, wd in zip(cells, widths))]))
    return "\n".join(lines)
