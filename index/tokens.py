"""Every token rule, in one place: what a token id is, how each wire form decodes, the limit.

Question answered: "do these values become uint32 token ids, and if not, what exactly is
wrong?" Events (``wire.py``), lookups (the service) and the index (``blend_index.py``) all
call this module; nothing else decodes tokens.

- **A token id** is an integer in ``0..2^32-1`` (:data:`MAX_TOKEN_ID`), stored as uint32.
  ``true``/``false``, floats, strings, negative ids and ids >= 2^32 are not token ids.
- **In-process arrays** (:func:`as_tokens`): integer numpy arrays and lists convert
  losslessly or raise; a uint32 array is returned as is (no copy).
- **``token_ids``** (:func:`decode_token_ids`): a JSON list of integers (or a 1-D integer
  array from an in-process caller) -> a read-only uint32 array.
- **``tokens_b64``** (:func:`decode_b64_many`, :func:`decode_b64`): standard base64
  (RFC 4648 section 4 alphabet ``A-Z a-z 0-9 + /``, padded with ``=`` to a multiple of 4
  characters) of the ids as little-endian uint32. Decoded strictly: a character outside the
  alphabet (whitespace and the URL-safe ``-_`` included), a length that is not a multiple
  of 4, ``=`` anywhere but the last one or two positions, or a decoded byte length that is
  not a multiple of 4 is an error, never silently skipped. Unused low bits of the last
  quantum are ignored, as RFC 4648 permits. 5.3 bytes per token. The decoder is
  ``pybase64``'s SIMD one (16x the numba kernel it replaced, ``bench/b64.py``); the
  service runs it on the lookup thread, the event parser once per batch.
- **The limit**: :data:`DEFAULT_MAX_REQUEST_TOKENS` tokens per request unless configured;
  :func:`check_token_count` raises :class:`TokenLimitExceeded` (the service's 413).
- **``token_ids`` straight from the JSON text** (:func:`split_token_arrays`): the arrays of
  every ``"token_ids"`` key of a raw body parsed into one uint32 buffer, no Python int per
  token; the body's remaining text is then parsed by an ordinary JSON parser. Exact: the
  split happens only when every such array is a plain list of decimal ids in range, anything
  else (a float, a sign, ``true``, an escape anywhere in the body) leaves the body to the
  ordinary parser and the rules above.

Errors: :class:`TokenDecodeError` (a ``ValueError``) with ``field`` (``tokens_b64``,
``token_ids``, ...) and ``reason``; its message starts with the field name, so a 422 says
which field is wrong. Returned arrays are read-only; callers must not mutate them.
Imports: numpy only at module level, so the client can encode without loading numba.
"""

from __future__ import annotations

import base64
import binascii
from array import array
from itertools import accumulate
from operator import attrgetter
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pybase64

__all__ = [
    "split_b64_value",
    "B64_TOKENS_PATTERN",
    "DEFAULT_MAX_REQUEST_TOKENS",
    "MAX_TOKEN_ID",
    "TokenDecodeError",
    "TokenLimitExceeded",
    "as_token_rows",
    "as_tokens",
    "b64_token_count",
    "check_one_form",
    "check_token_count",
    "decode_b64",
    "decode_b64_many",
    "decode_query_tokens",
    "is_b64_source",
    "decode_token_ids",
    "decode_tokens",
    "encode_tokens",
    "pack_token_lists",
    "packed_token_ids",
    "TokenArrays",
    "split_token_arrays",
]

#: Largest valid token id (ids are uint32 on the wire and in the index).
MAX_TOKEN_ID = 0xFFFFFFFF
#: Tokens one request may carry unless the service is configured otherwise (LMCache's
#: coordinator caps ``/directory/lookup`` at the same 1,000,000).
DEFAULT_MAX_REQUEST_TOKENS = 1_000_000


