"""The entries splitter behind ``wire_scan.split_entries`` (numba, ``nogil``).

Private to ``index/wire_scan.py`` (imported on first use). One pass over a ``POST /events``
body: every array that is the value of an ``"entries"`` key is parsed entry by entry into
columns (chunk hashes decoded from hex, the spans of model names and salts, the integer
fields, token ids as uint32) and cut out of the text, which holds the array's ordinal in
its place. Anything the columns cannot say exactly as the JSON parser and the entry rules
would (an escape anywhere, an unknown or repeated field, a float, a null, a value out of
range, a token id outside uint32) stops the pass with a nonzero status: the caller then
parses the body as it is, with the ordinary rules and messages (``wire_scan.py`` has the
contract).
"""

from __future__ import annotations

import numba
import numpy as np

from ._jsontok import copy_before, copy_tail, next_key_value, token_array, write_ordinal

__all__ = ["split_entries_kernel", "ENTRIES", "NCOLS", "C_HASH", "C_HASH_LEN", "C_MODEL", "C_MODEL_END",
           "C_SALT", "C_SALT_END", "C_RANK", "C_GROUP", "C_SIZE", "C_OFFSET", "C_TOKENS", "C_NTOKENS",
           "C_SAME_SCOPE"]

#: The key whose array values are taken out, as bytes.
ENTRIES = np.frombuffer(b"entries", dtype=np.uint8).copy()

# Columns of the per-entry output (int64).
C_HASH, C_HASH_LEN = 0, 1  # the decoded chunk hash: start in the hash buffer, length in bytes
C_MODEL, C_MODEL_END = 2, 3  # model_name's bytes in the body (between the quotes)
C_SALT, C_SALT_END = 4, 5  # cache_salt's bytes (start == end: "" or absent)
C_RANK, C_GROUP, C_SIZE, C_OFFSET = 6, 7, 8, 9
C_TOKENS, C_NTOKENS = 10, 11  # where the ids begin in the token buffer, how many
C_SAME_SCOPE = 12  # 1: model, rank, group and salt equal the previous entry's of the same array
NCOLS = 13

_QUOTE = 34
_BACKSLASH = 92
_COLON = 58
_COMMA = 44
_OPEN = 91
_CLOSE = 93
_LBRACE = 123
_RBRACE = 125
_MINUS = 45
_ZERO = 48
_NINE = 57
_MAX_ID = 0xFFFFFFFF
_INT64_MAX = (1 << 63) - 1
_MAX_HASH_BYTES = 128

# Field ids (bit positions of the "seen" masks).
_F_KEY, _F_SIZE, _F_OFFSET, _F_TOKENS = 0, 1, 2, 3
_K_HASH, _K_MODEL, _K_RANK, _K_GROUP, _K_SALT = 0, 1, 2, 3, 4

_N_KEY = np.frombuffer(b"key", dtype=np.uint8).copy()
_N_SIZE = np.frombuffer(b"size_bytes", dtype=np.uint8).copy()
_N_OFFSET = np.frombuffer(b"token_offset", dtype=np.uint8).copy()
_N_TOKENS = np.frombuffer(b"token_ids", dtype=np.uint8).copy()
_N_HASH = np.frombuffer(b"chunk_hash_hex", dtype=np.uint8).copy()
_N_MODEL = np.frombuffer(b"model_name", dtype=np.uint8).copy()
_N_RANK = np.frombuffer(b"kv_rank", dtype=np.uint8).copy()
_N_GROUP = np.frombuffer(b"object_group_id", dtype=np.uint8).copy()
_N_SALT = np.frombuffer(b"cache_salt", dtype=np.uint8).copy()


@numba.njit(cache=True, nogil=True, inline="always")
def _ws(c):  # pragma: no cover - compiled
    return c == 32 or c == 10 or c == 13 or c == 9


