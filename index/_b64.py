"""The strict base64 decoding kernels behind ``tokens.decode_b64_many`` (numba, ``nogil``).

Private to ``index/tokens.py``, which imports this module on first use only, so that token
*encoding* (what the client needs) never loads numba.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["B64_TABLE", "decode_segment"]


def _b64_table() -> np.ndarray:
    table = np.full(256, 255, dtype=np.uint8)
    for i, ch in enumerate(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"):
        table[ch] = i
    return table


B64_TABLE = _b64_table()


@numba.njit(cache=True, nogil=True)
def decode_segment(src, lo, hi, table, out, o):  # pragma: no cover - compiled
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
