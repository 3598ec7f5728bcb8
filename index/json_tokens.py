"""Decode a cache-event JSON document with its ``token_ids`` lists parsed in one native pass.

Question answered: "how do LMCache's JSON records (256 token ids per entry, as decimal
text) decode at 100k+ entries/s?" A generic JSON parser builds one Python int per token
(measured here: ``pydantic_core.from_json`` about 30k entries/s of 256 ids on a loaded
2-core box, ``json.loads`` half that), and then the ingest packs them again into uint32.
:func:`decode_event_json` instead scans the bytes once in a numba kernel: every
``"token_ids": [...]`` list (outside strings) is parsed straight into one uint32 buffer and
replaced, in a copy of the text, by its ordinal; the remaining small document goes to
``from_json``; each ordinal is swapped back for its array (the ingest's packed path takes
uint32 arrays as they are).

Exactness: the result equals ``from_json(raw)`` except that token lists are uint32 arrays.
Anything the kernel does not handle as a strict JSON integer list of ids in 0..2^32-1
(a sign, a fraction, an exponent, a leading zero, a value over 2^32-1, a malformed list)
makes it give up, and the whole document goes through ``from_json`` unchanged, so errors
are reported exactly as before. The ordinals are checked on the way back (each exactly
once, in order, only where a list was); a document whose own ``token_ids`` is an integer
fails that check and also takes the plain path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit
from pydantic_core import from_json

__all__ = ["decode_event_json"]

_KEY = np.frombuffer(b'"token_ids"', dtype=np.uint8)
_MAX_ID = 0xFFFFFFFF


@njit(cache=True, nogil=True)
def _scan(b, key, out, toks, ends):  # pragma: no cover - compiled; exercised through decode_event_json
    """-> (bytes written to out, lists found) or (-1, 0) to give up. ``ends[k]`` is the
    token count after list k."""
    n = b.shape[0]
    klen = key.shape[0]
    i = 0
    o = 0
    nt = 0
    nl = 0
    while i < n:
        c = b[i]
        if c == 34:  # a string starts
            is_key = i + klen <= n
            if is_key:
                for k in range(klen):
                    if b[i + k] != key[k]:
                        is_key = False
                        break
            if not is_key:  # copy the string through its closing quote
                out[o] = c
                o += 1
                i += 1
                while i < n:
                    d = b[i]
                    out[o] = d
                    o += 1
                    i += 1
                    if d == 92:  # backslash: the next byte is escaped
                        if i < n:
                            out[o] = b[i]
                            o += 1
                            i += 1
                    elif d == 34:
                        break
                continue
            for k in range(klen):
                out[o] = b[i + k]
                o += 1
            i += klen
            j = i
            while j < n and (b[j] == 32 or b[j] == 9 or b[j] == 10 or b[j] == 13):
                j += 1
            if j >= n or b[j] != 58:  # not followed by ':' -> it was a value; go on after it
                continue
            j += 1
            while j < n and (b[j] == 32 or b[j] == 9 or b[j] == 10 or b[j] == 13):
                j += 1
            if j >= n or b[j] != 91:  # the value is not a list: copy as is
                for k in range(i, j):
                    out[o] = b[k]
                    o += 1
                i = j
                continue
            j += 1
            while j < n and (b[j] == 32 or b[j] == 9 or b[j] == 10 or b[j] == 13):
                j += 1
            if j < n and b[j] == 93:  # an empty list stays in the text
                out[o] = 58
                out[o + 1] = 91
                out[o + 2] = 93
                o += 3
                i = j + 1
                continue
            while True:  # integers, commas, whitespace, then ']'
                if j >= n:
                    return -1, 0
                d = b[j]
                if d < 48 or d > 57:
                    return -1, 0
                if d == 48 and j + 1 < n and 48 <= b[j + 1] <= 57:
                    return -1, 0  # a leading zero is not JSON
                v = 0
                while j < n and 48 <= b[j] <= 57:
                    v = v * 10 + (b[j] - 48)
                    if v > 4294967295:
                        return -1, 0
                    j += 1
                toks[nt] = v
                nt += 1
                while j < n and (b[j] == 32 or b[j] == 9 or b[j] == 10 or b[j] == 13):
                    j += 1
                if j >= n:
                    return -1, 0
                if b[j] == 44:
                    j += 1
                    while j < n and (b[j] == 32 or b[j] == 9 or b[j] == 10 or b[j] == 13):
                        j += 1
                    continue
                if b[j] == 93:
                    j += 1
                    break
                return -1, 0
            ends[nl] = nt
            out[o] = 58  # ':' then the ordinal
            o += 1
            x = nl
            start = o
            while True:
                out[o] = 48 + x % 10
                o += 1
                x //= 10
                if x == 0:
                    break
            lo = start
            hi = o - 1
            while lo < hi:
                t = out[lo]
                out[lo] = out[hi]
                out[hi] = t
                lo += 1
                hi -= 1
            nl += 1
            i = j
            continue
        out[o] = c
        o += 1
        i += 1
    return o, nl


def _attach(doc: Any, arrays: list[np.ndarray]) -> bool:
    """Swap the ordinals back for the arrays; False when the document is not shaped as
    expected (each ordinal once, in order, under entries' ``token_ids``)."""
    if type(doc) is not dict or type(doc.get("batches")) is not list:
        return False
    k = 0
    for batch in doc["batches"]:
        if type(batch) is not dict:
            return False
        entries = batch.get("entries", ())
        if type(entries) is not list:
            return False
        for e in entries:
            if type(e) is not dict:
                return False
            t = e.get("token_ids")
            if type(t) is int:
                if t != k:
                    return False
                e["token_ids"] = arrays[k]
                k += 1
    return k == len(arrays)


def decode_event_json(raw: bytes) -> Any:
    """``from_json(raw)`` with ``token_ids`` lists as read-only uint32 arrays (see the
    module docstring). Raises ``ValueError`` exactly as ``from_json`` does."""
    b = np.frombuffer(raw, dtype=np.uint8)
    n = b.shape[0]
    if n < 16 or raw.find(b'"token_ids"') < 0:
        return from_json(raw)
    # each list costs at least 15 input bytes (key, colon, brackets, one id) and an ordinal
    # of at most 9 digits replaces at least 3 of them: the copy grows by less than half
    out = np.empty(n + n // 2 + 16, dtype=np.uint8)
    toks = np.empty(n // 2 + 1, dtype=np.uint32)
    ends = np.empty(n // 4 + 1, dtype=np.int64)
    written, lists = _scan(b, _KEY, out, toks, ends)
    if written < 0 or lists == 0:
        return from_json(raw)
    doc = from_json(out[:written].tobytes())
    bounds = ends[:lists].tolist()
    starts = [0] + bounds[:-1]
    flat = toks[:bounds[-1]]
    flat.flags.writeable = False
    arrays = [flat[a:z] for a, z in zip(starts, bounds)]
    if not _attach(doc, arrays):
        return from_json(raw)
    return doc
