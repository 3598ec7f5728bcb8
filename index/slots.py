"""The slot array: a one-byte-per-slot occupancy filter in front of the exact index.

Question answered: "could this window's fingerprint be in the index?" cheaply enough to
ask for every window of every query, on a CPU or mirrored on a GPU.

Layout (what engines probe; ``docs/architecture.md``): ``2^k`` slots of one byte, ``2^k >= 16 x live fingerprints``
(min 1024). A slot is ``0`` empty, ``1..254`` the tag of the single fingerprint that lives
there, or ``255`` shared (two or more fingerprints, or stale after a removal from a shared
slot). A window survives iff ``slot == tag(F)`` or ``slot == 255`` (``fingerprint.py``
derives slot and tag).

Invariants:
- Recall is complete: a slot never hides a live fingerprint; a second arrival makes it 255.
- A tagged slot holds exactly one live fingerprint, so removing that fingerprint may clear
  it. A shared slot stays 255 until a rebuild (it is counted as possibly stale).
- ``filter="occupancy"`` writes 255 for every occupied slot: LMCache's identity-free 0/1
  filter, same probe rule; removals never clear (they cannot know the slot is free).
- Callers remove only fingerprints they inserted and have not removed since.

Engines mirror this host copy (the truth). Every slot write bumps ``version`` and appends
``(slot, value)`` to the change log; a rebuild bumps ``generation``. An engine syncs with
:meth:`SlotArray.changes_since` (a small scatter) or, on a new generation or when the log
was trimmed past its version, with a full upload of :attr:`SlotArray.table`.

Occupancy bits (``gpu/occupancy.py``): beside the table, one bit per slot, set iff the slot
is not empty, written in the same compiled loop as the byte. Host probes test the bit first
and read the table only for occupied slots: the bits are an eighth of the table and stay in
a core's L2 where the table does not. :attr:`filter_arrays` is the pair, swapped as one tuple
on a rebuild.

Thread safety: mutations and :meth:`changes_since` take an internal lock, so an engine may
sync while writers run. Readers (probes) read :attr:`table` or :attr:`filter_arrays`
without the lock; byte writes are atomic, an insert writes its byte before its bit, and a
rebuild swaps in new arrays, so a probe sees either state of each slot.
"""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, NamedTuple, Optional

import numba
import numpy as np

from blendmatch.gpu import SlotChanges
from blendmatch.gpu.fingerprint import mix64_scalar, tag_of_mixed
from blendmatch.gpu.occupancy import clear_bit, occupancy_words, set_bit

from .storage import prefault

__all__ = ["FilterMode", "RebuiltTable", "SlotArray", "SlotChanges", "MIN_TABLE_SIZE", "LOAD_RATIO"]

FilterMode = Literal["tagged", "occupancy"]

#: Smallest table. 1 KiB: small enough to be free, large enough that tiny indexes never resize.
MIN_TABLE_SIZE = 1024
#: Slots per live fingerprint, at least. At 1/16 load the tagged filter passes about
#: load/254 + load^2/2 ~ 0.2% of no-hit windows; each doubling of this halves that and
#: costs one more byte per 16 chunks... per chunk: ``LOAD_RATIO`` bytes (16-32 B/chunk).
LOAD_RATIO = 16


_HUGE_PAGE = 2 << 20


