"""Cache events, entry by entry: key scopes, the token column and the fast entry parser.

Question answered: "are these entries of one batch well formed, and what do they say, as
columns?" The entry half of ``wire.py`` (which documents the wire shape, the token forms and
how parsing is fast, and parses batches and requests; its errors name fields by path). Here:
:class:`KeyScope` (an interned key without its chunk hash), :class:`TokenColumn` (a batch's
token ids as one uint32 buffer), :class:`EntryColumns` and the column-wise entry parser with
its entry-by-entry fallback that names the bad field. Bad values raise the internal
``_Bad`` (a location relative to the entry list), which ``wire.py`` turns into an
``EventValidationError`` with the full path.
"""

from __future__ import annotations

import logging
import sys
from array import array
from itertools import accumulate, chain, repeat
from operator import itemgetter
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from .tokens import (TokenArrays, TokenDecodeError, decode_b64, decode_b64_many, pack_token_lists, packed_token_ids,
                     split_token_arrays)
from .types import UNKNOWN_TOKEN_OFFSET, BlendNamespace, ObjectKey, whole_number, whole_numbers, world_size_of_kv_rank

__all__ = ["INT64_MAX", "KV_RANK_MAX", "MAX_CACHE_SALT_CHARS", "MAX_CHUNK_HASH_BYTES", "EntryColumns", "KeyScope",
           "TokenColumn"]

log = logging.getLogger("blendmatch.index.wire")

#: Longest chunk hash accepted (bytes). LMCache hashes are 8-32 bytes; the cap keeps a
#: hostile key from costing memory in every structure that holds it.
MAX_CHUNK_HASH_BYTES = 128
#: Longest cache salt (characters); salts are tenant tags, not payloads.
MAX_CACHE_SALT_CHARS = 128
_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")
#: Largest packed ``kv_rank`` (a uint32: rank, world size, ... see ``types.pack_kv_rank``).
KV_RANK_MAX = 0xFFFFFFFF
INT64_MAX = (1 << 63) - 1


class _Bad(Exception):
    """Internal: a bad value at ``loc`` relative to the object being parsed (cheap to raise;
    the caller prefixes the path, so the hot loop never formats strings)."""

    def __init__(self, loc: tuple[str | int, ...], reason: str) -> None:
        super().__init__(reason)
        self.loc = loc
        self.reason = reason


class KeyScope(NamedTuple):
    """Everything of an :class:`~blendmatch.index.types.ObjectKey` except its chunk hash.

    One fleet has few scopes (model x rank x object group x salt) and millions of chunks, so
    scopes are interned: every entry of the same scope shares one object, and its namespace
    is computed once. ``ObjectKey(chunk_hash, *scope[:4])`` rebuilds the full key.
    """

    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str
    namespace: BlendNamespace

    def object_key(self, chunk_hash: bytes) -> ObjectKey:
        return ObjectKey(chunk_hash, self.model_name, self.kv_rank, self.object_group_id, self.cache_salt)


