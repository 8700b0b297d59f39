"""Seeded hypothesis runs that do not depend on what else the process imported.

Besides its random choices, hypothesis now and then draws a *local constant*: a literal it harvests
from every module in ``sys.modules`` whose file lies outside the standard library and site-packages.
Which of those modules are loaded depends on the process's history (the tests that ran before, an
editable install against a wheel, an adapter's module), so one seed could draw different runs: an
in-suite ``fuzz --cp`` once found a violation that no fresh process reproduced, because earlier tests
had imported more of this package. ``without_local_constants()`` empties that pool while a run
lasts; the constants hypothesis ships with stay, so the draws depend on the seed alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["without_local_constants"]


@contextmanager
def without_local_constants() -> Iterator[bool]:
    """Hypothesis draws no constants from loaded modules inside the block; yields whether it could be arranged.

    Hypothesis has no setting for this, so its provider's module function is swapped and its
    constants cache cleared on the way in and out (a hypothesis without them yields False).
    """
    from hypothesis.internal.conjecture import providers

    harvest = getattr(providers, "_get_local_constants", None)
    constants = getattr(providers, "Constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if harvest is None or constants is None or cache is None:
        yield False
        return
    empty = constants()
    providers._get_local_constants = lambda: empty
    cache.cache.clear()
    try:
        yield True
    finally:
        providers._get_local_constants = harvest
        cache.cache.clear()
