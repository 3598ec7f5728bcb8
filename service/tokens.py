"""Request tokens -> a uint32 numpy array: the one decoder both lookup endpoints use.

Two wire forms, exactly one per query (LMCache's shapes):

- ``tokens_b64``: standard base64 (RFC 4648 section 4 alphabet ``A-Z a-z 0-9 + /``, padded
  with ``=`` to a multiple of 4 characters) of the token ids as little-endian uint32.
  Decoded strictly: a character outside the alphabet (whitespace and the URL-safe ``-_``
  included), a length that is not a multiple of 4, ``=`` anywhere but the last one or two
  positions, or a decoded byte length that is not a multiple of 4 is an error, never
  silently skipped. (Python's ``b64decode(s, validate=True)`` accepts the same strings
  except that it tolerates surplus trailing ``=``.) Unused low bits of the last quantum are
  ignored, as RFC 4648 permits. This is the compact form (5.3 bytes per token).

  The decoder is a numba kernel (``nogil``), several times faster than ``binascii``. The
  service does not decode on the event loop at all: the lookup thread decodes a whole batch
  in one kernel call (:func:`decode_b64_many`) without the GIL, and a string that fails
  there fails only its own request (a 422, like any other decoding error).
- ``token_ids``: a JSON list of integers in 0..2^32-1. ``true``/``false``, floats, strings,
  negative ids and ids >= 2^32 are errors (a bool is an ``int`` in Python; it is still not a
  token id).

Errors are :class:`~blendmatch.service.errors.TokenDecodeError` (a ``ValueError``) whose
message starts with the field name, so the 422 a caller sees says which field is wrong.
The returned array is read-only; callers must not mutate it.
"""

from __future__ import annotations

import base64
from typing import Any, Sequence

import numba
import numpy as np

from .errors import TokenDecodeError

__all__ = ["decode_tokens", "decode_b64_many", "b64_token_count", "encode_tokens", "MAX_TOKEN_ID"]

#: Largest valid token id (ids are uint32 on the wire and in the index).
MAX_TOKEN_ID = 0xFFFFFFFF


def decode_tokens(tokens_b64: str | None = None, token_ids: Sequence[int] | None = None) -> np.ndarray:
    """Decode exactly one of ``tokens_b64`` / ``token_ids`` to a read-only 1-D uint32 array.

    Raises :class:`TokenDecodeError` naming the field: both or neither form given, invalid
    base64, a byte length not a multiple of 4, non-integer / negative / >= 2^32 ids.
    An empty query (``""`` or ``[]``) is valid and decodes to an empty array.
    """
    if (tokens_b64 is None) == (token_ids is None):
        which = "both were given" if tokens_b64 is not None else "neither was given"
        raise TokenDecodeError("tokens_b64/token_ids", f"give exactly one of the two token forms; {which}")
    if tokens_b64 is not None:
        return _decode_b64(tokens_b64)
    return _decode_ids(token_ids)


def encode_tokens(tokens: Any) -> str:
    """The ``tokens_b64`` form of ``tokens`` (any array-like of ids in 0..2^32-1)."""
    arr = np.asarray(tokens)
    if arr.dtype != np.uint32:
        arr = _decode_ids(arr)
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<u4").tobytes()).decode("ascii")


