"""The ``token_ids`` splitter behind ``tokens.split_token_arrays`` (numba, ``nogil``).

Private to ``index/tokens.py`` (imported on first use). One pass over a JSON body: every
array that is the value of a ``"token_ids"`` key is parsed straight into one uint32 buffer
(no Python int per token) and cut out of the text, which then holds a short placeholder in
its place (see ``tokens.split_token_arrays`` for the contract and why it is exact).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["split_token_arrays_kernel", "KEY", "next_key_value", "copy_before", "write_ordinal", "copy_tail"]

#: The key whose array values are taken out, as bytes.
KEY = np.frombuffer(b"token_ids", dtype=np.uint8).copy()

_QUOTE = 34
_BACKSLASH = 92
_COLON = 58
_COMMA = 44
_OPEN = 91
_CLOSE = 93
_ZERO = 48
_NINE = 57
_MAX_ID = 0xFFFFFFFF


@numba.njit(cache=True, nogil=True, inline="always")
def _ws(c):  # pragma: no cover - compiled
    return c == 32 or c == 10 or c == 13 or c == 9


@numba.njit(cache=True, nogil=True)
def next_key_value(src, i, n, key):  # pragma: no cover - compiled
    """From ``i``, the next object key spelled ``key`` (a string followed by ``:``, never a
    string value): ``(0, p)`` with ``p`` at its value (after whitespace), ``(1, 0)`` for a
    backslash on the way (an escape could spell the key differently), ``(2, 0)`` for an
    unterminated string, ``(4, n)`` when there is none left. The scan both kernels share."""
    klen = key.shape[0]
    while i < n:
        c = src[i]
        if c == _BACKSLASH:
            return 1, 0
        if c != _QUOTE:
            i += 1
            continue
        # a string starts at i + 1: find its end (no backslashes anywhere, so the next quote)
        j = i + 1
        while j < n and src[j] != _QUOTE:
            if src[j] == _BACKSLASH:
                return 1, 0
            j += 1
        if j >= n:
            return 2, 0  # unterminated string: the real parser names the error
        is_key_name = j - i - 1 == klen
        if is_key_name:
            for m in range(klen):
                if src[i + 1 + m] != key[m]:
                    is_key_name = False
                    break
        i = j + 1
        if not is_key_name:
            continue
        p = i
        while p < n and _ws(src[p]):
            p += 1
        if p >= n or src[p] != _COLON:
            continue  # a string value that happens to spell the key
        p += 1
        while p < n and _ws(src[p]):
            p += 1
        return 0, p
    return 4, n


@numba.njit(cache=True, nogil=True)
def copy_before(src, copied, upto, out, o):  # pragma: no cover - compiled
    """``src[copied:upto]`` (the text before a value taken out) appended to ``out`` at ``o``,
    with room left for a placeholder: the new end, or -1 when it does not fit."""
    if o + upto - copied + 24 > out.shape[0]:
        return -1
    out[o:o + upto - copied] = src[copied:upto]
    return o + upto - copied


@numba.njit(cache=True, nogil=True)
def write_ordinal(out, o, k):  # pragma: no cover - compiled
    """``k``'s decimal digits at ``out[o:]`` (the placeholder of a value taken out); the new end."""
    if k == 0:
        out[o] = _ZERO
        return o + 1
    digits = 0
    x = k
    while x > 0:
        digits += 1
        x //= 10
    x = k
    for m in range(digits - 1, -1, -1):
        out[o + m] = _ZERO + x % 10
        x //= 10
    return o + digits


@numba.njit(cache=True, nogil=True)
def copy_tail(src, copied, n, out, o):  # pragma: no cover - compiled
    """``src[copied:n]`` appended to ``out`` at ``o``: the new end, or -1 when it does not fit."""
    if n - copied + o > out.shape[0]:
        return -1
    out[o:o + n - copied] = src[copied:n]
    return o + n - copied


@numba.njit(cache=True, nogil=True)
def split_token_arrays_kernel(src, key, mode, out, flat, starts):  # pragma: no cover - compiled
    """Returns ``(status, out_len, n_arrays, n_tokens)``.

    ``status`` 0: done; 1: the body holds a backslash (escapes could spell the key
    differently), 2: a ``"token_ids"`` key whose value is not a plain array of decimal
    integers in 0..2^32-1 (a float, a sign, a leading zero, a non-array, ...), 3: an
    output buffer is too small. Nonzero means the caller must parse the body as it is.
    ``mode`` 0 writes the array's ordinal as the placeholder, 1 writes ``[]``.
    ``starts[k]`` is where array ``k``'s ids begin in ``flat`` (``starts[n_arrays]`` the end).
    """
    n = src.shape[0]
    i = 0
    o = 0  # bytes written to out
    copied = 0  # src[:copied] is already in out
    k = 0  # arrays taken
    t = 0  # tokens taken
    max_arrays = starts.shape[0] - 1
    while True:
        status, p = next_key_value(src, i, n, key)
        if status == 4:
            break
        if status != 0:
            return status, 0, 0, 0
        if p >= n or src[p] != _OPEN:
            return 2, 0, 0, 0
        arr_start = p
        p += 1
        if k >= max_arrays:
            return 3, 0, 0, 0
        starts[k] = t
        while p < n and _ws(src[p]):
            p += 1
        if p < n and src[p] == _CLOSE:
            p += 1
        else:
            while True:
                if p >= n:
                    return 2, 0, 0, 0
                d = src[p]
                if d < _ZERO or d > _NINE:
                    return 2, 0, 0, 0
                if d == _ZERO and p + 1 < n and _ZERO <= src[p + 1] <= _NINE:
                    return 2, 0, 0, 0  # leading zero: not JSON
                v = np.uint64(0)
                digits = 0
                while p < n and _ZERO <= src[p] <= _NINE:
                    v = v * np.uint64(10) + np.uint64(src[p] - _ZERO)
                    digits += 1
                    if digits > 10:
                        return 2, 0, 0, 0
                    p += 1
                if v > _MAX_ID:
                    return 2, 0, 0, 0
                if t >= flat.shape[0]:
                    return 3, 0, 0, 0
                flat[t] = np.uint32(v)
                t += 1
                while p < n and _ws(src[p]):
                    p += 1
                if p >= n:
                    return 2, 0, 0, 0
                if src[p] == _COMMA:
                    p += 1
                    while p < n and _ws(src[p]):
                        p += 1
                    continue
                if src[p] == _CLOSE:
                    p += 1
                    break
                return 2, 0, 0, 0  # '.', 'e', '-', anything else: not a plain integer list
        # copy what precedes the array, then the placeholder
        o = copy_before(src, copied, arr_start, out, o)
        if o < 0:
            return 3, 0, 0, 0
        if mode == 1:
            out[o] = _OPEN
            out[o + 1] = _CLOSE
            o += 2
        else:
            o = write_ordinal(out, o, k)
        copied = p
        k += 1
        i = p
    starts[k] = t
    o = copy_tail(src, copied, n, out, o)
    if o < 0:
        return 3, 0, 0, 0
    return 0, o, k, t
