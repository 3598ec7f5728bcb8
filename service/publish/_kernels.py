"""The ``BlockStored`` encoding kernel (numba, ``nogil``): a block of chunks in one pass.

Why: a STORE of 1,000 chunks of 256 tokens is 256,000 msgpack integers. In numpy (masks
per integer width) it cost about 20 us per chunk and held the GIL for most of it, which
halved the ingest rate beside it; this kernel writes every event of a block, hashes,
constants and tokens, without the GIL, in one pass (about 1.8 us per 256-token chunk on the
2-core dev VM).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["encode_stored_block"]


@numba.njit(cache=True, nogil=True, inline="always")
def _put_uint(out: np.ndarray, at: int, v: np.uint64) -> int:
    if v < 0x80:
        out[at] = v
        return at + 1
    if v < 0x100:
        out[at] = 0xCC
        out[at + 1] = v
        return at + 2
    if v < 0x10000:
        out[at] = 0xCD
        out[at + 1] = (v >> 8) & 0xFF
        out[at + 2] = v & 0xFF
        return at + 3
    if v < 0x100000000:
        out[at] = 0xCE
        for k in range(4):
            out[at + 1 + k] = (v >> (8 * (3 - k))) & 0xFF
        return at + 5
    out[at] = 0xCF
    for k in range(8):
        out[at + 1 + k] = (v >> (8 * (7 - k))) & 0xFF
    return at + 9


@numba.njit(cache=True, nogil=True)
def _put(out: np.ndarray, at: int, src: np.ndarray) -> int:
    for k in range(src.shape[0]):
        out[at + k] = src[k]
    return at + src.shape[0]


@numba.njit(cache=True, nogil=True)
def encode_stored_block(tokens: np.ndarray, hashes: np.ndarray, int_hashes: np.ndarray, use_int: bool,
                        head: np.ndarray, mid: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Every ``BlockStored`` of a block, concatenated: per row ``k``: ``head``, the one-hash
    array (``hashes[k]`` as msgpack bin, or ``int_hashes[k]`` as uint when ``use_int``),
    ``mid``, the token array of ``tokens[k]`` (uint32, shortest form each), ``tail``."""
    n, length = tokens.shape
    hlen = hashes.shape[1]
    if length < 16:
        arr_hdr = 1
    elif length < 0x10000:
        arr_hdr = 3
    else:
        arr_hdr = 5
    fixed = head.shape[0] + 1 + mid.shape[0] + arr_hdr + tail.shape[0]
    # one pass into a buffer of the worst case (9-byte hashes, 5-byte tokens), trimmed after
    out = np.empty(n * (fixed + 2 + max(hlen, 7) + 5 * length), dtype=np.uint8)
    at = 0
    for k in range(n):
        at = _put(out, at, head)
        out[at] = 0x91  # one block hash
        at += 1
        if use_int:
            at = _put_uint(out, at, np.uint64(int_hashes[k]))
        else:
            out[at] = 0xC4
            out[at + 1] = hlen
            at += 2
            for j in range(hlen):
                out[at + j] = hashes[k, j]
            at += hlen
        at = _put(out, at, mid)
        if length < 16:
            out[at] = 0x90 | length
            at += 1
        elif length < 0x10000:
            out[at] = 0xDC
            out[at + 1] = length >> 8
            out[at + 2] = length & 0xFF
            at += 3
        else:
            out[at] = 0xDD
            for b in range(4):
                out[at + 1 + b] = (length >> (8 * (3 - b))) & 0xFF
            at += 5
        for j in range(length):
            at = _put_uint(out, at, np.uint64(tokens[k, j]))
        at = _put(out, at, tail)
    return out[:at]
