"""Compact host storage for the blend index: columns with free lists, a fingerprint map, and
block-allocated token rows.

Why not Python dicts and objects: a fleet index holds millions of chunks and keeps every
chunk's 256 tokens resident for verification (1 KiB each as uint32). A dict entry plus a
boxed 64-bit key plus a per-chunk object costs 200-400 bytes; these numpy structures cost
about 100 bytes per chunk on top of the tokens, and numba reads them directly, so the
verification loop never touches a Python object.

Nothing here locks: the owner (``BlendIndex``) calls every method with its locks held
(its writer lock at least: see its staging of new contents).
"""

from __future__ import annotations

import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numba
import numpy as np
from numba.typed import List as NumbaList

from blendmatch.gpu.fingerprint import mix64_scalar

__all__ = ["Columns", "FingerprintMap", "TokenStore", "EMPTY", "TOMBSTONE", "split_hashes", "Repeat", "prefault"]

#: FingerprintMap value of a never-used slot / of a deleted one (keeps probe chains intact).
EMPTY = -1
TOMBSTONE = -2


class Columns:
    """Parallel numpy columns indexed by a row id, with a free list for reuse.

    Rows are handed out from the free list first, so ids stay dense and the columns stop
    growing once the live set stops growing. Growth is by 1.5x (memory slack <= 50% of
    these small per-row columns, never of the token rows).
    """

    def __init__(self, dtypes: dict[str, np.dtype | type], capacity: int = 1024) -> None:
        self._dtypes = {k: np.dtype(v) for k, v in dtypes.items()}
        self.cols: dict[str, np.ndarray] = {k: np.zeros(capacity, dtype=d) for k, d in self._dtypes.items()}
        self.size = 0  # rows ever handed out (high-water mark)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return int(next(iter(self.cols.values())).shape[0])

    @property
    def live(self) -> int:
        return self.size - len(self._free)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.cols[name]

    def alloc(self, n: int) -> np.ndarray:
        """``n`` row ids (int64), reusing freed rows first."""
        take = min(n, len(self._free))
        reused = [self._free.pop() for _ in range(take)]
        fresh = n - take
        if self.size + fresh > self.capacity:
            self._grow(self.size + fresh)
        ids = np.empty(n, dtype=np.int64)
        ids[:take] = reused
        ids[take:] = np.arange(self.size, self.size + fresh, dtype=np.int64)
        self.size += fresh
        return ids

    def reserve(self, n: int) -> None:
        """Capacity for ``n`` rows without further growth."""
        if n > self.capacity:
            self._grow(n)

    def alloc_one(self) -> int:
        if self._free:
            return self._free.pop()
        if self.size + 1 > self.capacity:
            self._grow(self.size + 1)
        self.size += 1
        return self.size - 1

    def free(self, row: int) -> None:
        self._free.append(int(row))

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.cols.values()) + 8 * len(self._free)

    def export(self) -> tuple[dict[str, np.ndarray], list[int]]:
        """Views of the used rows of each column and the free list, for a checkpoint (the
        caller holds the owner's lock, or runs in a forked copy of the process)."""
        return {k: a[: self.size] for k, a in self.cols.items()}, list(self._free)

    def restore(self, cols: dict[str, np.ndarray], size: int, free: list[int]) -> None:
        """Replace the contents with a checkpoint's ``export`` (columns of ``size`` rows)."""
        if set(cols) != set(self.cols):
            raise ValueError(f"columns {sorted(cols)} do not match {sorted(self.cols)}")
        cap = max(size, 1024)
        for k, d in self._dtypes.items():
            a = np.zeros(cap, dtype=d)
            src = cols[k]
            if src.shape != (size,):
                raise ValueError(f"column {k!r} has shape {src.shape}, expected ({size},)")
            a[:size] = src
            self.cols[k] = a
        self.size = size
        self._free = [int(x) for x in free]

    def _grow(self, need: int) -> None:
        cap = max(need, min(self.capacity + self.capacity // 2, need * 2), 1024)
        for k, a in self.cols.items():
            b = np.zeros(cap, dtype=a.dtype)
            b[: a.shape[0]] = a
            self.cols[k] = b


@numba.njit(inline="always")
def _fm_find(keys, vals, mask, fps):  # pragma: no cover - compiled
    out = np.empty(fps.shape[0], dtype=np.int64)
    for j in range(fps.shape[0]):
        fp = fps[j]
        i = np.int64(mix64_scalar(fp) & np.uint64(mask))
        r = -1
        while True:
            v = vals[i]
            if v == -1:
                break
            if v >= 0 and keys[i] == fp:
                r = v
                break
            i = (i + 1) & mask
        out[j] = r
    return out


@numba.njit(cache=True, nogil=True)
def _fm_lookup(keys, vals, mask, fps):  # pragma: no cover - compiled
    return _fm_find(keys, vals, mask, fps)


# The same body compiled to keep the GIL (its own function: numba's cache is keyed by the
# function, not by the flags; see gpu/cpu.py's _probe_serial).
@numba.njit(cache=True)
def _fm_lookup_held(keys, vals, mask, fps):  # pragma: no cover - compiled
    return _fm_find(keys, vals, mask, fps)


@numba.njit(cache=True, nogil=True, inline="always")
def _fm_put(keys, vals, mask, fp, row):  # pragma: no cover - compiled
    """Put an absent key in the first free or deleted slot of its probe chain; returns
    whether that slot was a tombstone."""
    i = np.int64(mix64_scalar(fp) & np.uint64(mask))
    while vals[i] >= 0:
        i = (i + 1) & mask
    reused = vals[i] == -2
    keys[i] = fp
    vals[i] = row
    return reused


@numba.njit(cache=True, nogil=True)
def _fm_insert(keys, vals, mask, fps, rows):  # pragma: no cover - compiled
    """Insert absent keys; returns how many tombstones were reused."""
    reused = 0
    for j in range(fps.shape[0]):
        if _fm_put(keys, vals, mask, fps[j], rows[j]):
            reused += 1
    return reused


@numba.njit(cache=True, nogil=True)
def _fm_rehash(old_keys, old_vals, keys, vals, mask):  # pragma: no cover - compiled
    """Insert the live entries of an old table into an empty one, in slot order: the table
    that gathering them (``old_vals >= 0``) and inserting them in order builds, without the
    gathered copies."""
    for i in range(old_vals.shape[0]):
        if old_vals[i] >= 0:
            _fm_put(keys, vals, mask, old_keys[i], old_vals[i])


@numba.njit(cache=True, nogil=True)
def _fm_delete(keys, vals, mask, fp):  # pragma: no cover - compiled
    i = np.int64(mix64_scalar(fp) & np.uint64(mask))
    while True:
        v = vals[i]
        if v == -1:
            return False
        if v >= 0 and keys[i] == fp:
            vals[i] = -2
            return True
        i = (i + 1) & mask


class FingerprintMap:
    """uint64 fingerprint -> int content row; open addressing, linear probing, numba.

    Load stays <= 3/4 (live + tombstones); a rehash drops tombstones and sizes the table to
    about 1.5x the live keys. 12 bytes a slot: 16-36 bytes per key.
    """

    MAX_LOAD_NUM, MAX_LOAD_DEN = 3, 4

    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(capacity)
        self.live = 0
        self.tombstones = 0

    def _alloc(self, capacity: int) -> None:
        self.keys, self.vals = _empty_map(capacity)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[0])

    def lookup(self, fps: np.ndarray) -> np.ndarray:
        """Rows (int64) for each fingerprint, -1 where absent."""
        return self._find(_fm_lookup, fps)

    def lookup_in_hold(self, fps: np.ndarray) -> np.ndarray:
        """:meth:`lookup` without releasing the GIL, for a caller holding a lock that others
        wait for (a lookup's verification): a release there hands the GIL to the busy event
        loop, and the lock stays held until the GIL comes back (``docs/performance.md``,
        "Lock holds on the lookup path")."""
        return self._find(_fm_lookup_held, fps)

    def _find(self, kernel: Any, fps: np.ndarray) -> np.ndarray:
        return kernel(self.keys, self.vals, self.capacity - 1, np.ascontiguousarray(fps, dtype=np.uint64))

    def get(self, fp: int) -> int:
        return int(self.lookup(np.array([fp], dtype=np.uint64))[0])

    def insert(self, fps: np.ndarray, rows: np.ndarray) -> None:
        """Insert fingerprints known to be absent (distinct) with their rows."""
        n = int(fps.shape[0])
        if n == 0:
            return
        if self._needs_rehash(n):
            self._rehash(self.live + n)
        reused = _fm_insert(self.keys, self.vals, self.capacity - 1,
                            np.ascontiguousarray(fps, dtype=np.uint64), np.ascontiguousarray(rows, dtype=np.int32))
        self.live += n
        self.tombstones -= int(reused)

    def grown(self, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The rehashed table that inserting ``n`` keys would build, built now without
        changing this one (so a caller builds it outside the lock that readers take, and
        :meth:`adopt` it under that lock); None when ``n`` keys fit."""
        if not self._needs_rehash(n):
            return None
        return self._rehashed(self.live + n)

    def adopt(self, table: tuple[np.ndarray, np.ndarray]) -> None:
        """Swap in a table from :meth:`grown`; no key may have changed since it was built."""
        self.keys, self.vals = table
        self.tombstones = 0

    def _needs_rehash(self, n: int) -> bool:
        return (self.live + self.tombstones + n) * self.MAX_LOAD_DEN > self.capacity * self.MAX_LOAD_NUM

    def reserve(self, n: int) -> None:
        """Room for ``n`` live keys without a rehash."""
        if (n + self.tombstones) * self.MAX_LOAD_DEN > self.capacity * self.MAX_LOAD_NUM:
            self._rehash(n)

    def delete(self, fp: int) -> bool:
        if _fm_delete(self.keys, self.vals, self.capacity - 1, np.uint64(fp)):
            self.live -= 1
            self.tombstones += 1
            return True
        return False

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.vals.nbytes)

    def restore(self, keys: np.ndarray, vals: np.ndarray, live: int, tombstones: int) -> None:
        """Adopt a checkpoint's table as is (same probe chains, same tombstones)."""
        cap = int(keys.shape[0])
        if cap < 1 or cap & (cap - 1) or vals.shape != keys.shape:
            raise ValueError(f"fingerprint map of {cap} slots: not a power of two or mismatched")
        self.keys = np.ascontiguousarray(keys, dtype=np.uint64)
        self.vals = np.ascontiguousarray(vals, dtype=np.int32)
        self.live, self.tombstones = int(live), int(tombstones)

    def _rehash(self, need: int) -> None:
        self.adopt(self._rehashed(need))

    def _rehashed(self, need: int) -> tuple[np.ndarray, np.ndarray]:
        """The live keys in a new table sized for ``need`` keys (load after it <= 2/3), read
        from the old table in one pass (gathering them first by a boolean mask was 31-56 ms
        of an 85 ms growth at 1.4M keys)."""
        cap = 1024
        while cap * 2 < need * 3:
            cap *= 2
        new_keys, new_vals = _empty_map(cap)
        _fm_rehash(self.keys, self.vals, new_keys, new_vals, cap - 1)
        return new_keys, new_vals


def _empty_map(capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values of an empty fingerprint map of ``capacity`` slots."""
    return np.zeros(capacity, dtype=np.uint64), np.full(capacity, EMPTY, dtype=np.int32)


#: The one thread that maps token blocks ahead of need (``TokenStore.prepare``); the page
#: faults run in a ``nogil`` kernel, so the GIL's other threads keep running meanwhile.
_BLOCKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blendmatch-blocks")

#: Bytes between two pre-faulting writes: the smallest page size.
_PAGE = mmap.PAGESIZE


@numba.njit(cache=True, nogil=True)
def _prefault(buf, step):  # pragma: no cover - compiled
    for i in range(0, buf.shape[0], step):
        buf[i] = 0


def prefault(buf: np.ndarray) -> None:
    """Fault in every page of ``buf`` (a writable 1-D uint8 array) by writing a zero to each,
    without the GIL: for memory that is zero already or not yet meaningful."""
    _prefault(buf, _PAGE)


def _alloc_block(rows: int, width: int) -> np.ndarray:
    """An uninitialised ``(rows, width)`` uint32 block, its pages mapped before it is used.

    Rows are always written before they are read, so no zeroing is needed. The block is an
    anonymous mapping pre-faulted by one write per page in a ``nogil`` kernel: a first
    touch by the ingest itself made it 2.3x slower. Not ``MAP_POPULATE``: Python's
    ``mmap.mmap`` keeps the GIL through the system call, and populating 8 MiB stopped every
    other thread (the ingest, the lookup thread, the event loop) for 2.5-3.4 ms; faulted in
    here it costs 3.3-4.7 ms of the blocks thread's CPU, with no GIL held. Not huge pages
    either (``MADV_HUGEPAGE``): on this project's VMs a fresh huge page cost 4-6 ms to fault
    in (18-26 ms per block), and ingest measured no faster with them.
    """
    nbytes = rows * width * 4
    if nbytes >= (1 << 20):
        try:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, AttributeError):
            return np.empty((rows, width), dtype=np.uint32)
        prefault(np.frombuffer(mm, dtype=np.uint8))
        return np.frombuffer(mm, dtype=np.uint32).reshape(rows, width)  # keeps mm alive
    return np.empty((rows, width), dtype=np.uint32)


def _first_of_run(rows: np.ndarray) -> int:
    """``rows[0]`` when ``rows`` (int64, 1-D) are consecutive ascending ids, else -1."""
    n = int(rows.shape[0])
    if not n:
        return -1
    first = int(rows[0])
    if int(rows[-1]) - first != n - 1 or (n > 1 and not bool((np.diff(rows) == 1).all())):
        return -1
    return first


class TokenStore:
    """Token rows of ``width`` uint32 each, in fixed blocks of ``block_rows`` rows.

    Blocks, not one growing array: growth never copies the tokens and never leaves more than
    one partly used block of slack (a doubling array would waste up to 50% of the largest
    structure of the index). ``blocks`` is a numba typed list so compiled code reads rows
    directly: row ``r`` is ``blocks[r >> shift][r & mask]``.
    """

    #: Target block size. Large blocks let the kernel back them with transparent huge pages
    #: (numpy asks for them on allocations of 4 MiB and more): first-touch page faults were
    #: half of the ingest time with 1 MiB blocks.
    BLOCK_BYTES = 8 << 20

    def __init__(self, width: int, block_shift: int | None = None) -> None:
        if block_shift is None:
            block_shift = max(6, (self.BLOCK_BYTES // (4 * width)).bit_length() - 1)
        self.width = width
        self.shift = block_shift
        self.mask = (1 << block_shift) - 1
        self.blocks = NumbaList()  # for compiled readers
        self._py_blocks: list[np.ndarray] = []  # the same arrays, for cheap Python access
        self._ro_blocks: list[np.ndarray] = []  # read-only views of them (rows handed out)
        self._spare: list[np.ndarray] = []  # a block allocated ahead by ``prepare``, not yet in use
        self._ahead: Optional[Future] = None  # the next block, being mapped on the blocks thread
        self.ensure(1)

    def prepare(self, rows: int) -> None:
        """Allocate ahead, without the owner's lock, the block that :meth:`ensure` of ``rows``
        would allocate under it. Mapping and pre-faulting a block costs ~2.5 ms, which the
        index's write lock (and every lookup's verification waiting on it) paid once per
        8,192 new chunks; the spare is used by the next growth, at no cost under the lock.

        And once ``rows`` passes half of the last block, the block after it is mapped on a
        background thread (``_BLOCKS``), so that the caller (the events thread) does not
        pay the mapping either: the kernel's work runs on another core meanwhile, and the
        block is ready when growth needs it (one block, 8 MiB, at most, mapped ahead)."""
        have = len(self._py_blocks) << self.shift
        if have < rows and not self._spare:
            self._spare.append(self._next_block())
        if not self._spare and self._ahead is None and rows > have - (1 << (self.shift - 1)):
            self._ahead = _BLOCKS.submit(_alloc_block, 1 << self.shift, self.width)

    def _next_block(self) -> np.ndarray:
        """The block mapped ahead (waiting for it if need be), else one mapped now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            try:
                return ahead.result()
            except Exception:  # noqa: BLE001 - mapping ahead is only an optimisation
                pass
        return _alloc_block(1 << self.shift, self.width)

    @property
    def addressable(self) -> int:
        """Rows ``0..addressable-1`` have a block (``ensure`` adds blocks up to a need)."""
        return len(self._py_blocks) << self.shift

    def ensure(self, rows: int) -> None:
        """Make rows ``0..rows-1`` addressable."""
        while len(self._py_blocks) << self.shift < rows:
            block = self._spare.pop() if self._spare else self._next_block()
            self._py_blocks.append(block)
            self.blocks.append(block)
            ro = block.view()
            ro.setflags(write=False)
            self._ro_blocks.append(ro)

    def write(self, rows: np.ndarray, tokens2d: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return
        self.ensure(int(rows.max()) + 1)
        first = _first_of_run(rows)
        if first >= 0 and first >> self.shift == int(rows[-1]) >> self.shift:
            lo = first & self.mask  # consecutive rows in one block (a bulk insert): one slice copy
            self._py_blocks[first >> self.shift][lo:lo + rows.size] = tokens2d
            return
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        blk = rows >> self.shift
        cuts = np.concatenate(([0], np.flatnonzero(np.diff(blk)) + 1, [rows.size]))
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            block = self._py_blocks[int(blk[a])]
            lo, hi = int(rows[a]) & self.mask, int(rows[b - 1]) & self.mask
            src = order[a:b]
            if hi - lo == b - a - 1:  # a contiguous run of rows: one slice copy
                block[lo:hi + 1] = tokens2d[src] if src[-1] - src[0] != b - a - 1 else tokens2d[src[0]:src[-1] + 1]
            else:
                block[rows[a:b] & self.mask] = tokens2d[src]

    def row(self, r: int) -> np.ndarray:
        """Read-only view of row ``r`` (shares memory with the store)."""
        return self._ro_blocks[r >> self.shift][r & self.mask]

    def rows(self, rows: np.ndarray) -> list[np.ndarray]:
        """Read-only views of many rows (``rows``: int64 ids). A run of consecutive ids (what
        a bulk insert allocates) is sliced per block and iterated in C: no per-row Python."""
        ro, shift, mask = self._ro_blocks, self.shift, self.mask
        first = _first_of_run(rows)
        if first >= 0:
            out: list[np.ndarray] = []
            r, end = first, first + int(rows.shape[0])
            while r < end:
                lo = r & mask
                take = min(end - r, mask + 1 - lo)
                out.extend(ro[r >> shift][lo:lo + take])
                r += take
            return out
        return [ro[r >> shift][r & mask] for r in rows.tolist()]

    def nbytes(self) -> int:
        blocks = len(self._py_blocks) + len(self._spare) + (self._ahead is not None)
        return blocks * (1 << self.shift) * self.width * 4

    # ------------------------------------------------------------------ checkpoints
    def export_parts(self, rows: int) -> list[np.ndarray]:
        """Rows ``0..rows-1`` as block slices (written one after another, no gathering)."""
        out, r = [], 0
        while r < rows:
            block = self._py_blocks[r >> self.shift]
            take = min(rows - r, 1 << self.shift)
            out.append(block[:take])
            r += take
        return out or [np.empty((0, self.width), dtype=np.uint32)]

    def restore_buffer(self, rows: int) -> np.ndarray:
        """A buffer of whole blocks holding at least ``rows`` rows: fill its first ``rows``
        rows, then :meth:`adopt` it (a restore reads the file straight into the store)."""
        nblocks = max(1, -(-rows >> self.shift))
        return _alloc_block(nblocks << self.shift, self.width)  # pre-faulted: reads fill it at full speed

    def adopt(self, buffer: np.ndarray) -> None:
        """Replace every block by views of ``buffer`` (from :meth:`restore_buffer`)."""
        per = 1 << self.shift
        if buffer.ndim != 2 or buffer.shape[1] != self.width or buffer.shape[0] % per:
            raise ValueError(f"buffer of shape {buffer.shape} is not whole blocks of {per} x {self.width}")
        self.blocks = NumbaList()
        self._py_blocks, self._ro_blocks = [], []
        for i in range(buffer.shape[0] // per):
            block = buffer[i * per:(i + 1) * per]
            self._py_blocks.append(block)
            self.blocks.append(block)
            ro = block.view()
            ro.setflags(write=False)
            self._ro_blocks.append(ro)

    def locate(self, views: list) -> np.ndarray:
        """Row id of each array in ``views`` that is a row of this store (a view handed out
        by :meth:`row`/:meth:`rows`), else -1 (None, or memory of its own). By address."""
        n = len(views)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        stride = self.width * 4
        starts = np.array([b.ctypes.data for b in self._py_blocks], dtype=np.int64)
        order = np.argsort(starts)
        starts_sorted = starts[order]
        span = (1 << self.shift) * stride
        addr = np.fromiter((-1 if v is None or v.shape != (self.width,) else v.__array_interface__["data"][0]
                            for v in views), dtype=np.int64, count=n)
        k = np.searchsorted(starts_sorted, addr, side="right") - 1
        ok = (addr >= 0) & (k >= 0)
        kk = np.where(ok, k, 0)
        delta = addr - starts_sorted[kk]
        ok &= (delta < span) & (delta % stride == 0)
        out[ok] = (order[kk[ok]].astype(np.int64) << self.shift) + delta[ok] // stride
        return out


def split_hashes(blob: bytes, lengths: np.ndarray) -> list[bytes | None]:
    """Occupant chunk hashes from their concatenation; length -1 is a free occupant (None)."""
    n = int(lengths.shape[0])
    if n and int(lengths.min()) == int(lengths.max()) and int(lengths[0]) > 0:  # one hash length: slices
        w = int(lengths[0])
        return [blob[i:i + w] for i in range(0, n * w, w)]
    out: list[bytes | None] = []
    pos = 0
    for ln in lengths.tolist():
        if ln < 0:
            out.append(None)
        else:
            out.append(blob[pos:pos + ln])
            pos += ln
    return out


class Repeat(Sequence):
    """``[value] * n`` without building the list (one namespace for a whole bulk add)."""

    def __init__(self, value: Any, n: int) -> None:
        self.value, self.n = value, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.value] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.value
