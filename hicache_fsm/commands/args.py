"""What every subcommand shares: argument types that refuse impossible values, and the usage error.

Ranges are checked by argparse (``type=positive_int``, ``bounded_int(1, N)``), so a
bad value is a usage error (exit status 2, one line) before the command starts;
``UsageError`` is for what a type cannot see (an adapter that does not import, a
missing input file, a count whose memory depends on other options: ``check_fits``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from typing import NoReturn


class UsageError(Exception):
    """The command line names something that cannot be used; ``cli.main`` exits 2 with the message."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (then exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


GIVEN = "options_given"  # the namespace attribute ``Given`` notes its options in


class Given(argparse.Action):
    """Stores the value, as argparse's default action, and notes that the option was on the command line.

    A check that an option is out of place (a trace option without
    ``--trace``) must not compare the value with the default: an option
    written at its default value is given all the same (``was_given``).
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        noted = getattr(namespace, GIVEN, None)
        if noted is None:
            noted = set()
            setattr(namespace, GIVEN, noted)
        noted.add(self.dest)


def was_given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the option stored in ``dest`` (with ``action=Given``) was on the command line."""
    return dest in getattr(args, GIVEN, ())


MAX_SHOWN = 40  # characters of a refused value an error repeats
MAX_DIGITS = 400  # longer integers are refused unread (int() refuses past 4,300 digits; no count is near)


def _int_within(minimum: int | None, maximum: int | None, what: str):
    def check(text: str) -> int:
        shown = text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"
        digits = text.strip().lstrip("+-").replace("_", "")
        if digits.isdigit() and len(digits) > MAX_DIGITS:  # int() would refuse it as "not an integer"
            raise argparse.ArgumentTypeError(f"{shown} is an integer of {len(digits)} digits, far past any bound")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown!r} is not an integer") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"{minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"{shown} is not {what} (must be {bound})")
        return value

    check.__name__ = what.replace(" ", "_")  # argparse names the type in its messages
    return check


int_arg = _int_within(None, None, "an integer")  # any int; the option's range is checked where it is used
positive_int = _int_within(1, None, "a positive integer")
non_negative_int = _int_within(0, None, "a non-negative integer")


def bounded_int(minimum: int, maximum: int):
    """An argparse type for integers in ``minimum..maximum``: a value past what the code can size (a deque length,
    a C long, a thread count) is a usage error naming the bound, not an OverflowError later."""
    return _int_within(minimum, maximum, "in range")


MAX_SEED = 2**63 - 1
seed_int = bounded_int(-MAX_SEED - 1, MAX_SEED)  # torch's generators take a 64-bit seed


def check_fits(value: int, bytes_each: int, what: str, detail: str = "") -> int:
    """``value`` itself, or ``UsageError`` when ``value`` items of ``bytes_each`` bytes would not fit in memory.

    Checked before the work, so a huge count is one line naming the limit, not a traceback or a machine
    swapping until it dies; ``detail`` says what each item holds.
    """
    from hicache_fsm.input_limits import InputRefused, check_count  # numpy: not for the spec commands

    try:
        check_count(value, bytes_each, what)
    except InputRefused as exc:
        raise UsageError(f"{exc} ({detail})" if detail else str(exc)) from None
    return value


def path_arg(text: str) -> str:
    """A file or directory option's value: an empty one would turn the option off without a word."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text


def output_path(text: str) -> str:
    """A file an option writes: refused before any work when it could not be created there (a usage error,
    not a failure after a long run, or none at all when the run found nothing to write)."""
    path = path_arg(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"no directory {parent}")
    return path


def storage_url(text: str) -> str:
    """An L3 storage URL whose form can name a backend (``storage.urls.check_url``): a mistyped one is refused before
    any work; a server that does not answer is found when the run attaches it (a runtime error)."""
    from hicache_fsm.errors import StorageURLError
    from hicache_fsm.storage.urls import check_url  # not the package: it imports the backends' base (torch)

    try:
        check_url(text)
    except StorageURLError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number")
    return value


def adapter_ref(text: str) -> str:
    """``MODULE:CALLABLE`` or ``FILE.py:CALLABLE`` (only the form; ``load_factory`` resolves it)."""
    where, sep, attr = text.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise argparse.ArgumentTypeError(f"wants MODULE:CALLABLE or FILE.py:CALLABLE, got {text!r}")
    return text


MAX_VARIANT_CHARS = 64 * 1024
MAX_VARIANT_DEPTH = 32


def cache_option(text: str) -> tuple[str, int | None]:
    """``--cache-option NAME=VALUE``: a ``CacheConfig`` field and an int (or ``none``), checked by ``Bounds``."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError("NAME=VALUE, e.g. eviction_headroom_tokens=1")
    value = value.strip()
    if value.lower() == "none":
        return name.strip(), None
    try:
        return name.strip(), int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name.strip()}: {value!r} is not an int or none") from None


def json_kwargs(text: str) -> dict:
    """``--variant JSON``: a JSON object of keyword arguments for an adapter factory (bounded in size and depth)."""
    if len(text) > MAX_VARIANT_CHARS:
        raise argparse.ArgumentTypeError(f"longer than {MAX_VARIANT_CHARS} characters")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"nested deeper than {MAX_VARIANT_DEPTH} levels") from None
    except ValueError as exc:  # a number past what Python reads, NaN or an infinity (refused below)
        raise argparse.ArgumentTypeError(f"not a plain JSON value: {str(exc)[:120]}") from None
    if _depth(value) > MAX_VARIANT_DEPTH:
        raise argparse.ArgumentTypeError(f"nested deeper than {MAX_VARIANT_DEPTH} levels")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object of keyword arguments, e.g. '{\"bug\": \"capacity\"}'")
    return value


def _no_constant(name: str) -> float:
    """NaN and the infinities are not JSON: a regression test written with them would not run."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:40]} is past the largest float")
    return value


def _depth(value: object) -> int:
    """How deeply a parsed JSON value nests (iteratively: no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
    return deepest


# Control characters (ESC starts terminal sequences) and the bidirectional overrides that reorder what a terminal
# shows: a trace or spec file is untrusted, and its strings reach the terminal in reports and error lines.
_TERMINAL_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate from a JSON ``"\\ud800"``) and what a terminal
    would act on (control characters other than newline and tab, bidirectional overrides) as backslash escapes.

    stdout is strict UTF-8: printing such text raised UnicodeEncodeError midway through a report; an ESC in a
    trace's state name could recolour or rewrite the terminal the report is read on.
    """
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _TERMINAL_UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


INTERRUPTED = 130  # 128 + SIGINT, as shells report it


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM noted while the block runs (a command's imports: torch, numpy), raised after it.

    An interrupt raised inside numpy's import (nested in torch's) is swallowed
    there and leaves numpy half-initialised: the run then went on, or failed
    later with a confusing traceback. Noted, it is raised as KeyboardInterrupt
    once the imports are done, where the command line turns it into status 130.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM ends a search like Ctrl-C (its partial result is printed) while the block is running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
