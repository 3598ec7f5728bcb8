"""BlendIndex: which stored chunks does a token sequence contain, where, for whom?

The content-fingerprint index (``docs/architecture.md`` walks a lookup through it).
Contents are keyed by THE fingerprint (``gpu/fingerprint.py``) of their ``chunk_size``
tokens; each content has *occupants* (the chunk hashes stored with exactly those tokens, in
first-indexed order), each with its ``token_offset`` and the set of namespaces that *claim*
it. The slot array (``slots.py``) sits in front of the exact map so that an engine
(``gpu/``) can reject almost every query window without touching the host structures.

``match_batch`` / ``match_flat``: one engine probe for the whole batch (outside the lock) ->
candidates ``(query, cur_st, fingerprint)`` ascending -> under the lock: fingerprint map
lookup -> namespace filter (before tokens are compared) -> token-exact verification ->
LMCache 0.5.6's per-position rule (``verify.py``: at most one match per position and no
chunk hash twice in a query; content C stored under A then B, query ``C..C`` -> A at the
first copy, B at the second; a hash removed and re-added goes last; a chunk is taken only
after it verified), in time linear in candidates plus occupants.

Invariants:
- A chunk whose ``token_offset`` is unknown (-1) is never indexed as a new occupant, and a
  later -1 never downgrades a known offset.
- Content of the wrong length is not indexed (logged at debug, not an error).
- Two fingerprints that collide with different content stay apart: the later content is
  not indexed (counted as ``collisions``) and never attached to the earlier entry.
- Every content in the map has at least one occupant; every occupant at least one claim.

Thread safety: a writer lock keeps writers one at a time and a write lock keeps readers
out; bulk adds stage new contents under the first and publish them under the second (see
``__init__``). The engine probe runs outside both (the slot array tolerates concurrent
readers). Lock order: directory -> index writer -> index; the index never calls back.

Why one module of ~800 lines: every method here keeps the invariants above across the same
private columns (contents, occupants, claims, the hash list, the map and the slot table)
under the same two locks; the parts that stand alone already live apart (``storage.py``
the containers, ``slots.py`` the filter, ``verify.py`` the per-position rule,
``namespace_ids.py``, ``tokens.py``). Splitting adds, stages, removals or the checkpoint
state out would hand those private columns and the locking rules to several modules.

Memory: see ``storage.py``; about 100-200 bytes per chunk beyond its 1 KiB of tokens.
Token rows handed out by ``add``/``add_many`` are shared, read-only views: a row is never
reused while its content still has an occupant (hence a claim), so the key directory keeps
these views as its only copy of a binding's tokens. ``memory_bytes`` counts the chunk-hash
bytes objects, which the directory shares; do not add them twice.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from blendmatch.gpu import Candidates, Engine, FailoverEngine, QueryBatch, chunk_fingerprint, chunk_fingerprints, select_engine
from blendmatch.gpu.engine import ProbeHandle, probe_async

from .namespace_ids import NamespaceIds
from .slots import FilterMode, RebuiltTable, SlotArray
from .tokens import as_token_rows, as_tokens
from .storage import Columns, FingerprintMap, Repeat, TokenStore, split_hashes
from .types import UNKNOWN_TOKEN_OFFSET, BlendMatch, BlendNamespace, check_chunk_hash, check_namespace, check_token_offset
from .verify import NO_KEYS, MatchStats, hash_keys, per_position_rule

__all__ = ["BlendIndex", "MatchStats"]

log = logging.getLogger(__name__)

_BYTES_ONLY = {bytes}
_NONE = -1  # end of a linked list
_FREE = -2  # c_occ of a free content row
_EMPTY_LIST_BYTES = sys.getsizeof([])


class _Staged(NamedTuple):
    """New contents written into free rows, not yet visible (``BlendIndex._stage_new``)."""

    fps: np.ndarray
    rows: np.ndarray
    claims: list[tuple[int, int]]  # (namespace id, claims added)
    hash_bytes: int
    fpmap: tuple[np.ndarray, np.ndarray] | None = None  # the grown map, when publishing grows it
    slots: RebuiltTable | None = None  # the grown slot table (staged fingerprints in it), likewise


class BlendIndex:
    """The host truth of blend lookups. See the module docstring for semantics."""

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1, engine: str | Engine = "auto",
                 filter: FilterMode = "tagged") -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        if not isinstance(probe_stride, int) or probe_stride < 1:
            raise ValueError(f"probe_stride must be an integer >= 1, got {probe_stride!r}")
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        self._slots = SlotArray(filter)
        self.filter = filter
        chosen = select_engine(engine) if isinstance(engine, str) else engine
        # What probes go through: the chosen engine until it fails at run time, then the CPU
        # engine (``gpu.select.FailoverEngine``: logged and counted there).
        self._failover = chosen if isinstance(chosen, FailoverEngine) else FailoverEngine(chosen)
        # Two locks, always taken in this order: ``_writer`` keeps writers one at a time (the
        # key directory's lock already does for the service), ``_lock`` keeps readers out
        # (verification waits for it). A bulk add stages its new contents under ``_writer``
        # alone, in rows no reader can reach until the fingerprint map and the slot array
        # name them, then publishes them under ``_lock``: the hold lookups wait for is the
        # publish, not the copy (issue 28 item 2; ``_stage_new``).
        self._writer = threading.RLock()
        self._lock = threading.RLock()
        self._fpmap = FingerprintMap()
        self._tokens = TokenStore(chunk_size)
        # contents: fingerprint and first occupant
        self._c = Columns({"fp": np.uint64, "occ": np.int32})
        # occupants: content row, next occupant, token offset, first claim
        self._o = Columns({"content": np.int32, "next": np.int32, "offset": np.int64, "claim": np.int32})
        self._o_hash: list[bytes | None] = []
        self._hash_bytes = 0  # sum of sys.getsizeof over live chunk hashes (kept, not walked)
        # claims: namespace id, next claim
        self._k = Columns({"ns": np.int32, "next": np.int32})
        self._ns = NamespaceIds()
        self._collisions = 0
        self._rebuilds = 0
        self._slot_writes = 0  # odd while a slot-table write runs (see _match)

    @property
    def write_lock(self) -> threading.RLock:
        """The lock every write takes to change what lookups see; writes under one hold are
        seen by lookups at once. Take :attr:`writer_lock` first (lock order)."""
        return self._lock

    @property
    def writer_lock(self) -> threading.RLock:
        """The lock that keeps writers one at a time, taken before :attr:`write_lock`.
        A holder of both for a run of writes lets ``add_many`` stage without lookups
        waiting only when it takes :attr:`write_lock` through ``before_publish``."""
        return self._writer

    @property
    def engine(self) -> Engine:
        """The engine answering now (the chosen one, or the CPU engine after a GPU failover)."""
        return self._failover.active

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
        with self._writer, self._lock:
            view = self._add_locked(arr, fp, chunk_hash, offset, ns)
            self._maybe_rebuild()
            return view

    def add_many(self, tokens2d: Any, chunk_hashes: Sequence[bytes], token_offsets: Any,
                 namespaces: BlendNamespace | Sequence[BlendNamespace],
                 before_publish: Callable[[], None] | None = None) -> list[np.ndarray | None]:
        """``add`` for many chunks at once: the same results as calling ``add`` for each row in
        order, with the per-chunk Python overhead batched away (new contents are inserted with
        a handful of array operations). All input is validated before anything is applied.

        New contents are staged (copied into free rows) before :attr:`write_lock` is taken
        and published under it. ``before_publish`` runs before the first publish: the key
        directory takes its run-long hold there, after the copy.
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
        # pass (a row's duplicates in later parts find it in the fingerprint map). A caller
        # that passes ``before_publish`` keeps the lock from the first publish to its run's
        # end anyway: one part, all of it staged before the hold.
        step = n if before_publish is not None else self.ADD_MANY_ROWS_PER_LOCK
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            part: list[np.ndarray | None] = [None] * (hi - lo)
            nss = Repeat(ns_list.value, hi - lo) if isinstance(ns_list, Repeat) else ns_list[lo:hi]
            hashes = chunk_hashes[lo:hi] if (lo, hi) != (0, n) else chunk_hashes
            with self._writer:
                staged = self._stage_part(arr[lo:hi], fps[lo:hi], hashes, offsets[lo:hi], nss, part)
                if before_publish is not None:
                    before_publish()
                    before_publish = None
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

    def warm_up(self) -> None:
        """Run every compiled path once on a private throw-away index with this engine and
        chunk size (bulk and single adds, a probe with a hit, verification, removals), so the
        first real request pays no JIT compilation or cache load. State of ``self`` is
        untouched; safe to call at start-up from the thread that will serve lookups."""
        scratch = BlendIndex(self.chunk_size, self.probe_stride, self._failover, self.filter)
        ns = BlendNamespace("blendmatch-warm-up")
        rows = np.arange(2 * self.chunk_size, dtype=np.uint32).reshape(2, self.chunk_size)
        scratch.add_many(rows, [b"warm-0", b"warm-1"], [0, self.chunk_size], ns)
        scratch.add(rows[0], b"warm-2", 0, ns)
        scratch.match_batch([(rows.reshape(-1), ns), (rows[1], BlendNamespace("other"))])
        scratch.remove_claim(rows[0], b"warm-0", ns)
        scratch.remove_chunk(rows[1], b"warm-1")

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

    # ------------------------------------------------------------------ public: reads
    def match(self, tokens: Any, ns: BlendNamespace) -> list[BlendMatch]:
        """``match_batch([(tokens, ns)])[0]``."""
        return self.match_batch([(tokens, ns)])[0]

    def match_batch(self, queries: Sequence[tuple[Any, BlendNamespace]]) -> list[list[BlendMatch]]:
        """Matches for each query, in order: ascending ``cur_st``, at most one per position and
        one per chunk hash (the per-position rule of the module docstring)."""
        return self.match_batch_detailed(queries)[0]

    def match_batch_detailed(self, queries: Sequence[tuple[Any, BlendNamespace]]
                             ) -> tuple[list[list[BlendMatch]], MatchStats]:
        """``match_batch`` plus what it cost (windows, survivors, rejections, timings)."""
        arrays = []
        namespaces = []
        for i, item in enumerate(queries):
            try:
                tokens, ns = item
            except (TypeError, ValueError):
                raise ValueError(f"query {i}: expected a (tokens, BlendNamespace) pair") from None
            arrays.append(as_tokens(tokens, name=f"query {i} tokens"))
            check_namespace(ns)
            namespaces.append(ns)
        if not arrays:
            return [], MatchStats()
        return self._match(QueryBatch.from_queries(arrays, self.chunk_size, self.probe_stride), namespaces)

    def match_flat(self, tokens: np.ndarray, offsets: np.ndarray, namespaces: Sequence[BlendNamespace]
                   ) -> tuple[list[list[BlendMatch]], MatchStats]:
        """:meth:`match_batch_detailed` of queries already back to back in one uint32 buffer:
        query ``q`` is ``tokens[offsets[q]:offsets[q+1]]`` (``tokens.decode_query_tokens``
        builds them). The engine probes the buffer as it is: no copy."""
        for i, ns in enumerate(namespaces):
            check_namespace(ns)
        if len(namespaces) != offsets.shape[0] - 1:
            raise ValueError(f"{len(namespaces)} namespaces for {offsets.shape[0] - 1} queries")
        if not namespaces:
            return [], MatchStats()
        return self._match(QueryBatch(tokens, offsets, self.chunk_size, self.probe_stride), list(namespaces))

    @property
    def pipelined(self) -> bool:
        """Whether :meth:`match_flat_async` overlaps batches (the engine is a device pipeline):
        only then does a caller gain by submitting the next batch before collecting one."""
        return self._failover.pipelined

    def lend_tokens(self, num_queries: int, num_tokens: int) -> np.ndarray | None:
        """Where to decode the next batch's tokens so the engine uploads them without a host
        copy (``CupyEngine.lend_tokens``: its pinned staging area), or None. For
        ``tokens.decode_query_tokens(..., out=index.lend_tokens)``."""
        return self._failover.lend_tokens(num_queries, num_tokens)

    def match_flat_async(self, tokens: np.ndarray, offsets: np.ndarray, namespaces: Sequence[BlendNamespace]
                         ) -> "PendingMatch":
        """:meth:`match_flat` in two steps: this submits the probe (on a device engine it runs
        while the caller prepares the next batch); ``result()`` of what it returns waits for
        it, verifies and returns what :meth:`match_flat` returns. Bad input raises here."""
        for ns in namespaces:
            check_namespace(ns)
        if len(namespaces) != offsets.shape[0] - 1:
            raise ValueError(f"{len(namespaces)} namespaces for {offsets.shape[0] - 1} queries")
        batch = QueryBatch(tokens, offsets, self.chunk_size, self.probe_stride)
        if not namespaces:
            return PendingMatch(self, batch, [], None)
        t0 = time.perf_counter()
        seen = self._slot_writes
        return PendingMatch(self, batch, list(namespaces), (seen, probe_async(self._failover, batch, self._slots), t0))

    def _match(self, batch: QueryBatch, namespaces: list[BlendNamespace],
               first: tuple[int, ProbeHandle, float] | None = None) -> tuple[list[list[BlendMatch]], MatchStats]:
        """Probe outside the lock, verify under it: one state of the index, so writes held
        under :attr:`write_lock` together are seen all or none. A probe that raced slot
        writes (``_slot_writes`` changed, or odd: one in progress) may have missed new
        slots: it runs again (``reprobes``), the last time with the lock held. ``first``:
        the first probe already submitted (``(slot writes seen, handle, start)``)."""
        stats = MatchStats(queries=batch.num_queries, tokens=batch.num_tokens)
        results: list[list[BlendMatch]] = [[] for _ in namespaces]
        t0 = time.perf_counter() if first is None else first[2]
        found = None
        for attempt in range(self.PROBE_TRIES + 1):
            last = attempt == self.PROBE_TRIES
            if last:
                self._lock.acquire()  # writers held off: the probe and verification see one state
            try:
                if attempt == 0 and first is not None:
                    seen, cands = first[0], first[1].result()
                else:
                    seen = self._slot_writes
                    cands = self._probe(batch)
                t1 = time.perf_counter()
                with self._lock:
                    if last or (seen == self._slot_writes and not seen & 1):
                        if len(cands):
                            found = self._verify_locked(batch, cands, namespaces, stats)
                        break
            finally:
                if last:
                    self._lock.release()
            stats.reprobes += 1
        stats.engine_s = t1 - t0
        stats.engine_name = self.engine.name
        stats.engine_timings = dict(cands.timings)
        stats.windows = cands.windows
        stats.survivors = len(cands)
        if found is not None:
            make = tuple.__new__  # BlendMatch(h, old, st) without the NamedTuple's Python __new__
            for q, st, h, old in zip(*found):
                results[q].append(make(BlendMatch, (h, old, st)))
        stats.verify_s = time.perf_counter() - t1
        return results, stats

    #: Probes of one ``match`` outside the lock before one under it (see ``_match``).
    PROBE_TRIES = 2

    def _slots_write(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run a slot-table write (insert, rebuild or adopt; lock held) between two
        increments of ``_slot_writes``, so a concurrent probe can tell it may have missed
        slots. Returns what ``fn`` returns."""
        self._slot_writes += 1
        try:
            return fn(*args, **kw)
        finally:
            self._slot_writes += 1

    def stats(self) -> dict[str, Any]:
        """Counts and sizes (cheap; safe to call from a metrics scrape). Waits for a
        writer: staged contents are counted once published."""
        with self._writer, self._lock:
            out: dict[str, Any] = {
                "chunk_size": self.chunk_size,
                "probe_stride": self.probe_stride,
                "num_contents": self._c.live,
                "num_chunks": self._o.live,
                "num_claims": self._k.live,
                "num_namespaces": self._ns.live(),
                "collisions": self._collisions,
                "rebuilds": self._rebuilds,
                "engine": self.engine.name,
                "engine_reason": self.engine.reason,
                "engine_failovers": self._failover.failovers,
                "memory_bytes": self._memory_bytes_locked(),
            }
            out.update(self._slots.stats())
            return out

    def memory_bytes(self) -> int:
        """Resident bytes of the index's structures, tokens included (capacity, not just use)."""
        with self._writer, self._lock:
            return self._memory_bytes_locked()

    @property
    def slots(self) -> SlotArray:
        """The slot array (engines read it; do not mutate)."""
        return self._slots

    # ------------------------------------------------------------------ checkpoints
    def export_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Everything that decides an answer, as ``(doc, arrays)``: a JSON-able document and
        raw buffers (views, not copies). Call with the owner's (directory's) lock held so no
        write runs, or in a forked copy of the process (``checkpoint.py``). Occupant and
        claim lists are exported as the linked columns they are, so first-indexed order
        (LMCache's per-position rule) survives a restore exactly; so do the free lists, so
        later adds reuse the same rows."""
        c_cols, c_free = self._c.export()
        o_cols, o_free = self._o.export()
        k_cols, k_free = self._k.export()
        hashes = self._o_hash
        lengths = np.fromiter((-1 if h is None else len(h) for h in hashes), dtype=np.int32, count=len(hashes))
        blob = b"".join(h for h in hashes if h is not None)
        doc = {"chunk_size": self.chunk_size, "probe_stride": self.probe_stride, "filter": self.filter,
               "collisions": self._collisions, "rebuilds": self._rebuilds, **self._ns.export(),
               "sizes": {"c": self._c.size, "o": self._o.size, "k": self._k.size},
               "fpmap": {"live": self._fpmap.live, "tombstones": self._fpmap.tombstones},
               "slots": {"size": self._slots.size, "floor_size": self._slots.floor_size}}
        arrays: dict[str, Any] = {f"c_{k}": v for k, v in c_cols.items()}
        arrays.update({f"o_{k}": v for k, v in o_cols.items()})
        arrays.update({f"k_{k}": v for k, v in k_cols.items()})
        arrays.update({"c_free": np.asarray(c_free, dtype=np.int64), "o_free": np.asarray(o_free, dtype=np.int64),
                       "k_free": np.asarray(k_free, dtype=np.int64), "fp_keys": self._fpmap.keys,
                       "fp_vals": self._fpmap.vals, "o_hash_len": lengths,
                       "o_hash_blob": np.frombuffer(blob, dtype=np.uint8),
                       "tokens": self._tokens.export_parts(self._c.size)})
        return doc, arrays

    def restore_state(self, doc: dict[str, Any], read: Any) -> None:
        """Replace this (empty) index's state by an :meth:`export_state` of an index with
        the same chunk size, stride and filter. ``read(name, out=None) -> ndarray`` returns a
        verified buffer (``out``: read into it). The slot array is rebuilt from the live
        fingerprints at the saved size (a new generation: engines upload it whole); it may
        then hold fewer stale shared slots than before, which changes no answer. Raises
        ``ValueError`` when the parameters differ or the state is inconsistent."""
        for name, mine in (("chunk_size", self.chunk_size), ("probe_stride", self.probe_stride),
                           ("filter", self.filter)):
            if doc[name] != mine:
                raise ValueError(f"checkpoint has {name} {doc[name]!r}, this server {mine!r}")
        sizes = doc["sizes"]
        c_size, o_size, k_size = int(sizes["c"]), int(sizes["o"]), int(sizes["k"])
        with self._writer, self._lock:
            if self._c.live or self._o.live:
                raise ValueError("restore_state needs an empty index")
            # read (and so verify) everything before changing anything
            tokens = self._tokens.restore_buffer(c_size)
            read("tokens", tokens)
            got = {name: read(name) for name in ("c_fp", "c_occ", "c_free", "o_content", "o_next", "o_offset",
                                                 "o_claim", "o_free", "k_ns", "k_next", "k_free", "fp_keys",
                                                 "fp_vals", "o_hash_len", "o_hash_blob")}
            lengths = got["o_hash_len"]
            blob = got["o_hash_blob"].tobytes()
            if lengths.shape[0] > o_size or int(lengths[lengths > 0].sum()) != len(blob):
                raise ValueError("occupant chunk hashes do not match their lengths")
            self._c.restore({k: got[f"c_{k}"] for k in ("fp", "occ")}, c_size, got["c_free"].tolist())
            self._o.restore({k: got[f"o_{k}"] for k in ("content", "next", "offset", "claim")}, o_size,
                            got["o_free"].tolist())
            self._k.restore({k: got[f"k_{k}"] for k in ("ns", "next")}, k_size, got["k_free"].tolist())
            self._fpmap.restore(got["fp_keys"], got["fp_vals"], doc["fpmap"]["live"], doc["fpmap"]["tombstones"])
            self._o_hash = split_hashes(blob, lengths)
            live_hashes = [h for h in self._o_hash if h is not None]
            same = live_hashes and int(lengths.min()) == int(lengths.max())
            self._hash_bytes = (len(live_hashes) * sys.getsizeof(live_hashes[0]) if same
                                else sum(map(sys.getsizeof, live_hashes)))
            self._tokens.adopt(tokens)
            self._ns.restore(doc)
            self._collisions = int(doc["collisions"])
            self._rebuilds = int(doc["rebuilds"])
            self._slots.floor_size = int(doc["slots"]["floor_size"])
            self._slots_write(self._slots.rebuild, self._live_fps(), size=int(doc["slots"]["size"]))

    def token_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        """Read-only views of content rows ``rows`` (what ``add`` returned for them); used
        to re-attach a restored directory's bindings to the index's own rows."""
        return self._tokens.rows(np.asarray(rows, dtype=np.int64))

    def locate_rows(self, views: list) -> np.ndarray:
        """For each array: the content row it is a view of, or -1 (see ``TokenStore.locate``)."""
        return self._tokens.locate(views)

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

    def _memory_bytes_locked(self) -> int:
        # O(1): scraped by /metrics. The hash list by its length, not its capacity: the
        # capacity depends on how the list grew (one insert of 5,000 or 200 of 25), and
        # replicas that applied the same log in different runs must report the same state.
        hashes = _EMPTY_LIST_BYTES + 8 * len(self._o_hash) + self._hash_bytes
        return (self._tokens.nbytes() + self._fpmap.nbytes() + self._c.nbytes() + self._o.nbytes()
                + self._k.nbytes() + self._slots.nbytes + hashes)

    # ------------------------------------------------------------------ internals: reads
    def _probe(self, batch: QueryBatch) -> Candidates:
        return self._failover.probe(batch, self._slots)

    def _verify_locked(self, batch: QueryBatch, cands: Candidates, namespaces: list[BlendNamespace],
                       stats: MatchStats) -> tuple[list[int], list[int], list[bytes], list[int]]:
        """Verification and the per-position rule (``verify.per_position_rule``), lock held:
        time and memory linear in candidates plus occupants. Per match: its query, position,
        chunk hash and stored offset, as columns. Its kernels keep the GIL (a release inside
        the hold kept the lock held for a turn of the event loop)."""
        q_ns = np.fromiter((self._ns.get(ns) for ns in namespaces), dtype=np.int64, count=len(namespaces))
        rows = self._fpmap.lookup_in_hold(cands.fingerprint)
        args = (cands.query_index, cands.cur_st, rows, q_ns, batch.tokens, batch.offsets, self.chunk_size,
                self._tokens.blocks, self._tokens.shift, self._tokens.mask, self._c["occ"], self._o["next"],
                self._o["claim"], self._k["ns"], self._k["next"])
        ci, oi, misses, ns_skip, rejects, steps = per_position_rule(*args, NO_KEYS, False)
        hashes = list(map(self._o_hash.__getitem__, oi.tolist()))
        qidx = cands.query_index[ci].tolist()
        if len(set(zip(qidx, hashes))) != len(hashes):
            # One chunk hash occupies two contents (possible through this class's API, never
            # through the directory's): "taken" must go by hash, not by occupant.
            keys = hash_keys(rows, self._c["occ"], self._o["next"], self._o_hash)
            ci, oi, misses, ns_skip, rejects, steps = per_position_rule(*args, keys, True)
            hashes = list(map(self._o_hash.__getitem__, oi.tolist()))
            qidx = cands.query_index[ci].tolist()
        stats.dict_misses, stats.ns_filtered, stats.token_rejections = int(misses), int(ns_skip), int(rejects)
        stats.occupant_steps = int(steps)
        stats.matches = len(hashes)
        return qidx, cands.cur_st[ci].tolist(), hashes, self._o["offset"][oi].tolist()


class PendingMatch:
    """A batch submitted by :meth:`BlendIndex.match_flat_async`; ``result()`` waits for its
    probe, verifies it and returns ``(results, stats)`` as :meth:`BlendIndex.match_flat`."""

    def __init__(self, index: BlendIndex, batch: QueryBatch, namespaces: list[BlendNamespace],
                 first: tuple[int, ProbeHandle, float] | None) -> None:
        self.index, self.batch, self.namespaces, self._first = index, batch, namespaces, first

    def result(self) -> tuple[list[list[BlendMatch]], MatchStats]:
        if not self.namespaces:
            return [], MatchStats()
        return self.index._match(self.batch, self.namespaces, self._first)
