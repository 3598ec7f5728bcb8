"""The ``token_ids`` splitter behind ``tokens.split_token_arrays`` (numba, ``nogil``).

Private to ``index/tokens.py`` (imported on first use). One pass over a JSON body: every
array that is the value of a ``"token_ids"`` key is parsed straight into one uint32 buffer
(no Python int per token) and cut out of the text, which then holds a short placeholder in
its place (see ``tokens.split_token_arrays`` for the contract and why it is exact).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

__all__ = ["split_token_arrays_kernel", "KEY", "next_key_value", "copy_before", "write_ordinal", "copy_tail",
           "token_array"]

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

# The eight-digit step of token_array (SWAR: eight bytes of text in one uint64 register).
_SW_ADD = np.uint64(0x4646464646464646)  # a byte above '9' gets its high bit set by the add
_SW_ZEROS = np.uint64(0x3030303030303030)  # a byte below '0' by the subtraction
_SW_HIGH = np.uint64(0x8080808080808080)
_SW_PAIRS = np.uint64(0x000000FF000000FF)
_SW_MUL1 = np.uint64(100 + (1_000_000 << 32))
_SW_MUL2 = np.uint64(1 + (10_000 << 32))


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


@intrinsic
def _load_u64(typingctx, arr, idx):  # pragma: no cover - compiled
    """Eight bytes of a uint8 array from ``idx`` as one little-endian uint64, unaligned (the
    caller checks ``idx + 8 <= len``): what C does with ``memcpy`` into a ``uint64_t``."""
    sig = types.uint64(arr, types.intp)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)

    return sig, codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _skip_ws(src, p, n):  # pragma: no cover - compiled
    while p < n and _ws(src[p]):
        p += 1
    return p


@numba.njit(cache=True, nogil=True)
def _one_id(src, p, n, flat, t):  # pragma: no cover - compiled
    """The id at ``p`` into ``flat[t]``, a digit at a time: the end, or -1 for no digit,
    more than 10, a leading zero or a value past 2^32-1."""
    q = p
    v = np.uint64(0)
    while p < n and _ZERO <= src[p] <= _NINE:
        if p - q == 10:
            return -1
        v = v * np.uint64(10) + np.uint64(src[p] - _ZERO)
        p += 1
    if p == q or v > np.uint64(_MAX_ID) or (src[q] == _ZERO and p - q > 1):
        return -1
    flat[t] = np.uint32(v)
    return p


@numba.njit(cache=True, nogil=True)
def token_array(src, p, n, flat, t):  # pragma: no cover - compiled
    """The ids of one token array (``p`` just past its ``[``) into ``flat`` from ``t``:
    ``(end just past the ]), t)``, ``(-1, t)`` for anything but decimal integers in
    0..2^32-1 (a float, a sign, a leading zero, ``null``, a trailing comma, an unclosed
    array), ``(-2, t)`` when ``flat`` is full. The one token-id rule of both splitters.

    Why eight bytes at a time: the hot loop of both passes (256 ids per event entry,
    8,192 per lookup). An id of up to seven digits is read with one unaligned load, its
    length found from the first byte that is not a digit (one bit trick, one
    trailing-zero count) and its value computed with three multiplications, and the byte
    after it is already in the register: no loop per digit, and no branch on the length
    that the CPU could mispredict. Measured on 64-entry bodies: 7.4 -> 4.5 ns per id
    (``docs/performance.md``). Longer ids and the last 7 bytes of a body go a digit at a
    time (``_one_id``); both ways give the same ids and the same refusals
    (``tests/test_token_split.py``, ``tests/test_wire_scan.py``)."""
    p = _skip_ws(src, p, n)
    if p < n and src[p] == _CLOSE:
        return p + 1, t
    cap = flat.shape[0]
    while True:
        if t >= cap:
            return -2, t
        x = np.uint64(0)
        nd = np.uint64(0)  # high bit of each byte of x that is not a digit
        if p + 8 <= n:
            x = _load_u64(src, p)
            nd = ((x + _SW_ADD) | (x - _SW_ZEROS)) & _SW_HIGH
        if nd != np.uint64(0):
            k = np.uint64(trailing_zeros(nd)) >> np.uint64(3)  # digits before the first other byte
            if k == np.uint64(0):  # whitespace after a comma, or not an id
                if not _ws(src[p]):
                    return -1, t
                p = _skip_ws(src, p + 1, n)
                continue
            if k > np.uint64(1) and (x & np.uint64(0xFF)) == np.uint64(_ZERO):
                return -1, t  # a leading zero: not JSON
            # the k digits moved to the top bytes (zeros above them), then summed pairwise
            y = (x - _SW_ZEROS) << ((np.uint64(8) - k) << np.uint64(3))
            y = y * np.uint64(10) + (y >> np.uint64(8))
            flat[t] = np.uint32((((y & _SW_PAIRS) * _SW_MUL1) + (((y >> np.uint64(16)) & _SW_PAIRS) * _SW_MUL2))
                                >> np.uint64(32))
            t += 1
            p += np.intp(k)
            if (x >> (k << np.uint64(3))) & np.uint64(0xFF) == np.uint64(_COMMA):
                p += 1
                continue
        else:  # eight digits or more, or near the end of the body
            p = _one_id(src, _skip_ws(src, p, n), n, flat, t)
            if p < 0:
                return -1, t
            t += 1
        p = _skip_ws(src, p, n)
        if p >= n:
            return -1, t
        c = src[p]
        if c == _CLOSE:
            return p + 1, t
        if c != _COMMA:
            return -1, t  # '.', 'e', '-', anything else: not a plain integer list
        p += 1


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
        p, t = token_array(src, p, n, flat, t)
        if p < 0:
            return 2 if p == -1 else 3, 0, 0, 0
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