@numba.njit(cache=True, nogil=True, inline="always")
def _skip_ws(src, p, n):  # pragma: no cover - compiled
    while p < n and _ws(src[p]):
        p += 1
    return p


@numba.njit(cache=True, nogil=True, inline="always")
def _is(src, a, b, name):  # pragma: no cover - compiled
    if b - a != name.shape[0]:
        return False
    for m in range(name.shape[0]):
        if src[a + m] != name[m]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _string_end(src, p, n):  # pragma: no cover - compiled
    """``src[p]`` is an opening quote: the index of the closing one, or -1 for a string
    this pass does not take (unterminated, an escape, or a control character JSON forbids)."""
    j = p + 1
    while j < n:
        c = src[j]
        if c == _QUOTE:
            return j
        if c < 32 or c == _BACKSLASH:
            return -1
        j += 1
    return -1


@numba.njit(cache=True, nogil=True)
def _uint(src, p, n, hi):  # pragma: no cover - compiled
    """A JSON integer in ``0..hi`` at ``p`` (no sign, fraction or exponent, no leading zero):
    ``(value, end)``, or ``(0, -1)`` for anything else."""
    if p >= n or src[p] < _ZERO or src[p] > _NINE:
        return 0, -1
    if src[p] == _ZERO and p + 1 < n and _ZERO <= src[p + 1] <= _NINE:
        return 0, -1
    v = np.uint64(0)
    digits = 0
    while p < n and _ZERO <= src[p] <= _NINE:
        v = v * np.uint64(10) + np.uint64(src[p] - _ZERO)
        digits += 1
        if digits > 19:
            return 0, -1
        p += 1
    if p < n and (src[p] == 46 or src[p] == 101 or src[p] == 69):  # '.', 'e', 'E': a float
        return 0, -1
    if v > np.uint64(hi):
        return 0, -1
    return np.int64(v), p


@numba.njit(cache=True, nogil=True)
def _key_name(src, p, n):  # pragma: no cover - compiled
    """An object key at ``p`` (after whitespace): ``(start, end, after_colon)`` of its
    bytes, or ``(0, 0, -1)``."""
    p = _skip_ws(src, p, n)
    if p >= n or src[p] != _QUOTE:
        return 0, 0, -1
    e = _string_end(src, p, n)
    if e < 0:
        return 0, 0, -1
    q = _skip_ws(src, e + 1, n)
    if q >= n or src[q] != _COLON:
        return 0, 0, -1
    return p + 1, e, _skip_ws(src, q + 1, n)


@numba.njit(cache=True, nogil=True)
def _after_value(src, p, n, close):  # pragma: no cover - compiled
    """After a member's value: ``(p past a comma, 0)``, ``(p past the closer, 1)`` or ``(-1, 0)``."""
    p = _skip_ws(src, p, n)
    if p >= n:
        return -1, 0
    if src[p] == _COMMA:
        return p + 1, 0
    if src[p] == close:
        return p + 1, 1
    return -1, 0


@numba.njit(cache=True, nogil=True)
def _hex_value(c):  # pragma: no cover - compiled
    if _ZERO <= c <= _NINE:
        return c - _ZERO
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