class _Interner:
    """Validated, interned names and scopes. Bounded: when full it starts over (interning is
    only a memory saving; nothing compares these objects by identity)."""

    MAX_ITEMS = 1 << 16

    def __init__(self) -> None:
        self.models: dict[str, str] = {}
        self.salts: dict[str, str] = {}
        self.names: dict[str, str] = {}
        self.scopes: dict[tuple, KeyScope] = {}

    def _trim(self, table: dict) -> None:
        if len(table) >= self.MAX_ITEMS:
            table.clear()

    def model(self, value: Any) -> str:
        got = self.models.get(value) if type(value) is str else None
        if got is not None:
            return got
        if type(value) is not str:
            raise _Bad(("model_name",), f"must be a string, got {_type_name(value)}")
        if not value:
            raise _Bad(("model_name",), "must not be empty")
        if "@" in value:
            raise _Bad(("model_name",), f"must not contain '@', got {value!r}")
        self._trim(self.models)
        got = self.models[value] = sys.intern(value)
        return got

    def salt(self, value: Any) -> str:
        got = self.salts.get(value) if type(value) is str else None
        if got is not None:
            return got
        if type(value) is not str:
            raise _Bad(("cache_salt",), f"must be a string, got {_type_name(value)}")
        if len(value) > MAX_CACHE_SALT_CHARS:
            raise _Bad(("cache_salt",), f"must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)}")
        for ch in _SALT_FORBIDDEN:
            if ch in value:
                raise _Bad(("cache_salt",), f"must not contain {ch!r}, got {value!r}")
        self._trim(self.salts)
        got = self.salts[value] = sys.intern(value)
        return got

    def name(self, value: str) -> str:
        got = self.names.get(value)
        if got is None:
            self._trim(self.names)
            got = self.names[value] = sys.intern(value)
        return got

    def scope(self, model: str, kv_rank: int, group: int, salt: str) -> KeyScope:
        raw = (model, kv_rank, group, salt)
        got = self.scopes.get(raw)
        if got is None:
            self._trim(self.scopes)
            ns = BlendNamespace(model, salt, world_size_of_kv_rank(kv_rank))
            got = self.scopes[raw] = KeyScope(model, kv_rank, group, salt, ns)
        return got


_INTERN = _Interner()


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# --------------------------------------------------------------------------- entries


class TokenColumn:
    """The ``token_ids`` of one batch's entries, converted to uint32 in one buffer.

    ``lengths[i]`` is the number of usable tokens of entry ``i`` (0: none, or ids outside
    uint32, see :attr:`unfilled`) and ``starts[i]`` where they begin in :attr:`flat`.
    :attr:`flat` is read-only and shared by the row views: a consumer that keeps a row
    beyond the batch must copy it (or keep the index's copy).
    """

    __slots__ = ("flat", "lengths", "unfilled", "_starts", "_block")

    def __init__(self, flat: np.ndarray, lengths: list[int], unfilled: list[int]) -> None:
        self.flat = flat
        self.lengths = lengths
        self.unfilled = unfilled
        self._starts: Optional[list[int]] = None
        self._block: Optional[np.ndarray] = None
        n = len(lengths)
        if n and lengths[0] and flat.size == n * lengths[0] and lengths.count(lengths[0]) == n:
            self._block = flat.reshape(n, lengths[0])  # every entry has tokens of one length

    @property
    def starts(self) -> list[int]:
        """Where each entry's tokens begin in :attr:`flat` (computed on first use: a batch
        whose entries all have one length never needs it)."""
        if self._starts is None:
            self._starts = list(accumulate(self.lengths, initial=0))[:-1] if self.lengths else []
        return self._starts

    def row(self, i: int) -> Optional[np.ndarray]:
        """Entry ``i``'s tokens as a read-only view, or None when it has none usable."""
        length = self.lengths[i]
        if not length:
            return None
        if self._block is not None:
            return self._block[i]
        start = self.starts[i]
        return self.flat[start:start + length]

    def rows_of_length(self, length: int) -> bool:
        """True when every entry has exactly ``length`` usable tokens."""
        return self._block is not None and self._block.shape[1] == length

    def rows(self, indices: Sequence[int]) -> np.ndarray:
        """A ``(len(indices), L)`` uint32 array of the given entries' rows (all usable, all of
        one length ``L``: the caller checked). ``range(len(self))`` returns the batch's own
        read-only block without copying; anything else a fresh array. Either way it never
        shares memory with the index, so the index may write its rows from it freely."""
        block = self._block
        if block is not None:
            if type(indices) is range and indices == range(block.shape[0]):
                return block
            return block[np.asarray(indices, dtype=np.intp)]
        if not indices:
            return np.zeros((0, 0), dtype=np.uint32)
        return np.stack([self.row(i) for i in indices])


