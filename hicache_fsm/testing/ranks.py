"""Run a function on N real rank processes joined by a gloo group over 127.0.0.1.

``run_ranks(fn, world, *args)`` spawns ``world`` processes (torch
multiprocessing, ``spawn``), joins them in a gloo process group on a random
free port of 127.0.0.1, calls ``fn(rank, world, group, *args)`` in each and
returns one ``RankOutcome`` per rank: its return value, the error it raised
(type name, message, traceback text) or its exit code if it died without
answering. ``fn`` and its arguments must be picklable (a module-level
function). Start the group once and run many steps inside ``fn``: a process
start costs seconds (it imports torch).
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable

import attrs

from hicache_fsm.config import check_positive_int, check_seconds
from hicache_fsm.errors import ConfigError
from hicache_fsm.tp import MAX_RANKS

__all__ = ["RankOutcome", "free_port", "run_ranks"]


@attrs.frozen
class RankOutcome:
    """How one rank ended: ``ok`` with ``value``, or ``error`` (type name + message), or ``died``."""

    rank: int
    status: str  # "ok" | "error" | "died"
    value: Any = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    exitcode: int | None = None

    def unwrap(self) -> Any:
        """The value, or an AssertionError carrying the rank's traceback."""
        if self.status != "ok":
            raise AssertionError(f"rank {self.rank} {self.status}: {self.error_type}: {self.error}\n{self.traceback}")
        return self.value


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, group_timeout_s: float, fn: Callable, args: tuple, out, released,
           release_wait_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=group_timeout_s))
        value = fn(rank, world, dist.group.WORLD, *args)
        out.put((rank, "ok", value, "", "", ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put((rank, "error", None, type(exc).__name__, str(exc)[:2000], traceback.format_exc()[-6000:]))
    finally:
        out.close()
        out.join_thread()
        # Rank 0 hosts the store every process group is made through: returning early, it must not take it away
        # from ranks still making groups (on a busy machine they lag), so it stays until the parent has each
        # answer (or gave up), waiting on the parent, not on a time. Another rank that returns leaves, as a
        # rank that stops would: its peers see it gone.
        if rank == 0:
            released.wait(release_wait_s)
        os._exit(0)  # skip process-group teardown, which can wait on a dead peer


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 300.0,
              group_timeout_s: float = 30.0) -> list[RankOutcome]:
    """Run ``fn(rank, world, group, *args)`` on ``world`` processes; one outcome per rank, by rank.

    ``world`` (1 .. ``MAX_RANKS``), the timeouts (seconds > 0) and ``fn`` are checked before any process
    starts: ``ConfigError``.
    """
    check_positive_int("world", world)
    if world > MAX_RANKS:
        raise ConfigError(f"world must be at most {MAX_RANKS} rank processes, got {world}")
    check_seconds("timeout_s", timeout_s)
    check_seconds("group_timeout_s", group_timeout_s)
    if not callable(fn):
        raise ConfigError(f"fn must be a module-level function, got {fn!r}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    released = ctx.Event()  # set once every rank answered: until then rank 0 (the store's host) keeps its process
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, group_timeout_s, fn, args, out, released, timeout_s),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    answers: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(answers) < world and time.monotonic() < deadline:
            try:
                item = out.get(timeout=0.2)
            except queue_mod.Empty:
                if all(r in answers or not p.is_alive() for r, p in enumerate(procs)):  # the rest died
                    try:  # a last answer may still be in the pipe
                        item = out.get(timeout=0.5)
                    except queue_mod.Empty:
                        break
                else:
                    continue
            answers[item[0]] = item
    finally:
        released.set()
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    outcomes = []
    for r, p in enumerate(procs):
        if r in answers:
            _, status, value, etype, msg, tb = answers[r]
            outcomes.append(RankOutcome(r, status, value, etype, msg, tb, p.exitcode))
        else:
            outcomes.append(RankOutcome(r, "died", exitcode=p.exitcode))
    return outcomes
