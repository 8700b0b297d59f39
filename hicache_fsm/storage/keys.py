"""Storage keys: one chained SHA-256 per full page, namespaced per model/tenant/rank.

A page's hash covers the previous page's hash (its 32 raw bytes, decoded from
hex) followed by every token id of the page as a 4-byte little-endian unsigned
integer. The first page of a sequence has no prior. Because each hash folds in
its parent, a hash names the whole prefix up to and including its page, so
"how many keys exist in a row from the start" answers "how long a prefix is
stored". The byte layout matches SGLang's ``get_hash_str``, so keys computed
here and there agree.

Only full pages get keys: hashing a partial tail would give the same prefix a
different key depending on where the sequence was cut.

:class:`KeyNamespace` turns a page hash into the key a backend stores under::

    {model}/{tenant or _}/{tp_rank}of{tp_size}/{page_hash}   (MHA: one copy per rank)
    {model}/{tenant or _}/mla/{page_hash}                     (MLA: one shared copy)

Model and tenant names are validated so a key can never climb out of a
directory, glob-match a neighbour, or collide with another tenant's key.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Iterable, Iterator, Sequence, overload

import attrs

from hicache_fsm.errors import BadTokenIds, StorageKeyError
from hicache_fsm.tokens import ID_BYTES, TokenIds, token_id_bytes

__all__ = [
    "HASH_HEX_LEN",
    "MAX_NAME_LEN",
    "MAX_PAGE_KEY_LEN",
    "KeyNamespace",
    "PageKeyChain",
    "check_page_size",
    "page_hash",
    "page_keys",
    "validate_page_key",
    "validate_page_keys",
]

HASH_HEX_LEN = 64
MAX_NAME_LEN = 128
MAX_PAGE_KEY_LEN = 256
_NO_TENANT = "_"
_MLA_PART = "mla"

# Printable ASCII without whitespace, '/', '\\' or glob metacharacters.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:@+=,~%#!$&()\-]+$")
_PAGE_KEY_RE = re.compile(r"^[A-Za-z0-9_.:@+=,~%#!$&()\-]+$")
_HEX_RE = re.compile(r"^[0-9a-fA-F]{64}$")
# the bytes _PAGE_KEY_RE allows: deleting them from an ASCII key leaves nothing (bytes.translate, in C)
_PAGE_KEY_BYTES = bytes(c for c in range(128) if _PAGE_KEY_RE.match(chr(c)))


def key_token_bytes(tokens: Sequence[int] | TokenIds) -> bytes:
    """``tokens`` checked and packed for hashing (a ``TokenIds`` as it is); a bad id is a ``StorageKeyError``."""
    try:
        return token_id_bytes(tokens)  # the one definition of a valid token id, packed little-endian
    except BadTokenIds as exc:
        raise StorageKeyError(str(exc)) from None


def _prior_bytes(prior: str | None) -> bytes:
    if prior is None or prior == "":
        return b""
    if not isinstance(prior, str) or not _HEX_RE.fullmatch(prior):
        raise StorageKeyError(f"prior page hash must be {HASH_HEX_LEN} hex digits, got {prior!r}")
    return bytes.fromhex(prior)


def page_hash(tokens: Sequence[int], prior: str | None = None) -> str:
    """SHA-256 hex digest of one page of ``tokens`` chained onto ``prior`` (None: first page)."""
    hasher = hashlib.sha256()
    hasher.update(_prior_bytes(prior))
    hasher.update(key_token_bytes(tokens))
    return hasher.hexdigest()


def check_page_size(page_size: object) -> int:
    """``page_size`` if it is an int >= 1 (a key covers one whole page)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise StorageKeyError(f"page_size must be a positive int, got {page_size!r}")
    return page_size