class EntryColumns:
    """The entries of one batch, column by column (what the directory loops over):
    ``chunk_hashes`` (bytes), ``scopes`` (:class:`KeyScope`, interned), ``sizes``,
    ``offsets`` (-1 unknown) and ``tokens`` (:class:`TokenColumn`)."""

    __slots__ = ("chunk_hashes", "scopes", "sizes", "offsets", "tokens", "_distinct")

    def __init__(self, chunk_hashes: list[bytes], scopes: list[KeyScope], sizes: list[int],
                 offsets: list[int], tokens: TokenColumn) -> None:
        self.chunk_hashes = chunk_hashes
        self.scopes = scopes
        self.sizes = sizes
        self.offsets = offsets
        self.tokens = tokens
        self._distinct: Optional[bool] = None

    def __len__(self) -> int:
        return len(self.chunk_hashes)

    @property
    def items(self) -> list[tuple[bytes, KeyScope, int, int]]:
        """``(chunk_hash, scope, size_bytes, token_offset)`` per entry."""
        return list(zip(self.chunk_hashes, self.scopes, self.sizes, self.offsets))

    @property
    def distinct_hashes(self) -> bool:
        """True when no chunk hash occurs twice in the batch (computed once)."""
        if self._distinct is None:
            self._distinct = len(set(self.chunk_hashes)) == len(self.chunk_hashes)
        return self._distinct

    def keys(self) -> list[ObjectKey]:
        """The entries' keys as :class:`ObjectKey` (built on demand; not used on the hot path)."""
        return [scope.object_key(h) for h, scope in zip(self.chunk_hashes, self.scopes)]


_EMPTY_TOKENS = np.zeros(0, dtype=np.uint32)
_EMPTY_TOKENS.setflags(write=False)
_EMPTY_COLUMN = TokenColumn(_EMPTY_TOKENS, [], [])
_NO_TOKENS: list[int] = []
_PACKED_TOKENS = (np.ndarray, bytes, bytearray, memoryview)
# Batch-wide type checks: the set of the types seen must be exactly (or within) these.
_INT_ONLY = {int}
_LIST_ONLY = {list}
_ARRAY_ONLY = {np.ndarray}
_SCOPE_ONLY = {KeyScope}
# Getters of required fields, applied with ``map``: a C loop per column, and no tuple per
# entry (a tuple is a GC-tracked allocation; a thousand live ones trigger a collection that
# walks the caller's freshly decoded request).
_KEY = itemgetter("key")
_CHUNK_HASH_HEX = itemgetter("chunk_hash_hex")
_MODEL_NAME = itemgetter("model_name")
_KV_RANK = itemgetter("kv_rank")
_TOKENS_B64 = itemgetter("tokens_b64")
_HAS_FIELD = dict.__contains__  # ``map(_HAS_FIELD, rows, repeat(name))``: a C loop of ``name in row``
_STR_ONLY = {str}
def _empty_entries() -> EntryColumns:
    return EntryColumns([], [], [], [], _EMPTY_COLUMN)