def _b64_table() -> np.ndarray:
    table = np.full(256, 255, dtype=np.uint8)
    for i, ch in enumerate(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"):
        table[ch] = i
    return table


_B64 = _b64_table()


@numba.njit(cache=True, nogil=True)
def _b64_segment(src, lo, hi, table, out, o):  # pragma: no cover - compiled
    """Decode ``src[lo:hi]`` (strict standard base64) into ``out[o:]``; returns -1 or the
    position (relative to ``lo``) of the first bad character (``hi - lo`` for a length that
    is not a multiple of 4). The main loop has no early exit (it ORs the table values and
    checks once), so only a bad input pays a second pass to find the position."""
    n = hi - lo
    if n % 4:
        return n
    pad = 0
    if n and src[hi - 1] == 61:  # '='
        pad = 2 if src[hi - 2] == 61 else 1
    full = lo + n - 4 if pad else hi
    bad = np.uint32(0)
    for i in range(lo, full, 4):
        a = np.uint32(table[src[i]])
        b = np.uint32(table[src[i + 1]])
        c = np.uint32(table[src[i + 2]])
        d = np.uint32(table[src[i + 3]])
        bad |= a | b | c | d  # an invalid character (255) sets bit 6 or 7
        v = (a << 18) | (b << 12) | (c << 6) | d
        out[o] = (v >> 16) & 0xFF
        out[o + 1] = (v >> 8) & 0xFF
        out[o + 2] = v & 0xFF
        o += 3
    if bad > 63:
        for i in range(lo, full):
            if table[src[i]] > 63:
                return i - lo
    if pad:
        i = hi - 4
        for j in range(4 - pad):
            if table[src[i + j]] > 63:
                return i + j - lo
        v = (np.uint32(table[src[i]]) << 18) | (np.uint32(table[src[i + 1]]) << 12)
        out[o] = (v >> 16) & 0xFF
        if pad == 1:
            v |= np.uint32(table[src[i + 2]]) << 6
            out[o + 1] = (v >> 8) & 0xFF
    return -1


@numba.njit(cache=True, nogil=True)
def _b64decode_many_nb(src, starts, table):  # pragma: no cover - compiled
    """Decode every segment ``src[starts[k]:starts[k+1]]`` into one buffer.

    Returns ``(out, out_starts, bad)``: segment ``k`` decoded is ``out[out_starts[k]:
    out_starts[k+1]]`` when ``bad[k] == -1``; otherwise ``bad[k]`` is its error position.
    """
    m = starts.shape[0] - 1
    out_starts = np.zeros(m + 1, dtype=np.int64)
    for k in range(m):
        n = starts[k + 1] - starts[k]
        size = 0
        if n % 4 == 0 and n:
            pad = 0
            if src[starts[k + 1] - 1] == 61:
                pad = 2 if src[starts[k + 1] - 2] == 61 else 1
            size = n // 4 * 3 - pad
        out_starts[k + 1] = out_starts[k] + size
    out = np.empty(out_starts[m], dtype=np.uint8)
    bad = np.empty(m, dtype=np.int64)
    for k in range(m):
        bad[k] = _b64_segment(src, starts[k], starts[k + 1], table, out, out_starts[k])
    return out, out_starts, bad


def b64_token_count(value: str) -> int:
    """Tokens a well-formed ``tokens_b64`` string carries, from its length alone (exact for
    valid input; a malformed string fails when it is decoded)."""
    n = len(value)
    pad = 2 if value.endswith("==") else 1 if value.endswith("=") else 0
    return max(0, (n // 4 * 3 - pad) // 4)


def decode_b64_many(values: Sequence[str]) -> list[np.ndarray | TokenDecodeError]:
    """Decode several ``tokens_b64`` strings in one ``nogil`` kernel call.

    Each item is a read-only uint32 array or the :class:`TokenDecodeError` for that string
    (returned, not raised, so one bad query does not fail its neighbours). Run it where
    holding no GIL matters: the lookup thread decodes a whole batch this way.
    """
    encoded: list[bytes] = []
    errors: dict[int, TokenDecodeError] = {}
    for k, value in enumerate(values):
        if not isinstance(value, str):
            errors[k] = TokenDecodeError("tokens_b64", f"must be a base64 string, got {type(value).__name__}")
            encoded.append(b"")
            continue
        try:
            encoded.append(value.encode("ascii"))
        except UnicodeEncodeError as exc:
            errors[k] = TokenDecodeError("tokens_b64", f"not valid standard base64: non-ASCII character at "
                                                       f"position {exc.start}")
            encoded.append(b"")
    starts = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=starts[1:])
    src = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    out, out_starts, bad = _b64decode_many_nb(src, starts, _B64)
    results: list[np.ndarray | TokenDecodeError] = []
    for k, value in enumerate(values):
        if k in errors:
            results.append(errors[k])
            continue
        if bad[k] >= 0:
            results.append(_b64_error(value, int(bad[k])))
            continue
        lo, hi = int(out_starts[k]), int(out_starts[k + 1])
        if (hi - lo) % 4:
            results.append(TokenDecodeError(
                "tokens_b64", f"decoded byte length {hi - lo} is not a multiple of 4 (little-endian uint32 ids)"))
            continue
        arr = out[lo:hi].view("<u4")
        if arr.dtype != np.uint32:  # big-endian host: make it native
            arr = arr.astype(np.uint32)
        arr.setflags(write=False)
        results.append(arr)
    return results


def _b64_error(value: str, pos: int) -> TokenDecodeError:
    n = len(value)
    if pos == n:
        return TokenDecodeError("tokens_b64", f"not valid standard base64: length {n} is not a multiple of 4")
    ch = value[pos]
    if ch == "=":
        return TokenDecodeError("tokens_b64", f"not valid standard base64: padding '=' at character {pos} "
                                              "(only the last 1 or 2 characters may be '=')")
    return TokenDecodeError("tokens_b64", f"not valid standard base64: character {ch!r} at position {pos} "
                                          "is not in the alphabet A-Z a-z 0-9 + /")


def _decode_b64(value: Any) -> np.ndarray:
    got = decode_b64_many([value])[0]
    if isinstance(got, TokenDecodeError):
        raise got
    return got


def _decode_ids(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TokenDecodeError("token_ids", f"must be a 1-D integer array, got {value.dtype} {value.shape}")
        arr = value
    else:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TokenDecodeError("token_ids", f"must be a list of integers, got {type(value).__name__}")
        kinds = set(map(type, value))
        if not kinds <= {int}:
            bad = next(v for v in value if type(v) is not int)
            pos = next(i for i, v in enumerate(value) if v is bad)
            raise TokenDecodeError(
                "token_ids", f"item {pos} must be an integer token id, got {type(bad).__name__} {bad!r}")
        try:
            arr = np.array(value, dtype=np.int64)
        except OverflowError:
            raise TokenDecodeError("token_ids", f"ids must lie in 0..{MAX_TOKEN_ID}, got a value >= 2^63") from None
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            pos = int(np.argmin(arr))
            raise TokenDecodeError("token_ids", f"item {pos}: ids must lie in 0..{MAX_TOKEN_ID}, got {lo}")
        if hi > MAX_TOKEN_ID:
            pos = int(np.argmax(arr))
            raise TokenDecodeError("token_ids", f"item {pos}: ids must lie in 0..{MAX_TOKEN_ID}, got {hi}")
    out = np.ascontiguousarray(arr, dtype=np.uint32).view()  # a view: never flip the caller's flags
    out.setflags(write=False)
    return out