def page_keys(tokens: Sequence[int] | TokenIds, page_size: int, prior: str | None = None) -> list[str]:
    """Chained page hashes of every full page of ``tokens``; a partial tail page gets none.

    A ``TokenIds`` (what the cache and its tree hold) is hashed from its packed
    bytes as they are: the same bytes the tree compares, nothing converted.
    """
    check_page_size(page_size)
    raw = memoryview(key_token_bytes(tokens))
    keys: list[str] = []
    _chain_into(keys, raw, page_size, 0, len(raw) // (ID_BYTES * page_size), _prior_bytes(prior))
    return keys


def page_digests(raw: bytes | memoryview, page_size: int, prior: bytes, first: int = 0,
                 stop: int | None = None) -> list[bytes]:
    """Chained SHA-256 digests of full pages ``first..stop-1`` of packed little-endian uint32 ids, onto ``prior``.

    The one chain every tier key and KV event block hash comes from: each page's
    digest is ``sha256(previous digest + the page's bytes)``, hashed in place.
    """
    stride = ID_BYTES * page_size
    if stop is None:
        stop = len(raw) // stride
    pages = bytes(raw[first * stride : stop * stride])  # slicing bytes beats making a memoryview per page
    sha256 = hashlib.sha256
    out: list[bytes] = []
    append = out.append
    for start in range(0, len(pages), stride):
        prior = sha256(prior + pages[start : start + stride]).digest()  # one call: measured faster than update()
        append(prior)
    return out


def _chain_into(keys: list[str], raw: memoryview, page_size: int, first: int, stop: int, chained: bytes) -> bytes:
    """Append the keys of pages ``first..stop-1`` of ``raw`` chained onto ``chained``; the last digest."""
    digests = page_digests(raw, page_size, chained, first, stop)
    keys.extend([d.hex() for d in digests])
    return digests[-1] if digests else chained


class PageKeyChain(Sequence[str]):
    """``page_keys(tokens, page_size, prior)`` as a sequence whose keys are hashed when first read.

    A prefetch names every page beyond the in-memory hit, but its hit query
    stops at the first page storage lacks, so most keys of a long miss are
    never read. Reading key ``i`` hashes the pages up to ``i`` (the chain is
    sequential) at least ``chunk`` pages at a time; the keys are exactly
    ``page_keys``'s. Safe to read from several threads.
    """

    __slots__ = ("_raw", "_stride", "_len", "_keys", "_prior", "_chained", "_chunk", "_lock")

    def __init__(self, tokens: Sequence[int] | TokenIds, page_size: int, prior: str | None = None,
                 chunk: int = 64) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise StorageKeyError(f"page_size must be a positive int, got {page_size!r}")
        self._raw = memoryview(key_token_bytes(tokens))
        self._stride = ID_BYTES * page_size
        self._len = len(self._raw) // self._stride
        self._chained = _prior_bytes(prior)
        self._prior = prior or None
        self._keys: list[str] = []
        self._chunk = max(1, chunk)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def _upto(self, stop: int) -> list[str]:
        """The keys list, holding at least the first ``stop`` keys (``stop`` <= len)."""
        keys = self._keys
        if len(keys) < stop:
            with self._lock:
                have = len(keys)
                if have < stop:
                    end = min(self._len, max(stop, have + self._chunk))
                    self._chained = _chain_into(keys, self._raw, self._stride // ID_BYTES, have, end, self._chained)
        return keys

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            return tuple(self._upto(max(start, stop))[start:stop:step]) if start < stop or step < 0 else ()
        i = index + self._len if index < 0 else index
        if not 0 <= i < self._len:
            raise IndexError("page key index out of range")
        return self._upto(i + 1)[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._upto(self._len))

    def keys_following(self, prior: str | None, tokens: TokenIds) -> tuple[str, ...] | None:
        """``page_keys(tokens, page_size, prior)`` when this chain covers those pages after ``prior``, else None.

        The pages a prefetch asked for and did not get are the ones its
        request then computes and inserts; their backup reuses the keys the
        hit query already hashed (equal bytes on an equal chain give equal keys).
        """
        raw = tokens.raw
        stride = self._stride
        if not raw or len(raw) % stride:
            return None
        if prior == self._prior:
            pos = 0
        else:
            try:
                pos = self._keys.index(prior) + 1
            except ValueError:
                return None
        start = pos * stride
        if start + len(raw) > len(self._raw) or self._raw[start : start + len(raw)] != raw:
            return None
        stop = pos + len(raw) // stride
        return tuple(self._upto(stop)[pos:stop])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PageKeyChain):
            return tuple(self) == tuple(other)
        return isinstance(other, tuple) and tuple(self) == other

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PageKeyChain({self._len} pages, {len(self._keys)} hashed)"


def _check_name(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise StorageKeyError(f"{kind} must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_NAME_LEN:
        raise StorageKeyError(f"{kind} must have 1..{MAX_NAME_LEN} characters, got {len(value)}")
    if not _NAME_RE.fullmatch(value):
        raise StorageKeyError(
            f"{kind} {value!r} may only hold printable ASCII without whitespace, '/', '\\' "
            "or glob characters (replace '/' in model ids with '--')"
        )
    if ".." in value or value.startswith("."):
        raise StorageKeyError(f"{kind} {value!r} may not start with '.' or contain '..'")
    return value


def validate_page_key(key: object) -> str:
    """Check one page-level key (normally a page hash); returns it unchanged."""
    if not isinstance(key, str):
        raise StorageKeyError(f"storage keys must be str, got {type(key).__name__}: {key!r}")
    if not 1 <= len(key) <= MAX_PAGE_KEY_LEN or not _PAGE_KEY_RE.fullmatch(key):
        raise StorageKeyError(
            f"storage key {key!r} must be 1..{MAX_PAGE_KEY_LEN} printable ASCII characters "
            "without whitespace, '/', '\\' or glob characters"
        )
    return key


def validate_page_keys(keys: Iterable[str]) -> list[str]:
    """Check many page-level keys (``validate_page_key``'s rule) in one pass over all; a list of them unchanged."""
    checked = list(keys)
    if checked and not _all_valid(checked):
        for key in checked:
            validate_page_key(key)
    return checked


def _all_valid(hashes: list) -> bool:
    """Whether every one of ``hashes`` is a valid page key (validate_page_key's rule), checked in C over all."""
    try:
        joined = "".join(hashes)
    except TypeError:  # a key that is not a str: validate_page_key names it
        return False
    if not joined.isascii() or joined.encode("ascii").translate(None, _PAGE_KEY_BYTES):
        return False
    lengths = set(map(len, hashes))  # keys of one hash share a length: a set of one
    return min(lengths) > 0 and max(lengths) <= MAX_PAGE_KEY_LEN


def _check_rank(instance: "KeyNamespace", attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise StorageKeyError(f"{attribute.name} must be an int, got {value!r}")


@attrs.frozen
class KeyNamespace:
    """Where one model's pages live for one tenant and one tensor-parallel rank.

    Two namespaces produce equal keys only if every field that reaches the key
    is equal: different tenants, models or (for non-MLA models) ranks never
    share a key. MLA models keep one copy for all ranks.
    """

    model: str
    tp_rank: int = attrs.field(default=0, validator=_check_rank)
    tp_size: int = attrs.field(default=1, validator=_check_rank)
    is_mla: bool = False
    tenant: str | None = None

    def __attrs_post_init__(self) -> None:
        _check_name("model", self.model)
        if self.tenant is not None:
            _check_name("tenant", self.tenant)
            if self.tenant == _NO_TENANT:
                raise StorageKeyError(f"tenant {_NO_TENANT!r} is reserved for 'no tenant'")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise StorageKeyError(f"need 0 <= tp_rank < tp_size, got {self.tp_rank} of {self.tp_size}")
        if not isinstance(self.is_mla, bool):
            raise StorageKeyError(f"is_mla must be a bool, got {self.is_mla!r}")

    @property
    def prefix(self) -> str:
        """The common start of every key in this namespace, ending in '/'."""
        tenant = self.tenant if self.tenant is not None else _NO_TENANT
        part = _MLA_PART if self.is_mla else f"{self.tp_rank}of{self.tp_size}"
        return f"{self.model}/{tenant}/{part}/"

    def storage_key(self, page_hash: str) -> str:
        """The backend key of one page-level key (normally a page hash)."""
        return self.prefix + validate_page_key(page_hash)

    def storage_keys(self, page_hashes: Iterable[str]) -> list[str]:
        """The backend keys of many page keys: checked together in one regex pass, one by one only on a refusal."""
        prefix = self.prefix
        return [prefix + h for h in validate_page_keys(page_hashes)]

    def owns(self, storage_key: str) -> bool:
        """Whether ``storage_key`` was produced by this namespace."""
        return storage_key.startswith(self.prefix) and "/" not in storage_key[len(self.prefix) :]