def _parse_entries(raw: Any, arrays: Optional[TokenArrays] = None) -> EntryColumns:
    """Validate a batch's ``entries`` and convert their tokens.

    This is the ingest hot path, so the common case is checked column by column with C
    loops, never with a Python statement per entry: each field is gathered with one
    ``map(itemgetter(...))`` (a comprehension with the default where an optional field is
    left out); types are checked as the set of a column's types, ranges by ``min``/``max``;
    hex strings must decode to exactly half their length (compared as sums: ``fromhex``
    only ever skips whitespace, so no string is shorter than twice its bytes); and every
    key's scope must be found in a cache keyed by the raw key fields (a hit means that
    model name, rank, group and salt were validated before; ranks and groups are checked to
    be exact ints, as ``True == 1`` and ``1.0 == 1`` hash alike). Tokens are converted by
    :func:`_token_column`. Anything unusual (a missing field, a first-seen scope, a bad
    value, ids outside uint32, token kinds mixed in one batch) sends the batch to
    :func:`_parse_entries_slow`, which validates entry by entry and names the field.
    """
    if type(raw) is not list:
        raise _Bad(("entries",), f"must be a list, got {_type_name(raw)}")
    if not raw:
        return _empty_entries()
    tokens: Optional[TokenColumn] = None
    try:
        keys = list(map(_KEY, raw))
        hexes = list(map(_CHUNK_HASH_HEX, keys))
        kv_ranks = list(map(_KV_RANK, keys))
        groups = _column(keys, "object_group_id", 0)
        # zip hands ``map`` one reused tuple at a time: no tuple per entry is kept
        scopes = list(map(_INTERN.scopes.get, zip(map(_MODEL_NAME, keys), kv_ranks, groups,
                                                  _column(keys, "cache_salt", ""))))
        hashes = list(map(bytes.fromhex, hexes))
        sizes = _column(raw, "size_bytes", 0)
        offsets = _column(raw, "token_offset", UNKNOWN_TOKEN_OFFSET)
        hash_lens = set(map(len, hashes))
        ok = (sum(map(len, hexes)) == 2 * sum(map(len, hashes))
              and 0 < min(hash_lens) and max(hash_lens) <= MAX_CHUNK_HASH_BYTES
              and set(map(type, scopes)) == _SCOPE_ONLY
              and set(map(type, chain(kv_ranks, groups, sizes, offsets))) == _INT_ONLY
              and 0 <= min(sizes) and max(sizes) <= INT64_MAX
              and UNKNOWN_TOKEN_OFFSET <= min(offsets) and max(offsets) <= INT64_MAX)
        if ok:
            if any(map(_HAS_FIELD, raw, repeat("tokens_b64"))):
                tokens = _b64_token_column(raw)
            elif arrays is not None:
                tokens = _split_token_column(_column(raw, "token_ids", _NO_TOKENS), arrays)
            else:
                tokens = _token_column(_column(raw, "token_ids", _NO_TOKENS))
    except Exception:  # noqa: BLE001 - anything unusual: the slow path names the field
        tokens = None
    if tokens is None:
        return _parse_entries_slow(raw, arrays)
    return EntryColumns(hashes, scopes, sizes, offsets, tokens)


def _column(rows: list, name: str, default: Any) -> list:
    """``[row.get(name, default) for row in rows]``, as one C loop when every row has the
    field (the norm: senders fill in optional fields too)."""
    try:
        return list(map(itemgetter(name), rows))
    except KeyError:
        return [row.get(name, default) for row in rows]


def _token_column(token_lists: list[Any]) -> Optional[TokenColumn]:
    """The batch's tokens as one column (``tokens.pack_token_lists``), or None for the
    entry-by-entry path."""
    packed = pack_token_lists(token_lists)
    return None if packed is None else TokenColumn(packed[0], packed[1], [])


def _split_token_column(ids: list, arrays: TokenArrays) -> Optional[TokenColumn]:
    """Fast path of a batch whose ``token_ids`` were taken out of the JSON text
    (``tokens.split_token_arrays``): every entry's value is the ordinal of its ids in
    ``arrays``. Consecutive ordinals (the norm: one array per entry, in order) make the
    column a view of ``arrays.flat`` with no copy; None (the entry-by-entry path) when some
    entry has no ``token_ids``."""
    if set(map(type, ids)) != _INT_ONLY:
        return None
    n = len(ids)
    k0 = ids[0]
    if ids[-1] - k0 == n - 1 and ids == list(range(k0, k0 + n)):
        starts = arrays.starts[k0:k0 + n + 1]
        lo, hi = int(starts[0]), int(starts[-1])
        return TokenColumn(arrays.flat[lo:hi], np.diff(starts).tolist(), [])
    return _token_column([arrays.row(k) for k in ids])  # a key given twice in an entry: the last counts