def _alloc_table(size: int) -> np.ndarray:
    """A zeroed uint8 table of ``size`` slots, backed by transparent huge pages when the OS
    offers them and the table spans at least one.

    Every probe is a random byte read, so with 4 KiB pages a 16 MiB table (1M chunks) also
    misses the TLB on most reads; 2 MiB pages cover it with 8 entries. Measured here at 1M
    chunks, 64 x 32K-token batches: 87-93M windows/s with small pages, 103-107M with huge
    pages. An anonymous mapping is zero-filled; the 2 MiB-aligned slice keeps the mapping
    alive through the array's base.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or size < _HUGE_PAGE:
        return np.zeros(size, dtype=np.uint8)
    try:
        mm = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(advice)
    except (OSError, ValueError, AttributeError):
        return np.zeros(size, dtype=np.uint8)
    buf = np.frombuffer(mm, dtype=np.uint8)
    start = (-buf.ctypes.data) % _HUGE_PAGE
    return buf[start:start + size]


#: The one thread that maps and faults in a table ahead of its growth
#: (:meth:`SlotArray.prepare_growth`). Not the token blocks' thread: a 64 MiB table took
#: 0.1-0.2 s to fault in on this project's VMs, which no token block should wait behind.
_TABLES = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blendmatch-tables")

#: A table's successor is prepared once the fingerprints are within 1/AHEAD_SHARE of the
#: growth point: at 250k new chunks/s a 2M-chunk table's last 1/32 takes 0.25 s, more than
#: its 64 MiB successor takes to fault in here. Held that long only (or while the index
#: stays within that share of the point): not counted in :attr:`SlotArray.nbytes`.
AHEAD_SHARE = 32

#: Smallest successor prepared ahead: below it a table is cheap to fault in where it is built.
AHEAD_MIN_SIZE = 1 << 20


def _faulted_in(size: int) -> tuple[np.ndarray, np.ndarray]:
    """A zeroed table of ``size`` slots and its zeroed occupancy words, every page faulted
    in (:func:`storage.prefault`, without the GIL): what a build into fresh memory spends
    most of its time on at millions of chunks (237 ms at 2.1M fingerprints here, 72 ms of
    it the inserts)."""
    table = _alloc_table(size)
    words = np.zeros((size + 63) >> 6, dtype=np.uint64)
    prefault(table)
    prefault(words.view(np.uint8))
    return table, words


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


@numba.njit(cache=True, nogil=True)
def _insert_nb(table, words, mask, fps, occupancy):  # pragma: no cover - compiled
    n = fps.shape[0]
    out_s = np.empty(n, dtype=np.int64)
    out_v = np.empty(n, dtype=np.uint8)
    k = 0
    new_shared = 0
    for i in range(n):
        m = mix64_scalar(fps[i])
        s = np.int64(m & np.uint64(mask))
        cur = table[s]
        if occupancy or cur != 0:
            new = np.uint8(255)
        else:
            new = tag_of_mixed(m)
        if new != cur:
            table[s] = new
            set_bit(words, s)  # after the byte: a reader that sees the bit sees the byte
            out_s[k] = s
            out_v[k] = new
            k += 1
            if new == 255:
                new_shared += 1
    return out_s[:k], out_v[:k], new_shared


@numba.njit(cache=True, nogil=True)
def _remove_nb(table, words, mask, fps, occupancy):  # pragma: no cover - compiled
    n = fps.shape[0]
    out_s = np.empty(n, dtype=np.int64)
    out_v = np.empty(n, dtype=np.uint8)
    k = 0
    stale = 0
    for i in range(n):
        m = mix64_scalar(fps[i])
        s = np.int64(m & np.uint64(mask))
        cur = table[s]
        if not occupancy and cur == tag_of_mixed(m):
            table[s] = 0
            clear_bit(words, s)
            out_s[k] = s
            out_v[k] = 0
            k += 1
        else:
            stale += 1
    return out_s[:k], out_v[:k], stale


class RebuiltTable(NamedTuple):
    """A filled table and its bits from :meth:`SlotArray.build`, before it is adopted."""

    table: np.ndarray
    words: np.ndarray
    live: int
    shared: int


class SlotArray:
    """The host copy of the slot array plus its change log (see the module docstring)."""

    def __init__(self, filter: FilterMode = "tagged", min_size: int = MIN_TABLE_SIZE) -> None:
        if filter not in ("tagged", "occupancy"):
            raise ValueError(f"filter must be 'tagged' or 'occupancy', got {filter!r}")
        if min_size < 1 or min_size & (min_size - 1):
            raise ValueError(f"min_size must be a power of two >= 1, got {min_size}")
        self.filter: FilterMode = filter
        self.min_size = min_size
        self.floor_size = 0  # set by a reservation: never shrink below it
        self._occupancy = filter == "occupancy"
        self._lock = threading.Lock()
        table = np.zeros(min_size, dtype=np.uint8)
        #: ``(table, occupancy words)``: the one stored pair, replaced whole by a rebuild
        self.filter_arrays: tuple[np.ndarray, np.ndarray] = (table, occupancy_words(table))
        self.generation = 0
        self.version = 0
        self.live = 0  # fingerprints currently inserted
        self.shared = 0  # slots that became 255 since the last rebuild
        self.stale = 0  # removals that could not clear their slot since the last rebuild
        self._log_base = 0  # version before the first logged change
        self._log_s: list[np.ndarray] = []
        self._log_v: list[np.ndarray] = []
        self._log_len = 0
        #: ``(size, future of its faulted-in arrays)``: the next growth's table, being prepared
        self._ahead: Optional[tuple[int, Future]] = None

    # -- reading -------------------------------------------------------------------------
    @property
    def table(self) -> np.ndarray:
        """The live uint8 table (read only; a rebuild swaps in a new one)."""
        return self.filter_arrays[0]

    @property
    def size(self) -> int:
        return int(self.table.shape[0])

    @property
    def mask(self) -> int:
        return self.size - 1

    @property
    def nbytes(self) -> int:
        """Bytes held: the table and its occupancy bits."""
        table, words = self.filter_arrays
        return int(table.nbytes) + int(words.nbytes)

    def changes_since(self, generation: int, version: int) -> SlotChanges:
        """Changes that bring a mirror at ``(generation, version)`` up to date."""
        with self._lock:
            full = generation != self.generation or version < self._log_base or version > self.version
            if full or version == self.version:
                empty = np.zeros(0, dtype=np.int64)
                return SlotChanges(self.generation, self.version, full, self.table, empty, empty.astype(np.uint8))
            if len(self._log_s) > 1:  # consolidate once so later readers pay nothing
                self._log_s = [np.concatenate(self._log_s)]
                self._log_v = [np.concatenate(self._log_v)]
            start = version - self._log_base
            return SlotChanges(self.generation, self.version, False, self.table,
                               self._log_s[0][start:].copy(), self._log_v[0][start:].copy())

    def stats(self) -> dict[str, float | int | str]:
        return {
            "filter": self.filter,
            "table_size": self.size,
            "table_load": self.live / self.size,
            "table_shared_slots": self.shared,
            "table_stale_removals": self.stale,
            "table_generation": self.generation,
            "table_version": self.version,
        }

    # -- writing (callers hold the index lock; the slot lock guards the log) ---------------
    def insert(self, fps: np.ndarray) -> None:
        """Insert fingerprints (uint64) that are not in the table yet."""
        fps = np.ascontiguousarray(fps, dtype=np.uint64)
        if fps.size == 0:
            return
        with self._lock:
            s, v, new_shared = _insert_nb(*self.filter_arrays, self.mask, fps, self._occupancy)
            self.live += int(fps.size)
            self.shared += int(new_shared)
            self._append_log(s, v)

    def remove(self, fps: np.ndarray) -> None:
        """Remove fingerprints (uint64) previously inserted and still live."""
        fps = np.ascontiguousarray(fps, dtype=np.uint64)
        if fps.size == 0:
            return
        with self._lock:
            s, v, stale = _remove_nb(*self.filter_arrays, self.mask, fps, self._occupancy)
            self.live -= int(fps.size)
            self.stale += int(stale)
            self._append_log(s, v)

    def wanted_size(self, live: int) -> int:
        """The table size a rebuild for ``live`` fingerprints gets: the power of two ``>= 16*live``
        next growth is a doubling away."""
        return max(self.min_size, self.floor_size, _next_pow2(LOAD_RATIO * max(live, 1)))

    def needs_rebuild(self, extra: int = 0) -> bool:
        """Too full, far too empty, or too many stale/shared slots to keep the filter sharp;
        with ``extra``: too full once ``extra`` more fingerprints are inserted."""
        size = self.size
        if (self.live + extra) * LOAD_RATIO > size:
            return True
        if extra:
            return False
        if size > max(self.min_size, self.floor_size) and self.live * LOAD_RATIO * 8 < size:
            return True
        return self.stale > max(1024, self.live // 4)

    def prepare_growth(self, extra: int = 0) -> None:
        """Writer side, with ``extra`` fingerprints about to be inserted and no rebuild due:
        once within 1/:data:`AHEAD_SHARE` of the growth point, start preparing the table the
        growth will build (on :data:`_TABLES`), so that :meth:`build` writes into memory
        already faulted in instead of faulting it in on the writer's thread. Dropped again
        if the index falls back out of that share before growing."""
        size = self.size
        at_growth = size // LOAD_RATIO  # fingerprints the table holds before it must grow
        if (self.live + extra) * AHEAD_SHARE < at_growth * (AHEAD_SHARE - 1):
            self._ahead = None
            return
        nxt = self.wanted_size(at_growth + 1)
        if nxt < AHEAD_MIN_SIZE or nxt <= size or (self._ahead is not None and self._ahead[0] == nxt):
            return
        try:
            self._ahead = (nxt, _TABLES.submit(_faulted_in, nxt))
        except RuntimeError:  # the interpreter is shutting down: the growth faults it in itself
            self._ahead = None

    def _take_ahead(self, size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The prepared table if it has ``size`` slots (waiting for it if it is still being
        faulted in), else None; either way nothing stays prepared."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != size:
            return None
        try:
            return ahead[1].result()
        except Exception:  # noqa: BLE001 - the mapping failed there: build into fresh memory here
            return None

    def rebuild(self, live_fps: np.ndarray, size: int | None = None) -> None:
        """Re-size and re-fill from the complete set of live fingerprints (new generation)."""
        self.adopt(self.build(live_fps, size))

    def build(self, live_fps: np.ndarray, size: int | None = None) -> RebuiltTable:
        """A rebuilt table for ``live_fps``, not yet in use: nothing a probe reads changes, so
        a caller builds it without the index's write lock and :meth:`adopt` it under it
        (a refill at 131-262k chunks held it 4-10 ms in process, up to 15 in the service)."""
        live_fps = np.ascontiguousarray(live_fps, dtype=np.uint64)
        new_size = self.wanted_size(int(live_fps.size)) if size is None else size
        if new_size < 1 or new_size & (new_size - 1):
            raise ValueError(f"table size must be a power of two, got {new_size}")
        # zeroed either way; the insert below sets the words
        table, words = self._take_ahead(new_size) or (_alloc_table(new_size),
                                                      np.zeros((new_size + 63) >> 6, dtype=np.uint64))
        _s, _v, new_shared = _insert_nb(table, words, new_size - 1, live_fps, self._occupancy)
        return RebuiltTable(table, words, int(live_fps.size), int(new_shared))

    def adopt(self, rebuilt: RebuiltTable) -> tuple:
        """Swap in a table from :meth:`build` (new generation, log cleared). The caller
        guarantees no insert or remove ran since it was built. Returns what it replaced
        (the old arrays and change log: freeing a long log's thousands of small arrays
        took 0.5-0.7 ms), for a caller under a lock to drop after it."""
        with self._lock:
            retired = (self.filter_arrays, self._log_s, self._log_v)
            self.filter_arrays = (rebuilt.table, rebuilt.words)
            self.generation += 1
            self.version += 1
            self.live = rebuilt.live
            self.shared = rebuilt.shared
            self.stale = 0
            self._log_base = self.version
            self._log_s, self._log_v, self._log_len = [], [], 0
        return retired

    # -- internals ------------------------------------------------------------------------
    def _append_log(self, s: np.ndarray, v: np.ndarray) -> None:
        """Call with ``self._lock`` held."""
        if s.size == 0:
            return
        self._log_s.append(s)
        self._log_v.append(v)
        self._log_len += int(s.size)
        self.version += int(s.size)
        # A log longer than a quarter of the table costs more to replay than an upload:
        # drop it; mirrors behind ``_log_base`` then get a full upload.
        if self._log_len > max(4096, self.size // 4):
            self._log_base = self.version
            self._log_s, self._log_v, self._log_len = [], [], 0
