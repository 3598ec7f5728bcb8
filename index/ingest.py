"""The ingest path: the one way cache events change the key directory and the blend index.

Question answered: "what does a run of event requests do to the bindings, the usage ledger
and the blend index?" One entry point, :meth:`IngestPath.apply_run` (a single request is a
run of one), called with the directory's lock held (``key_directory.py``). Each batch
passes the gate (``gate.py``) in order; an admitted batch is applied by its type: STORE
(below), DELETE and fencing (``bindings.py``), ACCESS (counted), CONFIG (declared capacity,
``capacity.py``).

STORE, per entry (each rule is a test in ``tests/test_key_directory.py``):
- first content for a binding claims it for the namespace of every key bound to it;
- a key joining a binding that has content claims its namespace at once, even when its
  own STORE carries no tokens;
- identical content again updates the offset (a known offset; -1 never downgrades);
- different content retires the old content for every namespace at once
  (``BlendIndex.remove_chunk``) and then claims the new one for every namespace; the
  offset is the new STORE's (possibly -1: an offset belongs to the content it came with);
- a namespace's claim goes when its last key leaves the binding (``bindings.py``);
- offsets travel with content: a STORE without usable tokens never changes the offset;
- token ids outside uint32 leave the binding as it was (the placement is applied, a
  warning logged, ``entries_unfilled`` counted): the entry counts as a STORE without tokens;
- what is claimed at all is decided by ``indexable.py`` (one rule, which also names the
  reason counted in ``entries_not_indexable``): content whose length is not the chunk size
  stays in the binding but is not indexed, and a world-size-0 namespace is never claimed;
- stores from before blend lookup was enabled are not back-filled: a binding joins the
  index only when a STORE carrying its content arrives after enabling.

One deferral buffer (:class:`_IndexAdds`): every index add of a run waits there and goes to
the index as one ``add_many``, with the same resulting state as adding one by one: the
buffer is flushed before any removal and before any batch other than a STORE of new,
distinct chunk hashes with indexable content (nothing else reads what it wrote; writes to
different chunk hashes commute, and ``add_many`` applies rows in order), and at the end of
the run, before the lock is released. Why: a log transport carries one small batch per
record (LMCache's Kafka sink: ~25 entries); applied one by one each paid the index's fixed
cost of an insert (~110 us). Entries of new, distinct chunk hashes (the steady state) take
the vector form (:meth:`IngestPath._bind_new`): their token block goes to the buffer as it
is, and each binding is built once. Measured: ``docs/performance.md``,
``python -m blendmatch.bench.events``.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from itertools import repeat
from operator import itemgetter
from typing import Any, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np

from .bindings import Binding, BindingStore, FenceResult, Member
from .blend_index import BlendIndex
from .capacity import CapacityDeclarations, UsageLedger
from .gate import Admission, IngestGate
from .holders import HolderWatch
from .indexable import NOT_INDEXABLE_REASONS, entries_indexable, entry_indexable, indexable_reason, namespace_indexable
from .logsafe import log_safe
from .holder_log import find
from .placements import L1, SHARED_POOL_INSTANCE, Placement
from .types import BlendNamespace
from .wire import EntryColumns, EventBatch, EventRequest, KeyScope, TokenColumn

__all__ = ["ApplyCounts", "ApplyReport", "IngestPath"]

log = logging.getLogger(__name__)


class ApplyCounts(NamedTuple):
    """Batches of one request: applied, dropped as duplicates, dropped as stale.
    ``_asdict()`` is the ``POST /events`` response body."""

    applied: int
    duplicates: int
    stale: int


class ApplyReport(NamedTuple):
    """What one request did: the batch counts (LMCache's reply) plus our per-entry counts:
    entries of applied batches, and applied STORE entries that fed nothing to the blend
    index, by reason (:data:`NOT_INDEXABLE_REASONS`; empty while blend lookup is off)."""

    counts: ApplyCounts
    entries_applied: int
    not_indexable: dict[str, int]

    def as_wire(self) -> dict[str, Any]:
        """The ``POST /events`` reply: ``{applied, duplicates, stale}`` plus our extra fields."""
        return {**self.counts._asdict(), "entries_applied": self.entries_applied,
                "entries_not_indexable": dict(self.not_indexable)}


_Ns = Union[BlendNamespace, list[BlendNamespace]]


class _IndexAdds:
    """The one deferral buffer: index adds waiting for one ``add_many`` (module docstring).

    Blocks of token rows in order, and per row its chunk hash, offset, the binding that
    receives the index's row, and what that binding held when it was queued (``sent``:
    the view of the batch's tokens, or None for a new binding waiting for its first
    content). ``views``: bindings given a view of a batch's token buffer, which keep a
    private copy unless the index's row replaced it."""

    __slots__ = ("blocks", "namespaces", "hashes", "offsets", "bindings", "sent", "views")

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []
        self.namespaces: list[_Ns] = []
        self.hashes: list[bytes] = []
        self.offsets: list[int] = []
        self.bindings: list[Binding] = []
        self.sent: list[Optional[np.ndarray]] = []
        self.views: list[tuple[Binding, np.ndarray]] = []

    def add_block(self, block: np.ndarray, hashes: Sequence[bytes], offsets: Sequence[int], namespaces: _Ns,
                  bindings: Sequence[Binding], sent: Optional[Sequence[np.ndarray]] = None) -> None:
        self.blocks.append(block)
        self.namespaces.append(namespaces)
        self.hashes.extend(hashes)
        self.offsets.extend(offsets)
        self.bindings.extend(bindings)
        self.sent.extend(repeat(None, len(bindings)) if sent is None else sent)

    def flush(self, index: Optional[BlendIndex]) -> None:
        """Run the adds as one ``add_many`` (in the run's write session: the hold starts at
        its publish); each binding keeps the index's row (no copy), else a private copy (never a view of
        a batch's buffer)."""
        if self.blocks:
            assert index is not None  # only an enabled directory queues adds
            blocks, nss = self.blocks, self.namespaces
            tokens = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
            first = nss[0]
            if isinstance(first, BlendNamespace) and all(ns is first for ns in nss):
                arg: _Ns = first
            else:
                arg = []
                for ns, block in zip(nss, blocks):
                    arg.extend(repeat(ns, block.shape[0]) if isinstance(ns, BlendNamespace) else ns)
            results = index.add_many(tokens, self.hashes, self.offsets, arg)
            for k, (b, sent, row) in enumerate(zip(self.bindings, self.sent, results)):
                if sent is None:
                    b.tokens = row if row is not None else _own_copy(tokens[k])
                elif row is not None and b.tokens is sent:
                    b.tokens = row
            self.blocks, self.namespaces, self.hashes, self.offsets = [], [], [], []
            self.bindings, self.sent = [], []
        views = self.views
        if views:
            self.views = []
            for b, view in views:
                if b.tokens is view:
                    b.tokens = _own_copy(view)