def _b64_token_column(raw: list) -> Optional[TokenColumn]:
    """Fast path of a batch whose entries all carry their tokens as ``tokens_b64`` (and no
    ``token_ids``, or only empty ones): every string is decoded in one call of the one
    decoder (``tokens.decode_b64_many``) and the arrays take the packed path. None (the
    entry-by-entry path names the problem) for anything else: an entry without
    ``tokens_b64``, a non-string, invalid base64, non-empty ``token_ids`` beside it."""
    strings = list(map(_TOKENS_B64, raw))  # KeyError when some entry lacks it: forms mixed
    if set(map(type, strings)) != _STR_ONLY:
        return None
    if any(map(_HAS_FIELD, raw, repeat("token_ids"))):
        ids = _column(raw, "token_ids", _NO_TOKENS)
        if set(map(type, ids)) != _LIST_ONLY or any(ids):  # both forms given, or a bad token_ids
            return None
    decoded = decode_b64_many(strings)
    if set(map(type, decoded)) != _ARRAY_ONLY:  # some string is bad: the slow path names it
        return None
    return _token_column(decoded)


def _parse_entries_slow(raw: list, arrays: Optional[TokenArrays] = None) -> EntryColumns:
    """Entry by entry, with full validation; ``_Bad`` locations are batch-relative."""
    hashes: list[bytes] = []
    scopes: list[KeyScope] = []
    sizes: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    unfilled: list[int] = []
    buf = array("I")
    i = 0
    try:
        for i, entry in enumerate(raw):
            h, scope, size, offset, tokens = _parse_entry(entry, arrays)
            hashes.append(h)
            scopes.append(scope)
            sizes.append(size)
            offsets.append(offset)
            if type(tokens) is list:
                try:
                    buf.fromlist(tokens)
                    lengths.append(len(tokens))
                    continue
                except (OverflowError, TypeError):
                    whole = whole_numbers(tokens)  # integral floats are ids, as in LMCache
                    if whole is not tokens:
                        try:
                            buf.fromlist(whole)
                            lengths.append(len(whole))
                            continue
                        except (OverflowError, TypeError):
                            pass
                    _check_token_types(whole, ("token_ids",))  # raises for non-integers
            else:
                try:
                    packed = packed_token_ids(tokens)
                except TokenDecodeError as exc:
                    raise _Bad(("token_ids",), exc.reason) from None
                if packed is not None:
                    buf.frombytes(np.ascontiguousarray(packed).view(np.uint8))
                    lengths.append(len(packed))
                    continue
            unfilled.append(i)
            lengths.append(0)
    except _Bad as bad:
        raise _Bad(("entries", i) + bad.loc, bad.reason) from None
    flat = np.frombuffer(buf, dtype=np.uint32) if len(buf) else _EMPTY_TOKENS
    flat.setflags(write=False)
    return EntryColumns(hashes, scopes, sizes, offsets, TokenColumn(flat, lengths, unfilled))


def _check_token_types(tokens: list[Any], loc: tuple) -> None:
    """Slow path: every token id must be an integer (any size; range is checked elsewhere)."""
    for k, value in enumerate(tokens):
        if not isinstance(value, int):
            raise _Bad(loc + (k,), f"token ids must be integers, got {_type_name(value)} {value!r}")


