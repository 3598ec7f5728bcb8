"""A ``POST /events`` body's entries as columns, straight from its bytes.

Question answered: "what do this body's entries say, without building a Python object per
field of every entry?" The first stage of ``wire.parse_event_body`` for the norm, LMCache's
STORE batches: one ``nogil`` pass (``_jsonentries.py``, numba) takes every ``"entries"``
array out of the text and parses it into columns (chunk hashes decoded from hex, integer
fields, token ids as uint32, the byte spans of model names and salts); the text left, a few
hundred bytes of batch fields with each array replaced by its ordinal, goes to the JSON
parser as before, and :func:`entry_columns` turns the columns into the very
:class:`~blendmatch.index.wire_entries.EntryColumns` the entry parser would have built
(interned scopes, validated by the same interner; equal hashes, sizes, offsets and tokens).

Why: at 64-entry batches the events thread spent about 40% of its time decoding bodies,
three quarters of it holding the GIL (``pydantic_core.from_json`` builds about 15 objects
per entry, the column checks walk them again). The pass holds no GIL, so the event loop
serves other requests meanwhile (``docs/performance.md``, "Event ingest in process").

Exact by construction: the pass takes only what it can say exactly. Anything else (a
backslash anywhere in the body, an entry field it does not know, a field given twice, a
float, ``null``, a sign other than ``token_offset: -1``, a value out of range, a token id
outside uint32, a missing required field, ``tokens_b64``, a body that does not end with
``}``) makes it give up on the whole body, and the body is parsed
as before (``tokens.split_token_arrays`` and the entry parser, with their messages);
so does a scope the interner refuses (a bad model name or salt) and a text the JSON parser
refuses. ``tests/test_wire_scan.py`` checks both paths against each other.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import repeat
from typing import Optional

import numpy as np

from .tokens import SPLIT_MIN_BYTES
from .wire_entries import _INTERN, EntryColumns, KeyScope, TokenColumn, _empty_entries

__all__ = ["EntrySplit", "entry_columns", "split_entries"]


class EntrySplit:
    """What :func:`split_entries` took out of a body: ``text`` (the body with each
    ``"entries"`` array replaced by its ordinal), the entry rows (``ents``, int64, one row
    of ``_jsonentries.NCOLS`` per entry in document order), ``arrays`` (array ``k``'s rows
    are ``arrays[k]..arrays[k+1]``), the decoded chunk hashes (``hashes``, bytes) and the
    token ids (``flat``, read-only uint32)."""

    __slots__ = ("body", "text", "ents", "arrays", "hashes", "flat")

    def __init__(self, body: bytes, text: bytes, ents: np.ndarray, arrays: np.ndarray, hashes: bytes,
                 flat: np.ndarray) -> None:
        self.body = body
        self.text = text
        self.ents = ents
        self.arrays = arrays
        self.hashes = hashes
        self.flat = flat


def split_entries(body: bytes) -> Optional[EntrySplit]:
    """The pass over ``body`` (no GIL held; no Python object per entry), or None when it
    gave up (see the module docstring) or the body is too short to be worth it."""
    n = len(body)
    if n < SPLIT_MIN_BYTES:
        return None
    from . import _jsonentries as k  # numba: loaded on first use

    src = np.frombuffer(body, dtype=np.uint8)
    out = np.empty(n + 64, dtype=np.uint8)
    ents = np.empty((n // 50 + 2, k.NCOLS), dtype=np.int64)  # an entry takes >= 58 bytes
    arrays = np.empty(n // 12 + 2, dtype=np.int64)  # '"entries":[]' is 12 bytes
    hashes = np.empty(n // 2 + 1, dtype=np.uint8)
    flat = np.empty(n // 2 + 1, dtype=np.uint32)
    status, out_len, n_arrays, n_ents, n_hash, n_tokens = k.split_entries_kernel(
        src, k.ENTRIES, out, ents, arrays, hashes, flat)
    if status != 0 or n_arrays == 0:
        return None
    ids = flat[:n_tokens].copy()
    ids.setflags(write=False)
    return EntrySplit(body, out[:out_len].tobytes(), ents[:n_ents].copy(), arrays[:n_arrays + 1].copy(),
                      hashes[:n_hash].tobytes(), ids)


def entry_columns(split: EntrySplit) -> list[EntryColumns]:
    """Each ``"entries"`` array of the split body as :class:`EntryColumns`, in ordinal order.
    Raises ``ValueError`` (or the entry parser's internal ``_Bad``) for a model name or salt
    that is not valid UTF-8 or that the interner refuses: then the caller parses the body
    as it is, so that the ordinary path names the field."""
    from . import _jsonentries as k

    ents = split.ents
    n = int(ents.shape[0])
    bounds = split.arrays.tolist()
    if not n:
        return [_empty_entries() for _ in bounds[:-1]]
    hash_lens = ents[:, k.C_HASH_LEN]
    blob = split.hashes
    width = int(hash_lens[0])
    if int(hash_lens.min()) == width == int(hash_lens.max()) and width:
        # one width (the norm): the blob as an array of fixed-size byte strings; tolist()
        # gives each as bytes, NUL bytes kept (~2 us for 64 hashes against ~7 us of slicing)
        hashes = np.frombuffer(blob, dtype=np.dtype((np.void, width)), count=n).tolist()
    else:
        starts = ents[:, k.C_HASH].tolist()
        hashes = [blob[a:a + ln] for a, ln in zip(starts, hash_lens.tolist())]
    sizes = ents[:, k.C_SIZE].tolist()
    offsets = ents[:, k.C_OFFSET].tolist()
    lengths = ents[:, k.C_NTOKENS].tolist()
    token_starts = ents[:, k.C_TOKENS]
    heads = np.flatnonzero(ents[:, k.C_SAME_SCOPE] == 0).tolist()
    scope_of = {h: _scope(split.body, ents[h]) for h in heads}
    flat = split.flat
    out: list[EntryColumns] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            out.append(_empty_entries())
            continue
        scopes = _scopes(scope_of, heads, a, b)
        lo = int(token_starts[a])
        hi = int(token_starts[b - 1]) + lengths[b - 1]
        column = TokenColumn(flat[lo:hi], lengths[a:b], [])
        out.append(EntryColumns(hashes[a:b], scopes, sizes[a:b], offsets[a:b], column))
    return out


def _scope(body: bytes, row: np.ndarray) -> KeyScope:
    """The interned scope of one entry row: validated by the entry parser's interner (a
    scope seen before was validated then; the interner raises ``_Bad`` for a bad one)."""
    from . import _jsonentries as k

    model = body[int(row[k.C_MODEL]):int(row[k.C_MODEL_END])].decode()
    salt = body[int(row[k.C_SALT]):int(row[k.C_SALT_END])].decode()
    rank, group = int(row[k.C_RANK]), int(row[k.C_GROUP])
    got = _INTERN.scopes.get((model, rank, group, salt))
    if got is not None:
        return got
    return _INTERN.scope(_INTERN.model(model), rank, group, _INTERN.salt(salt))


def _scopes(scope_of: dict[int, KeyScope], heads: list[int], a: int, b: int) -> list[KeyScope]:
    """Rows ``a..b-1``'s scopes: each row shares the scope of the run head at or before it
    (``heads`` ascending; row ``a``, an array's first row, is always one). The norm is one
    run per array."""
    first, end = bisect_left(heads, a), bisect_left(heads, b)
    out: list[KeyScope] = []
    for h, nxt in zip(heads[first:end], heads[first + 1:end] + [b]):
        out.extend(repeat(scope_of[h], nxt - h))
    return out