class _BatchAdds:
    """Adds queued one entry at a time while a STORE batch applies (entries whose chunk hash
    is bound); sealed into the run's :class:`_IndexAdds` as one block gathered from the
    batch's token buffer in one step."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[Binding, np.ndarray, bytes, int, BlendNamespace, int]] = []

    def add(self, b: Binding, chunk_hash: bytes, ns: BlendNamespace, row: int) -> None:
        self.ops.append((b, b.tokens, chunk_hash, b.offset, ns, row))  # type: ignore[arg-type]

    def seal(self, adds: _IndexAdds, column: TokenColumn) -> None:
        if not self.ops:
            return
        bs, sent, hashes, offsets, nss, rows = zip(*self.ops)
        self.ops.clear()
        block = column.rows(rows) if min(rows) >= 0 else np.stack(sent)
        first = nss[0]
        adds.add_block(block, hashes, offsets, first if all(ns is first for ns in nss) else list(nss), bs, sent)


class IngestPath:
    """The gate, the apply rules and their counters (see the module docstring)."""

    def __init__(self, store: BindingStore, capacity: CapacityDeclarations, usage: UsageLedger,
                 index: Optional[BlendIndex] = None) -> None:
        self.gate = IngestGate()
        self.store = store
        self.capacity = capacity
        self.usage = usage
        self.index = index
        self._adds = _IndexAdds()
        self.watch: Optional[HolderWatch] = None  # the holder-set hook (holders.py), if any
        self.entries_stored = 0
        self.entries_deleted = 0
        self.entries_unfilled = 0
        self.entries_accessed = 0
        self.entries_applied = 0
        self.not_indexable = dict.fromkeys(NOT_INDEXABLE_REASONS, 0)
        self._warned: set[tuple[str, str]] = set()  # (instance, reason) already logged once

    # ------------------------------------------------------------------ the entry point
    def apply_run(self, requests: Sequence[EventRequest]) -> list[Union[ApplyReport, Exception]]:
        """Apply validated requests in order (the caller holds the directory's lock): each
        result is its :class:`ApplyReport`, or the exception it raised (the others still
        apply; one that raised may be partly applied)."""
        out: list[Union[ApplyReport, Exception]] = []
        with self._write_session():
            try:
                for parsed in requests:
                    try:
                        out.append(self._apply_request(parsed))
                    except Exception as exc:  # noqa: BLE001 - reported to the caller per request
                        self._flush()
                        out.append(exc)
            finally:
                self._flush()
        return out

    def fence(self, instance_id: str) -> FenceResult:
        """Fence ``instance_id``'s private L1 placements (``BindingStore.fence``), seen by
        lookups all at once."""
        watch = self.watch
        with self._write_session():
            self._flush()
            if watch is None:
                return self.store.fence(instance_id)
            token = watch.before_fence(self.store.bindings, instance_id, self.store.l1_chunks_of(instance_id))
            try:  # a fence from outside the event stream: a batch boundary of its own
                result = self.store.fence(instance_id)
                watch.after_fence(self.store.bindings, token)
            finally:
                watch.commit()
            return result

    def _write_session(self) -> AbstractContextManager[object]:
        """The index's write session for a run (or a fence): its first index write that
        lookups can see takes the index's writer and write locks and keeps them to the end,
        so that a lookup sees all of the run's effect or none of it
        (``BlendIndex.write_session``; lock order directory -> index writer -> index write
        lock). Taken at the first such write, not at the start: verification waits from
        there to the end of the run (for the steady state, a run of new content, that is
        the publish of its one ``add_many``). No index: nothing to hold."""
        return nullcontext() if self.index is None else self.index.write_session()

    def _flush(self) -> None:
        if self._adds.blocks:
            if not self.index.session_holds:  # type: ignore[union-attr]
                # a new token block, if one is needed, is mapped before the hold
                self.index.prepare_add(len(self._adds.hashes))  # type: ignore[union-attr]
        # The hold starts inside add_many, after its new contents are staged (copied into
        # rows no lookup reaches): verification waits for the publish, not for the copy.
        self._adds.flush(self.index)

    def _apply_request(self, parsed: EventRequest) -> ApplyReport:
        applied = duplicates = stale = entries = 0
        skipped = dict.fromkeys(NOT_INDEXABLE_REASONS, 0)
        for batch in parsed.batches:
            verdict = self.gate.admit(batch.instance_id, batch.incarnation, batch.seq)
            if verdict is Admission.DUPLICATE:
                duplicates += 1
                continue
            if verdict is Admission.STALE:
                stale += 1
                continue
            # whether a STORE's chunk hashes are distinct and all unbound (the steady state),
            # asked once per batch: the deferral, the byte accounting and the apply read it
            fresh = self._fresh(batch) if verdict is Admission.APPLY and batch.event_type == "store" else None
            if verdict is not Admission.APPLY or not self._defers(batch, fresh):
                self._flush()  # every other write sees the index as if applied in order
            watch = self.watch
            seen = None
            try:
                if verdict is Admission.FENCE_AND_APPLY:
                    fence = watch.before_fence(self.store.bindings, batch.instance_id,
                                               self.store.l1_chunks_of(batch.instance_id)) if watch else None
                    result = self.store.fence(batch.instance_id)
                    if watch:
                        watch.after_fence(self.store.bindings, fence)  # type: ignore[arg-type]
                    log.info("instance %s restarted (incarnation %d): fenced %d L1 placements",
                             log_safe(batch.instance_id), batch.incarnation, result.placements)
                seen = watch.before_batch(self.store.bindings, batch) if watch else None
                self._apply_batch(batch, skipped, fresh)
            finally:
                if watch:  # also after a failure: compare whatever the batch changed
                    watch.after_batch(self.store.bindings, batch, seen, settle=self._flush)
                    watch.commit()
            applied += 1
            entries += len(batch.entries)
        self.entries_applied += entries
        return ApplyReport(ApplyCounts(applied, duplicates, stale), entries,
                           {k: v for k, v in skipped.items() if v})

    def _apply_batch(self, batch: EventBatch, skipped: dict[str, int], fresh: Optional[bool]) -> None:
        """``fresh``: :meth:`_fresh` of a STORE batch asked before it (None: ask now, after
        a fence that may have unbound some of its chunk hashes)."""
        kind = batch.event_type
        self.store.reporters.add(batch.instance_id)
        if kind == "store":
            if fresh is None:
                fresh = self._fresh(batch)
            self._classify_store(batch, skipped, fresh)
            self._store(batch, fresh)
        elif kind == "delete":
            self.store.delete(batch)
            self.entries_deleted += len(batch.entries)
        elif kind == "access":
            self.store.record_access(batch)
            self.entries_accessed += len(batch.entries)
        else:
            self._config(batch)

    def _fresh(self, batch: EventBatch) -> bool:
        """A STORE batch's chunk hashes are distinct and none is bound yet."""
        entries = batch.entries
        return entries.distinct_hashes and self.store.bindings.keys().isdisjoint(entries.chunk_hashes)

    def _defers(self, batch: EventBatch, fresh: Optional[bool]) -> bool:
        """Whether ``batch`` may go on without a flush: a STORE of distinct chunk hashes, none
        bound yet, every entry indexable (its token block then joins the buffer as it is).
        Nothing else reads what it writes before the flush (its hashes are new; the checks
        of later batches read bindings, never the index, and any other batch flushes first)."""
        index = self.index
        entries = batch.entries
        if index is None or not fresh or not len(entries):  # fresh: a STORE's, None for the rest
            return False
        return entries_indexable(entries, index.chunk_size)

    def _config(self, batch: EventBatch) -> None:
        """Record one compartment of an instance's capacity declaration: a newer
        ``(incarnation, capacity_revision)`` stamp replaces the instance's declaration, an
        equal one extends it, an older one is dropped (``capacity.CapacityDeclarations``)."""
        if not self.capacity.consume(batch.instance_id, batch.incarnation, batch.capacity_revision, batch.tier,
                                     batch.backend, batch.capacity_bytes, batch.shared):
            log.info("capacity declaration from %s (incarnation %d, revision %d) is older than the one held; "
                     "dropped", log_safe(batch.instance_id), batch.incarnation, batch.capacity_revision)

    # ------------------------------------------------------------------ STORE: accounting
    def _classify_store(self, batch: EventBatch, skipped: dict[str, int], fresh: bool) -> None:
        """Before a STORE batch is applied: account its placement bytes (the usage ledger,
        from the placements it replaces) and count its entries that will feed nothing to the
        blend index, by :func:`indexable_reason` (logged once per instance and reason).
        Reads the state the store is about to change, so it runs first. A batch with nothing
        unusual (the norm) is cleared column-wise, without a call per entry."""
        entries = batch.entries
        n = len(entries)
        if not n:
            return
        self._account_store_bytes(batch, fresh)
        index = self.index
        if index is None:
            return
        size = index.chunk_size
        if entries_indexable(entries, size):
            return
        column = entries.tokens
        unfilled = set(column.unfilled)
        lengths = column.lengths
        bindings = self.store.bindings
        for i, (h, scope, off) in enumerate(zip(entries.chunk_hashes, entries.scopes, entries.offsets)):
            known = off >= 0
            if not known and lengths[i]:
                b = bindings.get(h)
                known = not (b is None or b.offset < 0 or b.tokens is None
                             or not np.array_equal(b.tokens, column.row(i)))
            reason = indexable_reason(unfilled=i in unfilled, length=lengths[i], chunk_size=size,
                                      namespace=scope.namespace, offset_known=known)
            if reason is None:
                continue
            skipped[reason] += 1
            self.not_indexable[reason] += 1
            if (batch.instance_id, reason) not in self._warned and len(self._warned) < 65536:
                self._warned.add((batch.instance_id, reason))
                log.warning("STORE entries from %s are not indexable for blend lookup (%s; first: chunk %s, "
                            "seq %d); counted in entries_not_indexable, logged once per instance and reason",
                            log_safe(batch.instance_id), reason, h.hex(), batch.seq)

    def _account_store_bytes(self, batch: EventBatch, fresh: bool) -> None:
        """Usage-ledger delta of a STORE batch: each entry adds a placement with its size, or
        replaces the same copy (same instance, tier, backend) of the same key."""
        entries = batch.entries
        owner = SHARED_POOL_INSTANCE if batch.shared else batch.instance_id
        ident = (owner, batch.tier, batch.backend)
        bindings = self.store.bindings
        if fresh:
            self.usage.add(owner, batch.tier, batch.backend, len(entries), sum(entries.sizes))
            return
        count = delta = 0
        seen: dict[tuple[bytes, KeyScope], int] = {}
        for h, scope, size in zip(entries.chunk_hashes, entries.scopes, entries.sizes):
            old = seen.get((h, scope))
            if old is None:
                b = bindings.get(h)
                if b is not None:
                    for sc, pls in b.members:
                        if sc == scope:
                            q = find(pls, ident)
                            if q is not None:
                                old = q.size_bytes
                            break
            if old is None:
                count += 1
                delta += size
            else:
                delta += size - old
            seen[(h, scope)] = size
        self.usage.add(owner, batch.tier, batch.backend, count, delta)

    # ------------------------------------------------------------------ STORE: apply
    def _store(self, batch: EventBatch, fresh: bool) -> None:
        """Apply a STORE batch. Entries whose chunk hash is already bound (or repeats within
        the batch) apply one by one, in order (:meth:`_store_entries`). When the batch's
        chunk hashes are distinct, the entries whose chunk hash is not bound yet are then
        bound in one vector step (:meth:`_bind_new`, the same rules for a one-key binding:
        nothing else can observe those bindings in between, and writes to different chunk
        hashes commute)."""
        entries = batch.entries
        n = len(entries)
        if not n:
            return
        hashes = entries.chunk_hashes
        bindings = self.store.bindings
        if not entries.distinct_hashes:
            one_by_one: Sequence[int] = range(n)
            new_rows: Sequence[int] = ()
        elif fresh:
            one_by_one, new_rows = (), range(n)
        else:
            bound = list(map(bindings.__contains__, hashes))
            one_by_one = [i for i, known in enumerate(bound) if known]
            new_rows = [i for i, known in enumerate(bound) if not known]
        if one_by_one:
            self._store_entries(batch, one_by_one)
        if new_rows:
            self._bind_new(batch, new_rows)
        self.entries_stored += n
        unfilled = entries.tokens.unfilled
        if unfilled:
            self.entries_unfilled += len(unfilled)
            log.warning("%d STORE entries from %s (seq %d) carry token ids outside 0..2^32-1; their "
                        "token bindings stay unfilled (first: chunk %s)", len(unfilled),
                        log_safe(batch.instance_id), batch.seq, entries.chunk_hashes[unfilled[0]].hex())

    def _store_entries(self, batch: EventBatch, rows: Sequence[int]) -> None:
        """Apply entries ``rows`` of a STORE batch one by one, in order; their index adds
        join the buffer as one block at the end (a removal flushes first)."""
        store = self.store
        entries = batch.entries
        column = entries.tokens
        lengths = column.lengths
        bindings = store.bindings
        l1_inst = batch.instance_id if batch.tier == L1 and not batch.shared else None
        gained: list[bytes] = []  # chunk hashes of keys that gained a private L1 copy on l1_inst
        placements: dict[int, Placement] = {}
        pending = _BatchAdds()
        hashes, scopes, sizes, offsets = entries.chunk_hashes, entries.scopes, entries.sizes, entries.offsets
        for i in rows:
            h, scope, size = hashes[i], scopes[i], sizes[i]
            p = placements.get(size)
            if p is None:
                p = placements[size] = store.placement_of(batch, size)
            b = bindings.get(h)
            if b is None:
                b = bindings[h] = Binding(())
            _, new_ns, gained_l1 = store.upsert(b, scope, p)
            if gained_l1:
                gained.append(h)
            if lengths[i]:
                self._store_content(b, h, scope, column, i, offsets[i], new_ns, pending)
            elif new_ns and b.indexed and b.tokens is not None:
                self._claim(b, h, (scope.namespace,), pending, -1)
        if gained:
            store.log_l1(l1_inst, gained)  # type: ignore[arg-type]
        pending.seal(self._adds, column)

    def _bind_new(self, batch: EventBatch, rows: Sequence[int]) -> None:
        """Entries ``rows`` of a STORE batch, whose chunk hashes are distinct and not bound:
        each gets a one-key binding, built column-wise with no per-entry lookups, content
        included (the vector form of :meth:`_store_entries` for this case)."""
        store = self.store
        entries = batch.entries
        n = len(rows)
        whole = n == len(entries)
        if whole:  # the whole batch: its columns as they are
            hashes, scopes, sizes, offsets = entries.chunk_hashes, entries.scopes, entries.sizes, entries.offsets
            lengths = entries.tokens.lengths
        else:
            pick = itemgetter(*rows) if n > 1 else (lambda col: (col[rows[0]],))
            hashes, scopes, sizes, offsets = (list(pick(col)) for col in (
                entries.chunk_hashes, entries.scopes, entries.sizes, entries.offsets))
            lengths = list(pick(entries.tokens.lengths))
        enabled = self.index is not None
        if sizes.count(sizes[0]) == n and scopes.count(scopes[0]) == n:  # one members tuple for all
            members: Iterable[tuple[Member, ...]] = repeat(
                store.single(scopes[0], store.placement_of(batch, sizes[0])), n)
        else:
            placement = {size: store.placement_of(batch, size) for size in set(sizes)}
            members = [store.single(sc, placement[sz]) for sc, sz in zip(scopes, sizes)]
        if lengths.count(0) == 0:
            bs = list(map(Binding, members, offsets, repeat(enabled, n)))
        else:
            bs = list(map(Binding, members, [o if ln else -1 for o, ln in zip(offsets, lengths)],
                          [enabled and ln > 0 for ln in lengths]))
        self._new_contents(rows if not whole else range(n), entries, bs, lengths)
        store.add_new(batch, hashes, bs)

    def _new_contents(self, rows: Sequence[int], entries: EntryColumns, bs: list[Binding],
                      lengths: Sequence[int]) -> None:
        """First content of the new one-key bindings ``bs`` (batch rows ``rows``): indexable
        content waits in the buffer (each binding gets the index's row at the flush), the
        rest gets a private copy now. Counts the new token bindings."""
        column = entries.tokens
        with_tokens = [k for k, ln in enumerate(lengths) if ln]
        self.store.num_with_tokens += len(with_tokens)
        index = self.index
        if index is not None and len(rows) == len(entries) and len(with_tokens) == len(rows) \
                and entries_indexable(entries, index.chunk_size):
            # the whole batch (rows are then 0..n-1 in order): its token block as is
            self._adds.add_block(column.rows(range(len(rows))), entries.chunk_hashes, entries.offsets,
                                 _namespace_arg(entries.scopes), bs)
            return
        size = index.chunk_size if index is not None else -1
        hashes, offsets, scopes = entries.chunk_hashes, entries.offsets, entries.scopes
        queued = []
        for k in with_tokens:
            i = rows[k]
            if index is not None and entry_indexable(lengths[k], size, offsets[i], scopes[i].namespace):
                queued.append(k)
            else:
                bs[k].tokens = _own_copy(column.row(i))
        if queued:
            sel = [rows[k] for k in queued]
            self._adds.add_block(column.rows(sel), [hashes[i] for i in sel], [offsets[i] for i in sel],
                                 _namespace_arg([scopes[i] for i in sel]), [bs[k] for k in queued])

    def _store_content(self, b: Binding, h: bytes, scope: KeyScope, column: TokenColumn, i: int,
                       offset: int, new_ns: bool, pending: _BatchAdds) -> None:
        """A STORE entry carrying usable tokens (row ``i`` of the batch)."""
        view = column.row(i)
        enabled = self.index is not None
        old = b.tokens
        if old is None:  # first content
            self.store.num_with_tokens += 1
            self._set_content(b, view, offset, enabled)
            if enabled:
                self._claim(b, h, self.store.namespaces(b), pending, i)
            return
        if old.tobytes() == view.tobytes():  # identical content
            if enabled and not b.indexed:  # first STORE of it since enabling: claim for all
                b.indexed = True
                if offset >= 0:
                    b.offset = offset
                self._claim(b, h, self.store.namespaces(b), pending, -1)
            elif offset >= 0 and offset != b.offset:
                b.offset = offset
                if b.indexed:
                    self._claim(b, h, self.store.namespaces(b), pending, -1)
            elif new_ns and b.indexed:
                self._claim(b, h, (scope.namespace,), pending, -1)
            return
        # different content: retire the old one for every namespace at once, then re-claim
        if b.indexed and self.store.content_in_index(b):
            pending.seal(self._adds, column)
            self._flush()
            self.index.remove_chunk(old, h)  # type: ignore[union-attr]
        self._set_content(b, view, offset, enabled)
        if enabled:
            self._claim(b, h, self.store.namespaces(b), pending, i)

    def _set_content(self, b: Binding, view: np.ndarray, offset: int, enabled: bool) -> None:
        b.tokens = view
        b.offset = offset
        b.indexed = enabled
        self._adds.views.append((b, view))

    def _claim(self, b: Binding, h: bytes, namespaces: Iterable[BlendNamespace], pending: _BatchAdds,
               row: int) -> None:
        """Queue an add for each namespace the content may be claimed for (``indexable.py``)."""
        if not self.store.content_in_index(b):
            return
        for ns in namespaces:
            if namespace_indexable(ns):
                pending.add(b, h, ns, row)

    # ------------------------------------------------------------------ checkpoints
    def export_state(self) -> dict[str, Any]:
        """This part's checkpoint state: the gate's cursors and the entry counters."""
        return {"gate": self.gate.export_state(),
                "counters": {"entries_stored": self.entries_stored, "entries_deleted": self.entries_deleted,
                             "entries_unfilled": self.entries_unfilled, "entries_accessed": self.entries_accessed,
                             "entries_applied": self.entries_applied,
                             "entries_not_indexable": dict(self.not_indexable)}}

    def restore_state(self, state: dict[str, Any]) -> None:
        """Load an :meth:`export_state` (counters absent from older checkpoints stay 0)."""
        c = state["counters"]
        self.entries_stored, self.entries_deleted = int(c["entries_stored"]), int(c["entries_deleted"])
        self.entries_unfilled, self.entries_accessed = int(c["entries_unfilled"]), int(c["entries_accessed"])
        self.entries_applied = int(c.get("entries_applied", 0))
        for reason, n in dict(c.get("entries_not_indexable", {})).items():
            if reason in self.not_indexable:
                self.not_indexable[reason] = int(n)
        self.gate.restore_state(state["gate"])

    def counters(self) -> dict[str, Any]:
        """The ``events`` counters of ``GET /directory/stats``."""
        return {**self.gate.counters(), "entries_stored": self.entries_stored,
                "entries_deleted": self.entries_deleted, "entries_accessed": self.entries_accessed,
                "entries_unfilled": self.entries_unfilled, "entries_applied": self.entries_applied,
                "entries_not_indexable": dict(self.not_indexable)}


def _namespace_arg(scopes: Sequence[KeyScope]) -> Union[BlendNamespace, list[BlendNamespace]]:
    """``add_many``'s namespaces: one when the rows share it (the norm: one scope per
    batch, compared by identity as scopes are interned), else one per row."""
    first = scopes[0]
    if scopes.count(first) == len(scopes):
        return first.namespace
    return [sc.namespace for sc in scopes]


def _own_copy(view: np.ndarray) -> np.ndarray:
    out = view.copy()
    out.setflags(write=False)
    return out
