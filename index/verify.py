"""Verification: which probe candidates are matches, under LMCache 0.5.6's per-position rule.

Question answered: "given the windows the engine kept, which (position, chunk hash) pairs
does a query get?" Runs under the blend index's lock (``blend_index.py`` holds it and passes
its columns: contents -> first occupant, occupant -> next occupant and first claim, claim ->
namespace and next claim; tokens in blocks). The rule, per query, positions ascending: at
each position whose window has the tokens of an indexed content, the first occupant of that
content (first-indexed order) that the requester claims and that this query has not taken
yet is the match, and the walk moves on; so at most one match per position and no chunk hash
twice in a query.

Time and memory are linear in candidates plus occupants (before this rule, one chunk stored under
1,000 chunk hashes and a 10,000-token query of it took 6.4 s and 1.7 GB when every
(position, occupant) pair was materialised): per query, each content keeps a cursor into its
occupant list that only moves forward, tokens are compared once per candidate, and only
matches are written out. ``MatchStats.occupant_steps`` counts the occupants visited, so a
test can tell linear from quadratic without a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np

__all__ = ["NO_KEYS", "MatchStats", "hash_keys", "per_position_rule"]

_TAKEN = -1  # verification cursor: every claimed occupant of this content is taken
_UNSEEN = -3  # verification cursor: content not met yet in this query
_UNCLAIMED = -4  # verification cursor: the requester claims no occupant of this content

#: ``per_position_rule``'s ``key_of`` when "taken" goes by occupant id (``exact`` false).
NO_KEYS = np.zeros(0, dtype=np.int64)


@dataclass
class MatchStats:
    """What one ``match_batch`` did (for metrics and the benchmark)."""

    queries: int = 0
    tokens: int = 0
    windows: int = 0
    survivors: int = 0  # candidates the engine returned
    dict_misses: int = 0  # survivors whose fingerprint is not indexed (filter false positives)
    ns_filtered: int = 0  # survivors skipped: no occupant claimed by the requester
    token_rejections: int = 0  # same fingerprint, different tokens
    matches: int = 0
    occupant_steps: int = 0  # occupants visited by the per-position rule (linear: see per_position_rule)
    reprobes: int = 0  # probes run again: slot writes happened while the probe ran (blend_index._match)
    engine_s: float = 0.0
    verify_s: float = 0.0
    engine_name: str = ""
    engine_timings: dict[str, float] = field(default_factory=dict)


@numba.njit(cache=True, nogil=True)
def _claimed(occ, ns, o_claim, k_ns, k_next):  # pragma: no cover - compiled
    k = o_claim[occ]
    while k >= 0:
        if k_ns[k] == ns:
            return True
        k = k_next[k]
    return False


#: An empty slot of a per-query table (keys are content rows and occupant ids, never negative).
_EMPTY = -1


@numba.njit(cache=True, nogil=True, inline="always")
def _slot(key, mask):  # pragma: no cover - compiled
    """Fibonacci hashing: content rows and occupant ids are small consecutive integers, and
    the high bits of their product spread them over the table."""
    return np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)) & mask


@numba.njit(cache=True, nogil=True, inline="always")
def _get(keys, vals, mask, key, default):  # pragma: no cover - compiled
    i = _slot(key, mask)
    while True:
        k = keys[i]
        if k == key:
            return vals[i]
        if k == _EMPTY:
            return default
        i = (i + 1) & mask


@numba.njit(cache=True, nogil=True, inline="always")
def _put(keys, vals, mask, key, val, used, n_used):  # pragma: no cover - compiled
    """Set ``key`` to ``val``; a new key's slot is noted in ``used`` (so the table is emptied
    in time linear in what was put, not in its size). Returns the new count of ``used``."""
    i = _slot(key, mask)
    while True:
        k = keys[i]
        if k == key:
            vals[i] = val
            return n_used
        if k == _EMPTY:
            keys[i] = key
            vals[i] = val
            used[n_used] = i
            return n_used + 1
        i = (i + 1) & mask


@numba.njit(cache=True, nogil=True)
def _first_claimed(occ, ns, o_next, o_claim, k_ns, k_next, key_of, seen, mask, exact):  # pragma: no cover - compiled
    """From occupant ``occ`` on: the first one ``ns`` claims whose key is not in the table
    ``seen`` (-1 if none), and how many occupants were visited."""
    steps = 0
    while occ >= 0:
        steps += 1
        if _claimed(occ, ns, o_claim, k_ns, k_next):
            key = key_of[occ] if exact else occ
            if _get(seen, seen, mask, key, _EMPTY) == _EMPTY:
                return occ, steps
        occ = np.int64(o_next[occ])
    return np.int64(-1), steps


@numba.njit(cache=True, nogil=True)
def _table_size(cq, rows):  # pragma: no cover - compiled
    """A power of two at least twice the candidates of any one query that could enter the
    tables (indexed fingerprints): both tables stay at most half full."""
    most = 0
    run = 0
    query = -1
    for i in range(cq.shape[0]):
        if rows[i] < 0:
            continue
        if cq[i] != query:
            query = cq[i]
            run = 0
        run += 1
        most = max(most, run)
    size = 16
    while size < 2 * most:
        size *= 2
    return size


# Keeps the GIL (no ``nogil``): it runs under the index lock, and a release there handed the
# GIL to the busy event loop while the lock stayed held until it came back; ingest waited
# on that (its lock-wait p99 0.7-0.8 ms, 2-3 us since: docs/performance.md, "Lock holds on
# the lookup path"). It takes tens of microseconds a batch, less than one turn of the loop.
@numba.njit(cache=True)
def per_position_rule(cq, cst, rows, q_ns, tokens, offsets, width, blocks, shift, bmask,
               c_occ, o_next, o_claim, k_ns, k_next, key_of, exact):  # pragma: no cover - compiled
    """The per-position rule over the candidates (ascending by query, then position):
    emits ``(candidate, occupant)`` for each match, at most one per position.

    Linear in candidates plus occupants: per query, each content row keeps a cursor into its
    occupant list. An occupant passed over is either not claimed by the requester or already
    taken by this query, and both stay true for the rest of the query, so the cursor never
    moves back; tokens are compared once per candidate, never per occupant. "Taken" is by
    occupant id (``exact`` false) or by ``key_of[occupant]`` (equal for occupants with equal
    chunk hashes; the caller reruns with it when one hash occupied two contents).

    The per-query state (each content's cursor, the keys taken) lives in two open-addressing
    tables of arrays, allocated once a batch and emptied between queries by the slots they
    used: numba's typed dicts, two allocated a query, made the rule 1.5x slower."""
    n = cq.shape[0]
    cap = 64
    out_c = np.empty(cap, dtype=np.int64)
    out_o = np.empty(cap, dtype=np.int64)
    k = 0
    misses = 0
    ns_skip = 0
    rejects = 0
    steps = 0
    size = _table_size(cq, rows)
    mask = size - 1
    cursor = np.full(size, _EMPTY, dtype=np.int64)  # content row -> cursor (keys)
    at_of = np.empty(size, dtype=np.int64)  # ... and its value
    seen = np.full(size, _EMPTY, dtype=np.int64)  # keys taken by this query (a set: key is value)
    c_used = np.empty(size, dtype=np.int64)
    s_used = np.empty(size, dtype=np.int64)
    n_c = 0
    n_s = 0
    query = -1
    for i in range(n):
        row = rows[i]
        if row < 0:
            misses += 1
            continue
        q = cq[i]
        if q != query:
            query = q
            for j in range(n_c):
                cursor[c_used[j]] = _EMPTY
            for j in range(n_s):
                seen[s_used[j]] = _EMPTY
            n_c = 0
            n_s = 0
        ns = q_ns[q]
        if ns < 0:
            ns_skip += 1
            continue
        at = _get(cursor, at_of, mask, row, np.int64(_UNSEEN))
        if at == _UNSEEN:  # first candidate of this content in the query: any claim at all?
            first, walked = _first_claimed(np.int64(c_occ[row]), ns, o_next, o_claim, k_ns, k_next, key_of, seen,
                                           mask, exact)
            steps += walked
            at = first if first >= 0 else _UNCLAIMED
            if first < 0:  # nothing unseen; tell "none claimed" from "all taken"
                occ = c_occ[row]
                while occ >= 0:
                    steps += 1
                    if _claimed(occ, ns, o_claim, k_ns, k_next):
                        at = _TAKEN
                        break
                    occ = o_next[occ]
            n_c = _put(cursor, at_of, mask, row, at, c_used, n_c)
        if at == _UNCLAIMED:
            ns_skip += 1
            continue
        blk = blocks[row >> shift]
        r = row & bmask
        base = offsets[q] + cst[i]
        same = True
        for t in range(width):
            if tokens[base + t] != blk[r, t]:
                same = False
                break
        if not same:
            rejects += 1
            continue
        if at < 0:  # every claimed occupant is taken already
            continue
        occ, walked = _first_claimed(at, ns, o_next, o_claim, k_ns, k_next, key_of, seen, mask, exact)
        steps += walked
        if occ < 0:
            n_c = _put(cursor, at_of, mask, row, np.int64(_TAKEN), c_used, n_c)
            continue
        key = key_of[occ] if exact else occ
        n_s = _put(seen, seen, mask, key, key, s_used, n_s)
        n_c = _put(cursor, at_of, mask, row, np.int64(o_next[occ]), c_used, n_c)
        if k == cap:
            cap *= 2
            nc = np.empty(cap, dtype=np.int64)
            no = np.empty(cap, dtype=np.int64)
            nc[:k] = out_c[:k]
            no[:k] = out_o[:k]
            out_c, out_o = nc, no
        out_c[k] = i
        out_o[k] = occ
        k += 1
    return out_c[:k], out_o[:k], misses, ns_skip, rejects, steps


def hash_keys(rows: np.ndarray, c_occ: np.ndarray, o_next: np.ndarray, o_hash: list) -> np.ndarray:
    """Per occupant id: the first occupant id (among the contents ``rows``) with the same
    chunk hash, for ``per_position_rule(..., exact=True)``. Linear in the occupants of
    those contents."""
    key_of = np.arange(len(o_hash), dtype=np.int64)
    first: dict[bytes, int] = {}
    for row in np.unique(rows[rows >= 0]).tolist():
        occ = int(c_occ[row])
        while occ >= 0:
            key_of[occ] = first.setdefault(o_hash[occ], occ)
            occ = int(o_next[occ])
    return key_of