class TokenDecodeError(ValueError):
    """Values do not become uint32 token ids; ``field`` names where, ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


class TokenLimitExceeded(TokenDecodeError):
    """A request carries more tokens than its limit allows (the service answers 413)."""


def check_token_count(n: int, limit: int = DEFAULT_MAX_REQUEST_TOKENS, field: str = "tokens") -> None:
    """Raise :class:`TokenLimitExceeded` when ``n`` tokens are over ``limit``."""
    if n > limit:
        raise TokenLimitExceeded(field, f"request carries {n} tokens, over the limit of {limit} tokens per request")


def _range_reason(value: int, pos: int | None = None) -> str:
    where = f"item {pos}: " if pos is not None else ""
    return f"{where}ids must lie in 0..{MAX_TOKEN_ID} (>= 0 and < 2^32), got {value}"


def as_tokens(tokens: Any, *, name: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a 1-D C-contiguous uint32 array, or raise :class:`TokenDecodeError`.

    Lossless conversions only: integer arrays/lists whose values all lie in 0..2^32-1 are
    converted; floats, bools, negative values or values >= 2^32 are rejected with a message
    that names the problem. A uint32 array is returned as is (no copy).
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.asarray(tokens)
        except (OverflowError, ValueError) as exc:  # ragged or huge Python ints
            raise TokenDecodeError(name, f"not a 1-D sequence of token ids ({exc})") from None
        if arr.size == 0:
            arr = arr.astype(np.uint32)
    if arr.ndim != 1:
        raise TokenDecodeError(name, f"must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.uint32:
        return np.ascontiguousarray(arr)
    if arr.dtype == object:
        # Python ints too large for int64 land here.
        try:
            if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in arr):
                raise TokenDecodeError(name, "must hold integers, got non-integer values")
            lo, hi = min(arr, default=0), max(arr, default=0)
        except TypeError:
            raise TokenDecodeError(name, "must hold integers") from None
        _check_range(int(lo), int(hi), name)
        return np.asarray([int(v) for v in arr], dtype=np.uint32)
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise TokenDecodeError(name, f"must be an integer array of token ids, got dtype {arr.dtype}")
    if arr.size:
        _check_range(int(arr.min()), int(arr.max()), name)
    return np.ascontiguousarray(arr, dtype=np.uint32)


def as_token_rows(tokens2d: Any, *, name: str = "tokens") -> np.ndarray:
    """A 2-D ``(n, chunk_size)`` stack of token ids as a C-contiguous uint32 array (the bulk
    form of :func:`as_tokens`; same rules, same error)."""
    arr = np.asarray(tokens2d)
    if arr.ndim != 2:
        raise TokenDecodeError(name, f"must be a 2-D (n, chunk_size) array, got shape {arr.shape}")
    if arr.dtype == np.uint32:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise TokenDecodeError(name, f"must be integer token ids, got dtype {arr.dtype}")
    if arr.size:
        _check_range(int(arr.min()), int(arr.max()), name)
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _check_range(lo: int, hi: int, name: str) -> None:
    if lo < 0:
        raise TokenDecodeError(name, _range_reason(lo))
    if hi > MAX_TOKEN_ID:
        raise TokenDecodeError(name, _range_reason(hi))


def check_one_form(tokens_b64: Any, token_ids: Any) -> None:
    """A query gives its tokens in exactly one form (``None`` means not given); raises
    :class:`TokenDecodeError` naming both fields otherwise. The lookup schema calls this."""
    if (tokens_b64 is None) == (token_ids is None):
        which = "both were given" if tokens_b64 is not None else "neither was given"
        raise TokenDecodeError("tokens_b64/token_ids", f"give exactly one of the two token forms; {which}")


def decode_tokens(tokens_b64: str | None = None, token_ids: Sequence[int] | None = None) -> np.ndarray:
    """Decode exactly one of ``tokens_b64`` / ``token_ids`` to a read-only 1-D uint32 array.

    Raises :class:`TokenDecodeError` naming the field: both or neither form given, invalid
    base64, a byte length not a multiple of 4, non-integer / negative / >= 2^32 ids.
    An empty query (``""`` or ``[]``) is valid and decodes to an empty array.
    """
    check_one_form(tokens_b64, token_ids)
    if tokens_b64 is not None:
        return decode_b64(tokens_b64)
    return decode_token_ids(token_ids)


def encode_tokens(tokens: Any) -> str:
    """The ``tokens_b64`` form of ``tokens`` (any array-like of ids in 0..2^32-1)."""
    arr = np.asarray(tokens)
    if arr.dtype != np.uint32:
        arr = decode_token_ids(arr)
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<u4").tobytes()).decode("ascii")


def b64_token_count(value: str | bytes | memoryview) -> int:
    """Tokens a well-formed ``tokens_b64`` string (or its ASCII bytes) carries, from its
    length alone (exact for valid input; a malformed string fails when it is decoded)."""
    n = len(value)
    eq2, eq1 = ("==", "=") if isinstance(value, str) else (b"==", b"=")
    pad = 2 if value[-2:] == eq2 else 1 if value[-1:] == eq1 else 0
    return max(0, (n // 4 * 3 - pad) // 4)


def is_b64_source(value: Any) -> bool:
    """Is a lookup query's token source a ``tokens_b64`` string (``str``, or its ASCII bytes
    as :func:`split_b64_value` takes them out of a body), rather than a uint32 array?"""
    return isinstance(value, (str, bytes, memoryview))


def decode_b64_many(values: Sequence[str | bytes | memoryview], field: str = "tokens_b64", *,
                    ascii_bytes: bool = False) -> list[np.ndarray | TokenDecodeError]:
    """Decode several ``tokens_b64`` strings in one buffer. With ``ascii_bytes`` a value may
    also be the string's ASCII bytes (or a memoryview of them), as :func:`split_b64_value`
    takes them out of a body (the lookup thread); elsewhere bytes are not a base64 string
    (a Python caller's mistake, named as such).

    Each item is a read-only uint32 array (views of one buffer) or the
    :class:`TokenDecodeError` for that string (returned, not raised, so one bad query does
    not fail its neighbours).
    """
    flat, spans, errors = _decode_flat(values, field, ascii_bytes)
    return [errors[k] if k in errors else flat[lo:hi] for k, (lo, hi) in enumerate(spans)]


def decode_query_tokens(sources: Sequence[np.ndarray | str | bytes | memoryview], field: str = "tokens_b64",
                        out: Callable[[int, int], np.ndarray | None] | None = None,
                        ) -> tuple[np.ndarray, np.ndarray, list[TokenDecodeError | None]]:
    """A batch of lookup queries as the index probes them: ``(tokens, offsets, errors)``,
    one flat read-only uint32 buffer holding every query that decoded, back to back, with
    ``offsets`` (int64, one more than those queries) and per source None or why its
    ``tokens_b64`` did not decode (that query then has no span). Base64 text (``str``, or
    ASCII bytes / memoryview as for :func:`decode_b64_many` with ``ascii_bytes``) is decoded
    once; a single query's decoded bytes are the buffer itself, several are copied into one
    buffer, a uint32 array is copied into it; nothing is joined or concatenated first
    (``docs/architecture.md`` counts the copies).

    ``out(num_queries, num_tokens)``, when given, lends the buffer to gather into (a writable
    uint32 array of exactly ``num_tokens``, or None to decline): the GPU engine's pinned
    staging area (``CupyEngine.lend_tokens``), so decoded tokens are written once, where the
    device copies them from. ``num_queries`` counts the queries that decoded."""
    flat, spans, errors = _decode_flat(sources, field, True, out)
    kept = [hi - lo for k, (lo, hi) in enumerate(spans) if k not in errors]
    # accumulate + fromiter: numpy's cumsum of a short list costs more (its list conversion)
    offsets = np.fromiter(accumulate(kept, initial=0), dtype=np.int64, count=len(kept) + 1)
    offsets.setflags(write=False)
    return flat, offsets, [errors.get(k) for k in range(len(sources))]


def _decode_flat(values: Sequence[Any], field: str, ascii_bytes: bool,
                 out_alloc: Callable[[int, int], np.ndarray | None] | None = None,
                 ) -> tuple[np.ndarray, list[tuple[int, int]], dict[int, TokenDecodeError]]:
    """The one decoder behind :func:`decode_b64_many` and :func:`decode_query_tokens`: every
    value into one read-only uint32 buffer, value ``k`` at ``flat[lo:hi]`` of its span, or an
    error in ``errors[k]``.

    Base64 is decoded by ``pybase64`` (SIMD, strict with ``validate=True``): measured side by
    side with the numba kernel it replaced (``bench/b64.py``), 16x faster on an 8,192-token
    query, and it accepts exactly the same strings (tests/test_service_tokens.py checks it
    against Python's strict decoder). A single query keeps pybase64's bytes as its buffer (the
    tokens are written once); several are joined into one buffer (a uint32 array among them:
    copied in). Only a bad string pays a
    second, vectorised pass (:func:`_first_bad_position`) to name its first bad character."""
    errors: dict[int, TokenDecodeError] = {}
    items: list[Any] = []  # per value: a uint32 array, the decoded bytes, or None (error)
    sizes: list[int] = []  # decoded bytes
    for k, value in enumerate(values):
        if isinstance(value, np.ndarray):
            arr = value if value.dtype == np.uint32 and value.ndim == 1 else as_tokens(value)
            items.append(arr)
            sizes.append(4 * arr.shape[0])
            continue
        if ascii_bytes and (isinstance(value, memoryview) or (isinstance(value, bytes) and value.isascii())):
            text: Any = value
        elif not isinstance(value, str):
            errors[k] = TokenDecodeError(field, f"must be a base64 string, got {type(value).__name__}")
            items.append(None)
            sizes.append(0)
            continue
        else:
            try:
                text = value.encode("ascii")
            except UnicodeEncodeError as exc:
                errors[k] = TokenDecodeError(field, f"not valid standard base64: non-ASCII character at "
                                                    f"position {exc.start}")
                items.append(None)
                sizes.append(0)
                continue
        raw = _b64decode_strict(text)
        if raw is None:
            errors[k] = _b64_error(bytes(text).decode("ascii"), _first_bad_position(text), field)
            items.append(None)
            sizes.append(0)
        elif len(raw) % 4:
            errors[k] = TokenDecodeError(
                field, f"decoded byte length {len(raw)} is not a multiple of 4 (little-endian uint32 ids)")
            items.append(None)
            sizes.append(0)
        else:
            items.append(raw)
            sizes.append(len(raw))
    lent = None
    if out_alloc is not None and sum(sizes):
        lent = out_alloc(len(values) - len(errors), sum(sizes) // 4)
        if lent is not None and (lent.dtype != np.uint32 or lent.shape != (sum(sizes) // 4,)):
            raise ValueError(f"the lent token buffer is {lent.dtype} {lent.shape}, "
                             f"not uint32 ({sum(sizes) // 4},)")
    if lent is None and all(isinstance(item, bytes) or item is None for item in items):  # base64 only: one join
        decoded = [item for item in items if item is not None]
        flat = np.frombuffer(decoded[0] if len(decoded) == 1 else b"".join(decoded), dtype="<u4")
    else:
        starts = [0] * (len(values) + 1)
        for k, size in enumerate(sizes):
            starts[k + 1] = starts[k] + size
        out = np.empty(starts[-1], dtype=np.uint8) if lent is None else lent.view(np.uint8)
        for k, item in enumerate(items):
            if item is None or not sizes[k]:
                continue
            if isinstance(item, np.ndarray):
                out[starts[k]:starts[k + 1]].view("<u4")[:] = item
            else:
                out[starts[k]:starts[k + 1]] = np.frombuffer(item, dtype=np.uint8)
        flat = out.view("<u4")
    if flat.dtype != np.uint32:  # big-endian host: make it native
        flat = flat.astype(np.uint32)
    flat.setflags(write=False)
    spans, at = [], 0
    for size in sizes:
        spans.append((at, at + size // 4))
        at += size // 4
    return flat, spans, errors


def _b64decode_strict(text: Any) -> bytes | None:
    """Strict standard base64 (alphabet A-Z a-z 0-9 + /, '=' padding only at the end, length
    a multiple of 4, no whitespace) -> bytes, or None when ``text`` is not that."""
    if len(text) % 4:
        return None
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _b64_alphabet_table() -> np.ndarray:
    table = np.full(256, 255, dtype=np.uint8)
    table[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", dtype=np.uint8)] = \
        np.arange(64, dtype=np.uint8)
    return table


_B64_TABLE = _b64_alphabet_table()


def _first_bad_position(text: Any) -> int:
    """Where a string :func:`_b64decode_strict` refused goes wrong: ``len(text)`` for a length
    that is not a multiple of 4, else the first character outside the alphabet (a '=' before
    the last two characters, or in the last two not as padding). Vectorised, so a hostile
    many-megabyte string costs milliseconds, not a Python loop under the GIL."""
    src = np.frombuffer(text, dtype=np.uint8)
    n = src.shape[0]
    if n % 4:
        return n
    pad = 2 if n >= 2 and src[n - 1] == 61 and src[n - 2] == 61 else 1 if n and src[n - 1] == 61 else 0
    bad = np.flatnonzero(_B64_TABLE[src[:n - pad]] > 63)
    return int(bad[0]) if bad.size else n


def _b64_error(value: str, pos: int, field: str) -> TokenDecodeError:
    n = len(value)
    if pos == n:
        return TokenDecodeError(field, f"not valid standard base64: length {n} is not a multiple of 4")
    ch = value[pos]
    if ch == "=":
        return TokenDecodeError(field, f"not valid standard base64: padding '=' at character {pos} "
                                              "(only the last 1 or 2 characters may be '=')")
    return TokenDecodeError(field, f"not valid standard base64: character {ch!r} at position {pos} "
                                          "is not in the alphabet A-Z a-z 0-9 + /")


#: ``tokens_b64`` as a regular expression, for schemas (JSON Schema ``pattern``): standard
#: base64 with '=' padding whose decoded length is a multiple of 4 bytes (16 characters per
#: 3 ids, then one id as 6 + "==" or two as 11 + "="). Exactly what :func:`decode_b64_many`
#: accepts; the decoder stays the check, the pattern is the documentation.
B64_TOKENS_PATTERN = r"^(?:[A-Za-z0-9+/]{16})*(?:[A-Za-z0-9+/]{6}==|[A-Za-z0-9+/]{11}=)?$"


def decode_b64(value: Any, field: str = "tokens_b64") -> np.ndarray:
    """One ``tokens_b64`` string -> a read-only uint32 array; raises :class:`TokenDecodeError`."""
    got = decode_b64_many([value], field)[0]
    if isinstance(got, TokenDecodeError):
        raise got
    return got


def decode_token_ids(value: Any, field: str = "token_ids") -> np.ndarray:
    """``token_ids`` (a list of ints, or a 1-D integer array) -> a read-only uint32 view;
    raises :class:`TokenDecodeError` naming ``field``. The caller's array is never mutated."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TokenDecodeError(field, f"must be a 1-D integer array, got {value.dtype} {value.shape}")
        arr = value
    else:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TokenDecodeError(field, f"must be a list of integers, got {type(value).__name__}")
        kinds = set(map(type, value))
        if not kinds <= {int}:
            bad = next(v for v in value if type(v) is not int)
            pos = next(i for i, v in enumerate(value) if v is bad)
            raise TokenDecodeError(field, f"item {pos}: token ids must be integers, got {bad!r} ({type(bad).__name__})")
        try:
            arr = np.array(value, dtype=np.int64)
        except OverflowError:
            raise TokenDecodeError(field, f"ids must lie in 0..{MAX_TOKEN_ID} (>= 0 and < 2^32), got a value >= 2^63") from None
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            pos = int(np.argmin(arr))
            raise TokenDecodeError(field, _range_reason(lo, pos))
        if hi > MAX_TOKEN_ID:
            pos = int(np.argmax(arr))
            raise TokenDecodeError(field, _range_reason(hi, pos))
    out = np.ascontiguousarray(arr, dtype=np.uint32).view()  # a view: never flip the caller's flags
    out.setflags(write=False)
    return out


# --------------------------------------------------------------------------- event columns
# The event parser (``wire.py``) converts a whole batch's tokens in one go; these are the
# same rules as above in bulk form. Ids outside uint32 are valid on the event wire (the
# entry is applied, its binding stays unfilled): these functions return None for them.

_EMPTY_TOKENS = np.zeros(0, dtype=np.uint32)
_EMPTY_TOKENS.setflags(write=False)
_UINT32 = np.dtype(np.uint32)
_LIST_ONLY = {list}
_ARRAY_ONLY = {np.ndarray}
_BYTES_ONLY = {bytes}
_ONE_DIM = {1}
_NDIM = attrgetter("ndim")
_DTYPE = attrgetter("dtype")

if array("I").itemsize != 4:  # pragma: no cover - every mainstream platform has 4-byte int
    raise ImportError("blendmatch needs a 4-byte C unsigned int for token parsing")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def pack_token_lists(token_lists: list[Any]) -> Optional[tuple[np.ndarray, list[int]]]:
    """Every entry's ``token_ids`` in one read-only uint32 buffer ``(flat, lengths)``, or None
    when the batch needs the entry-by-entry path (kinds mixed, a bad value, ids outside uint32).

    Three batch-wide forms. Lists of ints (decoded JSON) go through
    ``array('I').fromlist``: a C loop that range-checks and leaves the buffer unchanged
    when it fails, bound by reading the Python ints. Packed forms cost no per-token work:
    numpy integer arrays are copied into one buffer (``bytes.join`` for 1-D uint32 arrays,
    a plain byte copy that is cheaper per array than ``np.concatenate``), ``bytes`` of
    little-endian uint32 (a binary transport) are joined. The buffer is always a copy, so a
    producer may reuse its arrays once the call returns.
    """
    kinds = set(map(type, token_lists))
    if kinds == _LIST_ONLY:
        buf = array("I")
        fromlist = buf.fromlist
        try:
            for ids in token_lists:
                fromlist(ids)
        except (OverflowError, TypeError):
            return None
        flat = np.frombuffer(buf, dtype=np.uint32) if len(buf) else _EMPTY_TOKENS
        lengths = list(map(len, token_lists))
    elif kinds == _ARRAY_ONLY:
        if set(map(_NDIM, token_lists)) != _ONE_DIM:
            return None
        dtypes = set(map(_DTYPE, token_lists))
        dtype = dtypes.pop()
        if dtypes or dtype.kind not in "iu":  # mixed dtypes (numpy would promote) or not integers
            return None
        flat = None
        if dtype == _UINT32:
            try:
                joined = b"".join(token_lists)
                flat = np.frombuffer(joined, dtype=np.uint32) if joined else _EMPTY_TOKENS
            except TypeError:  # a strided array exports no plain buffer
                pass
        if flat is None:
            flat = np.concatenate(token_lists)
            if dtype != _UINT32:
                if flat.size and (int(flat.min()) < 0 or int(flat.max()) > MAX_TOKEN_ID):
                    return None
                flat = flat.astype(np.uint32)
        lengths = list(map(len, token_lists))
    elif kinds == _BYTES_ONLY:
        byte_lens = list(map(len, token_lists))
        lengths = [nbytes >> 2 for nbytes in byte_lens]
        if 4 * sum(lengths) != sum(byte_lens):  # some entry is not a whole number of ids
            return None
        joined = b"".join(token_lists)
        flat = np.frombuffer(joined, dtype="<u4").astype(np.uint32, copy=False) if joined else _EMPTY_TOKENS
    else:
        return None
    flat.setflags(write=False)
    return flat, lengths


def packed_token_ids(value: Any, field: str = "token_ids") -> Optional[np.ndarray]:
    """One entry's ``token_ids`` given packed (a 1-D numpy integer array, or bytes of
    little-endian uint32) as uint32, or None when an id lies outside uint32 (valid, but
    it fills no binding, as for lists). Raises :class:`TokenDecodeError` for anything else."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise TokenDecodeError(field, f"must be a 1-D array of token ids, got shape {value.shape}")
        if value.dtype.kind not in "iu":
            raise TokenDecodeError(field, f"token ids must be integers, got an array of {value.dtype}")
        if value.dtype == _UINT32:
            return value
        if value.size and (int(value.min()) < 0 or int(value.max()) > MAX_TOKEN_ID):
            return None
        return value.astype(np.uint32)
    try:
        return np.frombuffer(value, dtype="<u4").astype(np.uint32, copy=False)
    except (TypeError, ValueError):
        raise TokenDecodeError(field, "packed token ids must be contiguous bytes of little-endian uint32 "
                                   f"(a multiple of 4 bytes), got {_type_name(value)}") from None


# --------------------------------------------------------------------------- raw JSON bodies


class TokenArrays:
    """What :func:`split_token_arrays` took out of a JSON body: ``text`` (the body with each
    ``"token_ids"`` array replaced by a placeholder) and the arrays' ids, array ``k`` being
    :meth:`row` ``(k)`` (read-only uint32 views of one buffer, :attr:`flat`)."""

    __slots__ = ("text", "flat", "starts")

    def __init__(self, text: bytes, flat: np.ndarray, starts: np.ndarray) -> None:
        self.text = text
        self.flat = flat
        self.starts = starts  # int64, len(self) + 1 entries

    def __len__(self) -> int:
        return int(self.starts.shape[0]) - 1

    def row(self, k: int) -> np.ndarray:
        return self.flat[int(self.starts[k]):int(self.starts[k + 1])]


#: Smallest body worth splitting: below this the ordinary parser is as fast.
SPLIT_MIN_BYTES = 2048


_JSON_WS = b" \t\n\r"


def split_b64_value(body: bytes, *, require_ascii: bool = True) -> Optional[tuple[memoryview, bytes]]:
    """Take the ``tokens_b64`` string out of a single-lookup body that opens with it:
    ``(a memoryview of the string's bytes in body, the body with the string emptied)``, or
    None.

    Why: validating the whole body makes pydantic copy the 43 KB string of an 8,192-token
    query into a Python str (23 us of the event loop, under the GIL, against 1.4 us for the
    body without it), and the decoder then copies it twice more to get bytes back. The
    string is not copied here either: the lookup thread's decoder
    (:func:`decode_query_tokens`) reads it where it lies in the body.

    Only the plain case is taken, so the model sees exactly what it would have: the body
    starts with ``{"tokens_b64"`` as its first key (JSON whitespace allowed around ``:``),
    the body has no backslash anywhere (no escape can end the string early, change one of
    its characters, or spell a second ``tokens_b64`` key differently), every byte of the
    body is ASCII (so the decoder's error positions are the same in bytes as in characters),
    and no second ``"tokens_b64"`` follows (the parser would keep the last one). Emptying a string leaves a string: ``check_one_form`` tells "not given" by
    ``None``, not by emptiness, and the model never reads the content (the decoder checks
    it on the lookup thread). Anything else: None, and the body is validated as sent.

    ``require_ascii=False`` skips the ASCII test (1.4 us of an 8,192-token body) for a
    caller that answers only successes this way and sends every failure down the ordinary
    path (the lookup lane, ``service/lane.py``): a byte outside ASCII inside the string is
    not base64 (the decoder refuses it), and one outside the string is validated with the
    rest of the text by the model.
    """
    if not body.startswith(b'{"tokens_b64"') or body.find(b"\\") >= 0:
        return None
    n = len(body)
    i = 13
    while i < n and body[i] in _JSON_WS:
        i += 1
    if i >= n or body[i] != 58:  # ':'
        return None
    i += 1
    while i < n and body[i] in _JSON_WS:
        i += 1
    if i >= n or body[i] != 34:  # '"'
        return None
    start = i + 1
    end = body.find(b'"', start)
    if end < 0:
        return None
    if (require_ascii and not body.isascii()) or body.find(b'"tokens_b64"', end) >= 0:
        return None
    return memoryview(body)[start:end], body[:start] + body[end:]


def split_token_arrays(body: bytes, *, placeholder: str = "index") -> Optional[TokenArrays]:
    """Take every ``"token_ids"`` array out of the raw JSON ``body`` in one ``nogil`` pass.

    Why: decoding a JSON list of 256 ids builds 256 Python ints (~20 us per event entry,
    ~0.5 ms per 8,192-token lookup with the conversion to uint32), more than everything
    else about the request. The kernel parses the digits straight into uint32.

    Returns None (parse ``body`` as it is) when the body holds no ``"token_ids"`` key, is
    shorter than :data:`SPLIT_MIN_BYTES`, contains a backslash anywhere (an escape could
    spell the key differently), or when *any* ``"token_ids"`` key's value is not a plain
    array of decimal integers in ``0..2^32-1`` (floats, signs, leading zeros, exponents,
    ``true``, ``null``, nested arrays): then the ordinary parser and the ordinary rules
    (and their error messages) apply to the whole body unchanged.

    Otherwise each array is replaced in :attr:`TokenArrays.text` by ``placeholder``:
    ``"index"`` writes its ordinal ``k`` (an integer, so after a JSON parse every
    ``"token_ids"`` value in the document is the ordinal of its ids, unambiguously: none
    was left in place), ``"empty"`` writes ``[]`` (the caller maps arrays in document
    order). The replacement is a complete JSON value in place of a complete JSON value, so
    the text is valid JSON exactly when ``body`` is (a caller that gets a parse error
    should re-parse ``body`` for the canonical message, whose character positions differ).
    The key is matched only as an object key (a string followed by ``:``), never inside
    a string value.
    """
    if placeholder not in ("index", "empty"):
        raise ValueError(f"placeholder must be 'index' or 'empty', got {placeholder!r}")
    n = len(body)
    if n < SPLIT_MIN_BYTES:
        return None
    head = body[:1024]
    if b'"token_ids"' not in head and (b'"tokens_b64"' in head or b'"token_ids"' not in body):
        # A body that opens with tokens_b64 is a base64 lookup: searching its 40 KB of text
        # for the key cost ~16 us on the loop. Skipping the split is never wrong, only slower.
        return None
    from . import _jsontok  # numba: loaded on first use

    src = np.frombuffer(body, dtype=np.uint8)
    out = np.empty(n + n // 2 + 64, dtype=np.uint8)
    flat = np.empty(n // 2 + 1, dtype=np.uint32)
    starts = np.empty(n // 14 + 2, dtype=np.int64)
    status, out_len, arrays, tokens = _jsontok.split_token_arrays_kernel(
        src, _jsontok.KEY, 1 if placeholder == "empty" else 0, out, flat, starts)
    if status != 0 or arrays == 0:
        return None
    ids = flat[:tokens].copy()
    ids.setflags(write=False)
    return TokenArrays(out[:out_len].tobytes(), ids, starts[:arrays + 1].copy())