def _parse_entry(entry: Any, arrays: Optional[TokenArrays] = None) -> tuple[bytes, KeyScope, int, int, Any]:
    """One entry, fully validated -> ``(chunk_hash, scope, size_bytes, token_offset,
    token_ids)`` (``token_ids`` as given: a list, or packed, see ``tokens.packed_token_ids``;
    or a non-empty ``tokens_b64`` decoded to bytes of little-endian uint32); raises ``_Bad`` (entry-relative location) naming the bad field."""
    if type(entry) is not dict:
        raise _Bad((), f"must be an object, got {_type_name(entry)}")
    key = entry.get("key")
    if type(key) is not dict:
        raise _Bad(("key",), "is required" if key is None else f"must be an object, got {_type_name(key)}")
    try:
        chunk_hash = _parse_hash(key.get("chunk_hash_hex"))
        model = _INTERN.model(key.get("model_name"))
        kv_rank = whole_number(key.get("kv_rank"))
        if type(kv_rank) is not int or not 0 <= kv_rank <= KV_RANK_MAX:
            raise _Bad(("kv_rank",), _int_reason(kv_rank, 0, KV_RANK_MAX))
        group = whole_number(key.get("object_group_id", 0))
        if type(group) is not int or not 0 <= group <= INT64_MAX:
            raise _Bad(("object_group_id",), _int_reason(group, 0, INT64_MAX))
        salt = _INTERN.salt(key.get("cache_salt", ""))
    except _Bad as bad:
        raise _Bad(("key",) + bad.loc, bad.reason) from None
    size = whole_number(entry.get("size_bytes", 0))
    if type(size) is not int or not 0 <= size <= INT64_MAX:
        raise _Bad(("size_bytes",), _int_reason(size, 0, INT64_MAX))
    offset = whole_number(entry.get("token_offset", UNKNOWN_TOKEN_OFFSET))
    if type(offset) is not int or not UNKNOWN_TOKEN_OFFSET <= offset <= INT64_MAX:
        raise _Bad(("token_offset",), _int_reason(offset, UNKNOWN_TOKEN_OFFSET, INT64_MAX))
    tokens = entry.get("token_ids", _NO_TOKENS)
    if arrays is not None and type(tokens) is int:  # split out of the JSON text: its ordinal
        tokens = arrays.row(tokens)
    if type(tokens) is not list and not isinstance(tokens, _PACKED_TOKENS):
        raise _Bad(("token_ids",), f"must be a list of integers, got {_type_name(tokens)}")
    b64 = entry.get("tokens_b64")
    if b64 is not None:  # null: not given (as in the schema model)
        if type(b64) is str and b64 and len(tokens):
            raise _Bad(("tokens_b64",), "give token_ids or tokens_b64, not both")
        decoded = _decode_tokens_b64(b64)
        if decoded.size:
            tokens = decoded
    return chunk_hash, _INTERN.scope(model, kv_rank, group, salt), size, offset, tokens


def _decode_tokens_b64(value: Any) -> np.ndarray:
    """Slow path: one entry's ``tokens_b64`` -> uint32 ids; raises ``_Bad`` naming
    ``tokens_b64`` with the reason (the one decoder: ``tokens.decode_b64``)."""
    try:
        return decode_b64(value)
    except TokenDecodeError as exc:
        raise _Bad(("tokens_b64",), exc.reason) from None


def _parse_hash(value: Any) -> bytes:
    if type(value) is not str:
        reason = "is required" if value is None else f"must be a hex string, got {_type_name(value)}"
        raise _Bad(("chunk_hash_hex",), reason)
    n = len(value)
    if n == 0 or n & 1 or n > 2 * MAX_CHUNK_HASH_BYTES:
        raise _Bad(("chunk_hash_hex",), f"must be 2..{2 * MAX_CHUNK_HASH_BYTES} hex digits of even length, got {n}")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise _Bad(("chunk_hash_hex",), f"must be hexadecimal, got {value[:80]!r}") from None
    if 2 * len(raw) != n:  # fromhex skips whitespace between bytes
        raise _Bad(("chunk_hash_hex",), f"must be hexadecimal without spaces, got {value[:80]!r}")
    return raw


def _int_reason(value: Any, lo: int, hi: int) -> str:
    if value is None:
        return "is required"
    if type(value) is not int:
        return f"must be an integer, got {_type_name(value)}"
    return f"must be in {lo}..{hi}, got {value}"