@numba.njit(cache=True, nogil=True)
def _key(src, p, n, row, hashes, h):  # pragma: no cover - compiled
    """The ``key`` object at ``p`` into ``row``; returns ``(end, bytes of hash written)``
    or ``(-1, 0)``."""
    if p >= n or src[p] != _LBRACE:
        return -1, 0
    p = _skip_ws(src, p + 1, n)
    if p < n and src[p] == _RBRACE:
        return -1, 0  # required fields missing: the ordinary path names them
    seen = 0
    written = 0
    row[C_GROUP] = 0
    row[C_SALT] = 0
    row[C_SALT_END] = 0
    while True:
        a, b, p = _key_name(src, p, n)
        if p < 0:
            return -1, 0
        if _is(src, a, b, _N_HASH):
            f = _K_HASH
            if p >= n or src[p] != _QUOTE:
                return -1, 0
            e = _string_end(src, p, n)
            digits = e - p - 1
            if e < 0 or digits < 2 or digits & 1 or digits > 2 * _MAX_HASH_BYTES:
                return -1, 0
            if h + digits // 2 > hashes.shape[0]:
                return -1, 0
            row[C_HASH] = h
            for m in range(digits // 2):
                hi = _hex_value(src[p + 1 + 2 * m])
                lo = _hex_value(src[p + 2 + 2 * m])
                if hi < 0 or lo < 0:
                    return -1, 0
                hashes[h + m] = hi * 16 + lo
            row[C_HASH_LEN] = digits // 2
            written = digits // 2
            p = e + 1
        elif _is(src, a, b, _N_MODEL) or _is(src, a, b, _N_SALT):
            f = _K_MODEL if src[a] == _N_MODEL[0] else _K_SALT  # "model_name" and "cache_salt" differ at byte 0
            if p >= n or src[p] != _QUOTE:
                return -1, 0
            e = _string_end(src, p, n)
            if e < 0:
                return -1, 0
            if f == _K_MODEL:
                row[C_MODEL] = p + 1
                row[C_MODEL_END] = e
            else:
                row[C_SALT] = p + 1
                row[C_SALT_END] = e
            p = e + 1
        elif _is(src, a, b, _N_RANK):
            f = _K_RANK
            v, p = _uint(src, p, n, _MAX_ID)
            row[C_RANK] = v
        elif _is(src, a, b, _N_GROUP):
            f = _K_GROUP
            v, p = _uint(src, p, n, _INT64_MAX)
            row[C_GROUP] = v
        else:
            return -1, 0  # an unknown field (the ordinary parser ignores it, slower)
        if p < 0 or seen & (1 << f):
            return -1, 0  # a bad value, or a field given twice (the JSON parser keeps the last)
        seen |= 1 << f
        p, closed = _after_value(src, p, n, _RBRACE)
        if p < 0:
            return -1, 0
        if closed:
            break
    need = (1 << _K_HASH) | (1 << _K_MODEL) | (1 << _K_RANK)
    if seen & need != need:
        return -1, 0
    return p, written


@numba.njit(cache=True, nogil=True)
def _entry(src, p, n, row, hashes, h, flat, t):  # pragma: no cover - compiled
    """One entry object at ``p`` into ``row``: ``(end, hash bytes, tokens written)`` or
    ``(-1, 0, 0)``."""
    if p >= n or src[p] != _LBRACE:
        return -1, 0, 0
    p = _skip_ws(src, p + 1, n)
    if p < n and src[p] == _RBRACE:
        return -1, 0, 0
    seen = 0
    hb = 0
    row[C_SIZE] = 0
    row[C_OFFSET] = -1
    row[C_TOKENS] = t
    row[C_NTOKENS] = 0
    t0 = t
    while True:
        a, b, p = _key_name(src, p, n)
        if p < 0:
            return -1, 0, 0
        if _is(src, a, b, _N_KEY):
            f = _F_KEY
            p, hb = _key(src, p, n, row, hashes, h)
        elif _is(src, a, b, _N_SIZE):
            f = _F_SIZE
            v, p = _uint(src, p, n, _INT64_MAX)
            row[C_SIZE] = v
        elif _is(src, a, b, _N_OFFSET):
            f = _F_OFFSET
            if p + 1 < n and src[p] == _MINUS and src[p + 1] == _ZERO + 1 and (
                    p + 2 >= n or not (_ZERO <= src[p + 2] <= _NINE or src[p + 2] == 46 or src[p + 2] == 101
                                       or src[p + 2] == 69)):
                row[C_OFFSET] = -1
                p += 2
            else:
                v, p = _uint(src, p, n, _INT64_MAX)
                row[C_OFFSET] = v
        elif _is(src, a, b, _N_TOKENS):
            f = _F_TOKENS
            if p >= n or src[p] != _OPEN:
                return -1, 0, 0
            p, t = token_array(src, p + 1, n, flat, t)
            row[C_NTOKENS] = t - t0
        else:
            return -1, 0, 0
        if p < 0 or seen & (1 << f):
            return -1, 0, 0
        seen |= 1 << f
        p, closed = _after_value(src, p, n, _RBRACE)
        if p < 0:
            return -1, 0, 0
        if closed:
            break
    if not seen & (1 << _F_KEY):
        return -1, 0, 0
    return p, hb, t


@numba.njit(cache=True, nogil=True)
def _same_scope(src, a, b):  # pragma: no cover - compiled
    """Rows ``a`` and ``b`` name the same model, rank, group and salt."""
    if a[C_RANK] != b[C_RANK] or a[C_GROUP] != b[C_GROUP]:
        return False
    for lo, hi in ((C_MODEL, C_MODEL_END), (C_SALT, C_SALT_END)):
        la = a[hi] - a[lo]
        if la != b[hi] - b[lo]:
            return False
        for m in range(la):
            if src[a[lo] + m] != src[b[lo] + m]:
                return False
    return True


@numba.njit(cache=True, nogil=True)
def split_entries_kernel(src, key, out, ents, arrays, hashes, flat):  # pragma: no cover - compiled
    """Returns ``(status, out_len, n_arrays, n_entries, hash_bytes, n_tokens)``.

    ``status`` 0: done; 1: a backslash somewhere (escapes could spell a key differently);
    2: an ``"entries"`` value this pass does not take (see the module docstring); 3: an
    output buffer is too small. Nonzero means the caller parses the body as it is.
    ``arrays[k]`` is the first entry row of array ``k`` (``arrays[n_arrays]`` the end);
    ``ents`` has one row of ``NCOLS`` per entry, in document order.
    """
    n = src.shape[0]
    if n == 0 or src[n - 1] != _RBRACE:
        return 2, 0, 0, 0, 0, 0  # not a JSON object ending the body (the scans below rely on it)
    i = 0
    o = 0
    copied = 0
    k = 0
    e = 0
    h = 0
    t = 0
    max_arrays = arrays.shape[0] - 1
    max_entries = ents.shape[0]
    while True:
        status, p = next_key_value(src, i, n, key)
        if status == 4:
            break
        if status != 0:
            return status, 0, 0, 0, 0, 0
        if p >= n or src[p] != _OPEN:
            return 2, 0, 0, 0, 0, 0
        arr_start = p
        if k >= max_arrays:
            return 3, 0, 0, 0, 0, 0
        arrays[k] = e
        first = e
        p = _skip_ws(src, p + 1, n)
        if p < n and src[p] == _CLOSE:
            p += 1
        else:
            while True:
                if e >= max_entries:
                    return 3, 0, 0, 0, 0, 0
                row = ents[e]
                p, hb, t = _entry(src, p, n, row, hashes, h, flat, t)
                if p < 0:
                    return 2, 0, 0, 0, 0, 0
                h += hb
                row[C_SAME_SCOPE] = 1 if e > first and _same_scope(src, ents[e - 1], row) else 0
                e += 1
                p, closed = _after_value(src, p, n, _CLOSE)
                if p < 0:
                    return 2, 0, 0, 0, 0, 0
                if closed:
                    break
                p = _skip_ws(src, p, n)
        o = copy_before(src, copied, arr_start, out, o)
        if o < 0:
            return 3, 0, 0, 0, 0, 0
        o = write_ordinal(out, o, k)
        copied = p
        k += 1
        i = p
    arrays[k] = e
    o = copy_tail(src, copied, n, out, o)
    if o < 0:
        return 3, 0, 0, 0, 0, 0
    return 0, o, k, e, h, t
