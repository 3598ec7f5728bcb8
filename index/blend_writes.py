"""The blend index's writes: adds (staged, then published), removals, growth, and the
write session that lets a run of writes be seen by lookups whole.

A mixin of :class:`blend_index.BlendIndex` (which holds the state and the locks): the
methods run on the index itself. Lock order directory -> index writer -> index write
lock; the index never calls back. A bulk add stages its new contents under the writer
lock alone, in rows no reader can reach until the fingerprint map and the slot array
name them, then publishes them under the write lock (``_stage_new`` / ``_publish_new``).

:meth:`IndexWrites.write_session`: inside one (on the thread that opened it), the first
visible write takes both locks and keeps them until the session ends, so a lookup sees
all of the session's writes or none (``docs/architecture.md`` "Locks and threads").
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, NamedTuple, Sequence

import numpy as np

from blendmatch.gpu import chunk_fingerprint, chunk_fingerprints

from .slots import RebuiltTable
from .storage import Repeat
from .tokens import as_token_rows, as_tokens
from .types import UNKNOWN_TOKEN_OFFSET, BlendNamespace, check_chunk_hash, check_namespace, check_token_offset

__all__ = ["IndexWrites", "SessionState", "WriteSession"]

log = logging.getLogger("blendmatch.index.blend_index")  # the name these messages always had

_BYTES_ONLY = {bytes}
_NONE = -1  # end of a linked list
_FREE = -2  # c_occ of a free content row


class _Staged(NamedTuple):
    """New contents written into free rows, not yet visible (``BlendIndex._stage_new``)."""

    fps: np.ndarray
    rows: np.ndarray
    claims: list[tuple[int, int]]  # (namespace id, claims added)
    hash_bytes: int
    fpmap: tuple[np.ndarray, np.ndarray] | None = None  # the grown map, when publishing grows it
    slots: RebuiltTable | None = None  # the grown slot table (staged fingerprints in it), likewise


class SessionState(threading.local):
    """Per thread: how many write sessions are open on this index, and whether they hold
    its locks (taken at the first visible write)."""

    depth = 0
    holding = False


class WriteSession:
    """What :meth:`IndexWrites.write_session` returns: a re-entrant context manager."""

    __slots__ = ("_index",)

    def __init__(self, index: "IndexWrites") -> None:
        self._index = index

    def __enter__(self) -> "WriteSession":
        self._index._session.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        state = self._index._session
        state.depth -= 1
        if state.depth == 0 and state.holding:
            state.holding = False
            self._index._lock.release()
            self._index._writer.release()


class IndexWrites:
    """Writes of :class:`blend_index.BlendIndex` (its state: see there)."""

    _session: SessionState
    _writer: threading.RLock
    _lock: threading.RLock

    def write_session(self) -> WriteSession:
        """``with index.write_session(): ...``: a run of writes that lookups see whole. The
        first visible write inside it (an ``add_many`` publish, after its staging; an
        ``add``; a removal) takes :attr:`writer_lock` and :attr:`write_lock` and keeps them
        until the session ends; verification waits from there to the end, not for the
        writes before it or for staging. Nested sessions join the outer one. Per thread:
        another thread's writes meanwhile wait for the locks as usual."""
        return WriteSession(self)

    def _hold(self) -> None:
        """Before a visible write: in a write session that does not hold yet, take both
        locks for the rest of it (lock order: writer, then write)."""
        state = self._session
        if state.depth and not state.holding:
            self._writer.acquire()
            self._lock.acquire()
            state.holding = True

    @property
    def session_holds(self) -> bool:
        """Whether this thread's write session holds the index's locks already."""
        return self._session.holding

    # ------------------------------------------------------------------ public: writes
    def add(self, tokens: Any, chunk_hash: bytes, token_offset: int, ns: BlendNamespace) -> np.ndarray | None:
        """Index ``chunk_hash`` with content ``tokens`` at ``token_offset`` for namespace ``ns``.

        Idempotent; a second namespace joins the claim set; a known offset updates the
        occupant's offset (-1 never downgrades). Returns the index's stored read-only token
        row (callers may keep it instead of a copy; it stays valid while the content is
        indexed) or ``None`` when the chunk is not indexed: wrong length, unknown offset for
        a new occupant, or a fingerprint collision with different content. Raises
        ``ValueError`` for tokens that are not uint32 ids (nothing applied).
        """
        arr = as_tokens(tokens)
        check_chunk_hash(chunk_hash)
        offset = check_token_offset(token_offset)
        check_namespace(ns)
        if arr.size != self.chunk_size:
            log.debug("not indexed: content of %d tokens, chunk size %d", arr.size, self.chunk_size)
            return None
        fp = chunk_fingerprint(arr)
        self._hold()
        with self._writer, self._lock:
            view = self._add_locked(arr, fp, chunk_hash, offset, ns)
            self._maybe_rebuild()
            return view

    def add_many(self, tokens2d: Any, chunk_hashes: Sequence[bytes], token_offsets: Any,
                 namespaces: BlendNamespace | Sequence[BlendNamespace]) -> list[np.ndarray | None]:
        """``add`` for many chunks at once: the same results as calling ``add`` for each row in
        order, with the per-chunk Python overhead batched away (new contents are inserted with
        a handful of array operations). All input is validated before anything is applied.

        New contents are staged (copied into free rows) before :attr:`write_lock` is taken
        and published under it. In a :meth:`write_session`, the session's hold is taken
        there, after the copy, and the call is one part.
        """
        arr = as_token_rows(tokens2d)
        n = arr.shape[0]
        if len(chunk_hashes) != n:
            raise ValueError(f"chunk_hashes has {len(chunk_hashes)} entries for {n} token rows")
        if not set(map(type, chunk_hashes)) <= _BYTES_ONLY:
            for h in chunk_hashes:
                check_chunk_hash(h)
        offsets = np.asarray(token_offsets, dtype=np.int64).reshape(-1)
        if offsets.size == 1 and n != 1:
            offsets = np.full(n, offsets[0], dtype=np.int64)
        if offsets.size != n:
            raise ValueError(f"token_offsets has {offsets.size} entries for {n} token rows")
        if n and offsets.min() < UNKNOWN_TOKEN_OFFSET:
            raise ValueError(f"token_offset must be >= -1, got {int(offsets.min())}")
        if isinstance(namespaces, BlendNamespace):
            ns_list: Sequence[BlendNamespace] = Repeat(namespaces, n)
        else:
            ns_list = namespaces
            if len(ns_list) != n:
                raise ValueError(f"namespaces has {len(ns_list)} entries for {n} token rows")
            for ns in ns_list:
                check_namespace(ns)
        results: list[np.ndarray | None] = [None] * n
        if n == 0 or arr.shape[1] != self.chunk_size:
            return results
        fps = chunk_fingerprints(arr)
        # The lock is taken per part of ADD_MANY_ROWS_PER_LOCK rows, not for the whole call:
        # a lookup's verification waits for it, and a 5,000-row batch held it 3-8 ms (one
        # 256-row part: ~0.2 ms); a caller holding ``write_lock`` (the key directory, so that
        # lookups see its run whole) keeps it. Parts apply in order: the same results as one
        # pass (a row's duplicates in later parts find it in the fingerprint map). In a write
        # session the lock is kept from the first publish to the session's end anyway: one
        # part, all of it staged before the hold.
        session = self._session.depth > 0
        step = n if session else self.ADD_MANY_ROWS_PER_LOCK
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            part: list[np.ndarray | None] = [None] * (hi - lo)
            nss = Repeat(ns_list.value, hi - lo) if isinstance(ns_list, Repeat) else ns_list[lo:hi]
            hashes = chunk_hashes[lo:hi] if (lo, hi) != (0, n) else chunk_hashes
            with self._writer:
                staged = self._stage_part(arr[lo:hi], fps[lo:hi], hashes, offsets[lo:hi], nss, part)
                if session:
                    self._hold()
                with self._lock:
                    # the tables a growth replaced, freed (unmapped) after the lock, not under it
                    retired = self._publish_part(staged, arr[lo:hi], fps[lo:hi], hashes, offsets[lo:hi], nss, part)
                    self._maybe_rebuild()
                del retired
            results[lo:hi] = part
        return results

    def prepare_add(self, rows: int) -> None:
        """Before taking :attr:`write_lock` for adds of up to ``rows`` new contents: allocate
        outside it the token block they would allocate under it (``TokenStore.prepare``).
        Changes nothing a lookup sees; a racy read of the row count only sizes the guess."""
        self._tokens.prepare(self._c.size + rows)

    #: Rows of one ``add_many`` applied per hold of the index lock (see ``add_many``).
    ADD_MANY_ROWS_PER_LOCK = 256

    def _stage_part(self, arr: np.ndarray, fps: np.ndarray, chunk_hashes: Sequence[bytes],
                    offsets: np.ndarray, ns_list: Sequence[BlendNamespace], results: list
                    ) -> tuple[_Staged | None, np.ndarray]:
        """Writer held: stage the part's new contents (distinct fingerprints absent from the
        map, known offsets; ``_stage_new``). Returns them and which rows they are."""
        n = arr.shape[0]
        rows = self._fpmap.lookup(fps)
        candidates = np.flatnonzero((rows < 0) & (offsets >= 0))
        _, first = np.unique(fps[candidates], return_index=True)
        fast = np.sort(candidates[first])
        staged = None
        if fast.size == n:  # the common bulk case: every row is new content
            staged = self._stage_new(arr, fps, list(chunk_hashes), offsets, ns_list, results, fast)
        elif fast.size:
            fl = fast.tolist()
            staged = self._stage_new(arr[fast], fps[fast], [chunk_hashes[i] for i in fl], offsets[fast],
                                     [ns_list[i] for i in fl], results, fast)
        if staged is not None:
            staged = self._grow_ahead(staged)
        return staged, fast

    def _grow_ahead(self, staged: _Staged) -> _Staged:
        """Writer held: build now the fingerprint map and the slot table that publishing
        ``staged`` would grow under the write lock (a rehash and a refill of every live
        fingerprint: 4-10 ms of the lock at 131-262k chunks in process, up to 15 in the
        service, growing with the index), so
        that the publish only swaps them in. Readers keep the current ones meanwhile; no
        other writer runs before the publish. The grown tables are the ones publishing
        would build: the same sizes, the same contents."""
        n = int(staged.fps.shape[0])
        fpmap = self._fpmap.grown(n)
        slots = None
        if self._slots.needs_rebuild(n):
            slots = self._slots.build(self._live_fps())
        else:
            self._slots.prepare_growth(n)
        return staged._replace(fpmap=fpmap, slots=slots) if fpmap is not None or slots is not None else staged

    def _publish_part(self, staged: tuple[_Staged | None, np.ndarray], arr: np.ndarray, fps: np.ndarray,
                      chunk_hashes: Sequence[bytes], offsets: np.ndarray, ns_list: Sequence[BlendNamespace],
                      results: list) -> tuple:
        """Both locks held: publish the staged contents, then apply the part's other rows
        one by one, in order (they may name contents just published). Returns the tables
        the publish replaced."""
        new, fast = staged
        retired: tuple = ()
        if new is not None:
            retired = self._publish_new(new)
        n = arr.shape[0]
        if fast.size == n:
            return retired
        is_fast = np.zeros(n, dtype=bool)
        is_fast[fast] = True
        for i in np.flatnonzero(~is_fast).tolist():
            results[i] = self._add_locked(arr[i], int(fps[i]), chunk_hashes[i], int(offsets[i]), ns_list[i])
        return retired

    def reserve(self, num_chunks: int) -> None:
        """Pre-allocate for ``num_chunks`` contents (one occupant and claim each): token blocks,
        columns, the fingerprint map and the slot table. Optional; saves the growth work
        (and, on this class of VM, the page faults of new memory) from the ingest path."""
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        with self._writer, self._lock:
            self._tokens.ensure(num_chunks)
            for cols in (self._c, self._o, self._k):
                cols.reserve(num_chunks)
            self._fpmap.reserve(num_chunks)
            size = self._slots.wanted_size(num_chunks)
            self._slots.floor_size = size
            if size > self._slots.size:
                self._slots_write(self._slots.rebuild, self._live_fps(), size=size)
                self._rebuilds += 1

    def remove_claim(self, tokens: Any, chunk_hash: bytes, ns: BlendNamespace) -> bool:
        """Drop ``ns``'s claim on ``chunk_hash`` (with content ``tokens``). The occupant goes
        with its last claim, the content with its last occupant. Returns whether a claim was
        dropped (no-op otherwise)."""
        return self._remove(tokens, chunk_hash, ns)

    def remove_chunk(self, tokens: Any, chunk_hash: bytes) -> bool:
        """Drop the occupant ``chunk_hash`` of content ``tokens`` and all its claims at once
        (used when a chunk hash is re-stored with different tokens). Returns whether it was
        indexed."""
        return self._remove(tokens, chunk_hash, None)

    def _slots_write(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run a slot-table write (insert, rebuild or adopt; lock held) between two
        increments of ``_slot_writes``, so a concurrent probe can tell it may have missed
        slots. Returns what ``fn`` returns."""
        self._slot_writes += 1
        try:
            return fn(*args, **kw)
        finally:
            self._slot_writes += 1

    # ------------------------------------------------------------------ internals: writes
    def _add_locked(self, arr: np.ndarray, fp: int, chunk_hash: bytes, offset: int,
                    ns: BlendNamespace) -> np.ndarray | None:
        row = self._fpmap.get(fp)
        if row < 0:
            if offset == UNKNOWN_TOKEN_OFFSET:
                return None
            out: list[np.ndarray | None] = [None]
            self._publish_new(self._stage_new(arr[None, :], np.array([fp], dtype=np.uint64), [chunk_hash],
                                              np.array([offset], dtype=np.int64), [ns], out,
                                              np.zeros(1, dtype=np.int64)))
            return out[0]
        stored = self._tokens.row(row)
        if not np.array_equal(stored, arr):
            self._collisions += 1
            log.warning("fingerprint collision %#018x: chunk %s has different content than the "
                        "indexed entry; not indexed", fp, chunk_hash.hex())
            return None
        occ = self._find_occupant(row, chunk_hash)
        if occ < 0:
            if offset == UNKNOWN_TOKEN_OFFSET:
                return None
            occ = self._o.alloc_one()
            self._o["content"][occ] = row
            self._o["next"][occ] = _NONE
            self._o["offset"][occ] = offset
            self._o["claim"][occ] = _NONE
            self._set_hash(occ, chunk_hash)
            self._hash_bytes += sys.getsizeof(chunk_hash)
            self._append_occupant(row, occ)
        elif offset != UNKNOWN_TOKEN_OFFSET:
            self._o["offset"][occ] = offset
        self._add_claim(occ, self._ns.id_of(ns))
        return stored

    def _stage_new(self, arr: np.ndarray, fps: np.ndarray, hashes: list[bytes], offsets: np.ndarray,
                   nss: Sequence[BlendNamespace], results: list, positions: np.ndarray) -> _Staged:
        """Stage new contents (distinct fingerprints, absent from the map, known offsets), each
        with one occupant and one claim, in a handful of array operations; :meth:`_publish_new`
        makes them visible. Needs only :attr:`writer_lock`: the rows written are free rows,
        which no lookup reaches (verification reaches contents through the fingerprint map,
        occupants and claims through their contents' lists), and a column that grows is
        copied to a new array while a reader keeps the old one. Only a new token block is
        added under ``_lock`` (compiled readers walk the block list)."""
        n = fps.shape[0]
        rows = self._c.alloc(n)
        occs = self._o.alloc(n)
        claims = self._k.alloc(n)
        need = int(rows.max()) + 1 if n else 0
        if need > self._tokens.addressable:
            with self._lock:
                self._tokens.ensure(need)
        self._tokens.write(rows, arr)
        c, o, k = self._c, self._o, self._k
        c["fp"][rows] = fps
        c["occ"][rows] = occs
        o["content"][occs] = rows
        o["next"][occs] = _NONE
        o["offset"][occs] = offsets
        o["claim"][occs] = claims
        if isinstance(nss, Repeat):  # one namespace for all rows
            nid = self._ns.id_of(nss.value)
            k["ns"][claims] = nid
            counts: list[tuple[int, int]] = [(nid, n)]
        else:
            nids = np.fromiter((self._ns.id_of(ns) for ns in nss), dtype=np.int64, count=n)
            k["ns"][claims] = nids
            counts = [(int(nid), int(cnt)) for nid, cnt in zip(*np.unique(nids, return_counts=True))]
        k["next"][claims] = _NONE
        if n and int(occs[0]) == len(self._o_hash) and int(occs[-1]) == int(occs[0]) + n - 1:
            self._o_hash.extend(hashes)  # all fresh ids: the common bulk case
        else:
            for occ, h in zip(occs.tolist(), hashes):
                self._set_hash(occ, h)
        views = self._tokens.rows(rows)
        if n == len(results):  # every row of the call is new content: positions are 0..n-1
            results[:] = views
        else:
            for pos, view in zip(positions.tolist(), views):
                results[pos] = view
        return _Staged(fps, rows, counts, sum(map(sys.getsizeof, hashes)))

    def _publish_new(self, staged: _Staged) -> tuple:
        """Both locks held: make staged contents visible (fingerprint map, slot array; grown
        ones swapped in, see :meth:`_grow_ahead`) and count them. Returns the replaced
        tables, for the caller to drop once the lock is released."""
        for nid, cnt in staged.claims:
            self._ns.claims[nid] += cnt
        self._hash_bytes += staged.hash_bytes
        retired: tuple = ()
        if staged.fpmap is not None:
            retired += (self._fpmap.keys, self._fpmap.vals)
            self._fpmap.adopt(staged.fpmap)
        self._fpmap.insert(staged.fps, staged.rows)
        if staged.slots is not None:  # built with the staged fingerprints in it
            retired += self._slots_write(self._slots.adopt, staged.slots)
            self._rebuilds += 1
        else:
            self._slots_write(self._slots.insert, staged.fps)
        return retired

    def _set_hash(self, occ: int, chunk_hash: bytes) -> None:
        """Record occupant ``occ``'s chunk hash (``occ`` is fresh or was freed); the caller
        counts its bytes (``_hash_bytes``) when it becomes visible."""
        if occ == len(self._o_hash):
            self._o_hash.append(chunk_hash)
        else:
            if occ > len(self._o_hash):
                self._o_hash.extend([None] * (occ - len(self._o_hash)))
                self._o_hash.append(chunk_hash)
            else:
                self._o_hash[occ] = chunk_hash

    def _find_occupant(self, row: int, chunk_hash: bytes) -> int:
        occ = int(self._c["occ"][row])
        nxt = self._o["next"]
        while occ >= 0:
            if self._o_hash[occ] == chunk_hash:
                return occ
            occ = int(nxt[occ])
        return -1

    def _append_occupant(self, row: int, occ: int) -> None:
        head = int(self._c["occ"][row])
        if head < 0:
            self._c["occ"][row] = occ
            return
        nxt = self._o["next"]
        while nxt[head] >= 0:
            head = int(nxt[head])
        nxt[head] = occ

    def _add_claim(self, occ: int, nid: int) -> None:
        k = int(self._o["claim"][occ])
        last = -1
        while k >= 0:
            if self._k["ns"][k] == nid:
                return
            last = k
            k = int(self._k["next"][k])
        new = self._k.alloc_one()
        self._k["ns"][new] = nid
        self._k["next"][new] = _NONE
        if last < 0:
            self._o["claim"][occ] = new
        else:
            self._k["next"][last] = new
        self._ns.claims[nid] += 1

    def _remove(self, tokens: Any, chunk_hash: bytes, ns: BlendNamespace | None) -> bool:
        self._hold()  # in a write session: before the first visible write, as its callers did
        arr = as_tokens(tokens)
        check_chunk_hash(chunk_hash)
        if ns is not None:
            check_namespace(ns)
        if arr.size != self.chunk_size:
            return False
        fp = chunk_fingerprint(arr)
        with self._writer, self._lock:
            row = self._fpmap.get(fp)
            if row < 0 or not np.array_equal(self._tokens.row(row), arr):
                return False
            occ = self._find_occupant(row, chunk_hash)
            if occ < 0:
                return False
            if ns is None:
                self._drop_all_claims(occ)
            else:
                nid = self._ns.get(ns)
                if nid < 0 or not self._drop_claim(occ, nid):
                    return False
            if self._o["claim"][occ] < 0:
                self._drop_occupant(row, occ)
            self._maybe_rebuild()
            return True

    def _drop_claim(self, occ: int, nid: int) -> bool:
        k = int(self._o["claim"][occ])
        prev = -1
        while k >= 0:
            nxt = int(self._k["next"][k])
            if self._k["ns"][k] == nid:
                if prev < 0:
                    self._o["claim"][occ] = nxt
                else:
                    self._k["next"][prev] = nxt
                self._k.free(k)
                self._ns.claims[nid] -= 1
                return True
            prev, k = k, nxt
        return False

    def _drop_all_claims(self, occ: int) -> None:
        k = int(self._o["claim"][occ])
        while k >= 0:
            nxt = int(self._k["next"][k])
            self._ns.claims[int(self._k["ns"][k])] -= 1
            self._k.free(k)
            k = nxt
        self._o["claim"][occ] = _NONE

    def _drop_occupant(self, row: int, occ: int) -> None:
        nxt = self._o["next"]
        head = int(self._c["occ"][row])
        if head == occ:
            self._c["occ"][row] = nxt[occ]
        else:
            while nxt[head] != occ:
                head = int(nxt[head])
            nxt[head] = nxt[occ]
        self._hash_bytes -= sys.getsizeof(self._o_hash[occ])
        self._o_hash[occ] = None
        self._o.free(occ)
        if self._c["occ"][row] < 0:
            fp = int(self._c["fp"][row])
            self._fpmap.delete(fp)
            self._slots_write(self._slots.remove, np.array([fp], dtype=np.uint64))
            self._c["occ"][row] = _FREE
            self._c.free(row)

    def _maybe_rebuild(self) -> None:
        if self._slots.needs_rebuild():
            self._slots_write(self._slots.rebuild, self._live_fps())
            self._rebuilds += 1

    def _live_fps(self) -> np.ndarray:
        """The fingerprints of every content row in use (staged rows included): what a
        slot table is rebuilt from."""
        live = self._c["occ"][: self._c.size] != _FREE
        return self._c["fp"][: self._c.size][live]
