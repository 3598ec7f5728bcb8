"""The occupancy bits: one bit per slot, set iff the slot is not empty, in front of the table.

Question answered: "is this slot empty?" from a structure small enough to stay in a core's
L2 cache while the slot table does not.

Why: the host probe reads one random byte of the slot table per window. At 200k chunks the
table is 4 MiB, at 1M 16 MiB: larger than the 2 MiB L2 of the machines this runs on, so
most reads wait for L3 or memory, and a window cost 5-6 ns where hashing it costs 2. The
bits are an eighth of the table (512 KiB at 200k chunks, 2 MiB at 1M) and, at the table's
load of 1/16 or less, send only about 6% of windows on to the table. The filter's answer
is unchanged: a window whose slot is empty fails ``slot == tag or slot == 255`` anyway
(tags are 1..254), so skipping the table for it changes no candidate.

Layout: ``words[s >> 6] >> (s & 63) & 1`` for slot ``s``; ``ceil(size / 64)`` uint64 words.
Whoever writes the table writes the bits in the same call (``index/slots.py``), a rebuild
swaps both together. A reader holding a table and its words from one
``SlotSource.filter_arrays`` read sees, for each slot, a state the writer passed through:
an insert writes the byte before the bit, a clear writes the byte to 0 (either order of
the two reads then answers "no candidate", which is the slot's state before or after).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["occupancy_words", "set_bit", "clear_bit", "is_occupied"]


@numba.njit(inline="always", nogil=True)
def set_bit(words, s):  # pragma: no cover - compiled
    """Mark slot ``s`` occupied."""
    words[s >> 6] |= np.uint64(1) << np.uint64(s & 63)


@numba.njit(cache=True, nogil=True)
def _words_nb(table):  # pragma: no cover - compiled
    words = np.zeros((table.shape[0] + 63) >> 6, dtype=np.uint64)
    for s in range(table.shape[0]):
        if table[s] != 0:
            set_bit(words, s)
    return words


def occupancy_words(table: np.ndarray) -> np.ndarray:
    """The occupancy bits of a uint8 slot table (a full pass: test sources and new tables)."""
    return _words_nb(np.ascontiguousarray(table, dtype=np.uint8))


@numba.njit(inline="always", nogil=True)
def clear_bit(words, s):  # pragma: no cover - compiled
    """Mark slot ``s`` empty."""
    words[s >> 6] &= ~(np.uint64(1) << np.uint64(s & 63))


@numba.njit(inline="always", nogil=True)
def is_occupied(words, s):  # pragma: no cover - compiled
    """Whether slot ``s`` (a non-negative int64) is marked occupied."""
    return (words[s >> 6] >> np.uint64(s & 63)) & np.uint64(1) != np.uint64(0)
