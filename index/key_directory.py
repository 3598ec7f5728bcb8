"""KeyDirectory: where is each cached object, what tokens does each chunk hold, and the index.

Question answered: "given the fleet's cache-event stream, which keys are stored where, which
tokens does each chunk hash carry, and which chunks may a blend lookup offer to whom?" The
blend index (``blend_index.py``) is a derived view: nothing writes to it but this module.

State (DESIGN.md section 6):
- Placements per key: :class:`Placement` ``(instance_id, incarnation, tier, backend,
  size_bytes, shared)``, one per ``(instance_id, tier, backend)``. A shared-pool placement
  (``shared=true`` batches) belongs to no instance: it is stored with ``instance_id ""`` and
  incarnation 0, so every reporter of the same pool and tier updates (and any reporter's
  DELETE drops) the same one placement. A key's record dies with its last placement.
- Token binding per chunk hash: content (empty until a STORE carries tokens), its
  ``token_offset`` (-1 unknown) and the keys bound to it (every key of that chunk hash: one
  per rank / object group / model / salt). The binding dies with its last key.

Lifecycle -> index (exactly; each rule is a test in ``tests/test_key_directory.py``):
- first content for a binding claims it for the namespace of every key bound to it;
- a key joining a binding that has content claims its namespace at once, even when its
  own STORE carries no tokens;
- identical content again updates the offset (a known offset; -1 never downgrades);
- different content retires the old content for every namespace at once
  (``BlendIndex.remove_chunk``) and then claims the new one for every namespace; the
  offset is the new STORE's (possibly -1: an offset belongs to the content it came with);
- a namespace's claim goes (``remove_claim``) when its last key leaves the binding, by a
  DELETE of the key's last placement or by fencing;
- offsets travel with content: a STORE without usable tokens never changes the offset;
- token ids outside uint32 leave the binding as it was (the placement is applied, a
  warning logged, ``entries_unfilled`` counted): the entry counts as a STORE without tokens;
- content whose length is not the chunk size stays in the binding but is not indexed;
- stores from before :meth:`KeyDirectory.enable_blend_lookup` are not back-filled: a
  binding joins the index only when a STORE carrying its content arrives after enabling.

Memory (issue 3: at most 1.6 KB per stored 256-token chunk, index included): one dict
entry, the chunk hash bytes (the very object the index keeps too), a 4-slot
``_Binding`` and the token row the index returns (a view of the index's storage: the
directory keeps no copy of indexed tokens). Placements, key scopes and the members tuple
are interned: a fleet has few distinct ones, so a chunk's whole key record is shared.
Holding an index row is safe because the binding holds it only while its chunk hash is an
occupant of that content (it has at least one claim); the index reuses a row only after
its content's last occupant left.

Speed (issue 3 asks >= 200k STORE entries/s with 256 tokens): ``events.py`` converts tokens
in bulk (lists of ints, or packed arrays with no per-token work). A batch of distinct chunk
hashes none of which is bound (the steady state) is applied column-wise
(:meth:`KeyDirectory._store_all_new`): its whole token block goes to one
``BlendIndex.add_many`` without a copy, and each binding is built once, with the index's
row. Any other batch goes entry by entry, with index writes deferred and flushed as one
``add_many``. Deferral keeps the exact per-entry order: pending adds are flushed before any
removal, and writes to different chunk hashes commute. Measured figures: ``docs`` and
``python -m blendmatch.service.bench_events``.

GC note: every binding is a GC-tracked object, so a full collection walks them all
(~millions in a fleet; about 1 us per stored entry, amortised, at 100k entries on the dev
VM). The service may call ``gc.freeze()`` after bulk loads or raise the gen-2 threshold;
this module does not touch process-wide GC settings.

Thread safety: one lock (``self._lock``) guards all state; the index is called with it
held (lock order: directory -> index; the index never calls back). Blend lookups call the
index without the directory lock, so lookups do not wait for ingest.
"""

from __future__ import annotations

import logging
import threading
from itertools import repeat
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from blendmatch.gpu import Engine

from .blend_index import BlendIndex
from .gate import Admission, IngestGate
from .logsafe import log_safe
from .placements import L1, SHARED_POOL_INSTANCE, KeyPlacements, Placement, is_private_l1, placement_ident
from .wire import (
    TIERS,
    EntryColumns,
    EventBatch,
    EventRequest,
    KeyScope,
    TokenColumn,
    parse_event_batch,
    parse_event_request,
)
from .types import BlendMatch, BlendNamespace, ObjectKey

__all__ = [
    "SHARED_POOL_INSTANCE",
    "ApplyCounts",
    "BlendLookupDisabled",
    "FenceResult",
    "KeyDirectory",
    "KeyPlacements",
    "Placement",
]

log = logging.getLogger(__name__)

class ApplyCounts(NamedTuple):
    """Batches of one request: applied, dropped as duplicates, dropped as stale.
    ``_asdict()`` is the ``POST /events`` response body."""

    applied: int
    duplicates: int
    stale: int


class FenceResult(NamedTuple):
    """What fencing an instance dropped."""

    placements: int
    keys: int


class BlendLookupDisabled(RuntimeError):
    """A blend lookup was asked for before :meth:`KeyDirectory.enable_blend_lookup`."""


# (scope, placements sorted by (instance_id, tier, backend)); one per key bound to a chunk hash.
_Member = tuple[KeyScope, tuple[Placement, ...]]

#: Interned values kept at most (placements, members tuples); past it the table starts
#: over. Interning only saves memory; nothing relies on identity.
_INTERN_MAX = 1 << 14



class _Binding:
    """One chunk hash: its content, offset, keys, and whether it takes part in the index.

    ``tokens``: read-only uint32 row (the index's own row when indexed, else a private
    copy) or None. ``indexed``: content was stored while blend lookup was enabled, so the
    directory keeps a claim for every key's namespace (when the content is indexable).
    """

    __slots__ = ("tokens", "offset", "members", "indexed")

    def __init__(self, members: tuple[_Member, ...], offset: int = -1, indexed: bool = False,
                 tokens: Optional[np.ndarray] = None) -> None:
        self.tokens = tokens
        self.offset = offset
        self.members = members
        self.indexed = indexed


class _Pending:
    """Index adds deferred to the end of a batch (or to the next removal): one tuple
    ``(binding, tokens sent, chunk_hash, offset, namespace, batch row or -1)`` per add."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[_Binding, np.ndarray, bytes, int, BlendNamespace, int]] = []

    def __len__(self) -> int:
        return len(self.ops)

    def add(self, b: _Binding, chunk_hash: bytes, ns: BlendNamespace, row: int) -> None:
        self.ops.append((b, b.tokens, chunk_hash, b.offset, ns, row))  # type: ignore[arg-type]


class KeyDirectory:
    """Placements, token bindings and (optionally) the blend index, driven by cache events.

    See the module docstring for the rules. Typical use::

        d = KeyDirectory()
        d.enable_blend_lookup(chunk_size=256, probe_stride=1, engine="auto")
        d.apply({"batches": [...]})             # -> ApplyCounts(applied, duplicates, stale)
        d.blend_match(tokens, BlendNamespace("llama", "", 1))
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._gate = IngestGate()
        self._bindings: dict[bytes, _Binding] = {}
        self._l1_chunks: dict[str, set[bytes]] = {}  # instance -> chunk hashes with its private L1 copy
        self._l1_keys: dict[str, int] = {}  # instance -> keys with a private L1 placement there
        self._capacity: dict[tuple[str, str, str], tuple[int | None, int | None]] = {}
        self._interned: dict[Any, Any] = {}
        self._singles: dict[tuple[int, int], tuple[_Member, ...]] = {}
        self._index: Optional[BlendIndex] = None
        self._num_keys = 0
        self._num_placements = 0
        self._num_with_tokens = 0
        self._entries_stored = 0
        self._entries_deleted = 0
        self._entries_unfilled = 0
        self._entries_accessed = 0

    # ------------------------------------------------------------------ blend lookup
    def enable_blend_lookup(self, chunk_size: int = 256, probe_stride: int = 1,
                            engine: Union[str, Engine] = "auto", *, filter: str = "tagged") -> BlendIndex:
        """Build the blend index; from now on stores carrying tokens feed it.

        Stores applied before this call are not back-filled (a chunk joins the index when a
        STORE with its content arrives). Raises ``RuntimeError`` when already enabled and
        ``ValueError`` for bad parameters (from :class:`BlendIndex`).
        """
        with self._lock:
            if self._index is not None:
                raise RuntimeError("blend lookup is already enabled")
            self._index = BlendIndex(chunk_size=chunk_size, probe_stride=probe_stride, engine=engine,
                                     filter=filter)  # type: ignore[arg-type]
            return self._index

    @property
    def blend_index(self) -> Optional[BlendIndex]:
        """The blend index, or None while blend lookup is disabled."""
        return self._index

    def blend_match(self, tokens: Any, namespace: BlendNamespace) -> list[BlendMatch]:
        """Blend matches of one query (see :meth:`BlendIndex.match`). Raises
        :class:`BlendLookupDisabled` before :meth:`enable_blend_lookup`."""
        return self._require_index().match(tokens, namespace)

    def blend_match_batch(self, queries: Sequence[tuple[Any, BlendNamespace]]) -> list[list[BlendMatch]]:
        """Blend matches of many queries in one engine probe (see :meth:`BlendIndex.match_batch`)."""
        return self._require_index().match_batch(queries)

    def _require_index(self) -> BlendIndex:
        index = self._index
        if index is None:
            raise BlendLookupDisabled("blend lookup is not enabled (enable_blend_lookup / --enable-blend-lookup)")
        return index

    # ------------------------------------------------------------------ ingest
    def apply(self, request: Union[EventRequest, Mapping[str, Any]]) -> ApplyCounts:
        """Apply a ``POST /events`` request (decoded JSON or an :class:`EventRequest`).

        The request is validated as a whole first: an :class:`EventValidationError` (a
        ``ValueError`` naming the field) means nothing of it was applied. Then each batch
        passes the gate in order, under the lock, so the request applies atomically with
        respect to other requests.
        """
        parsed = parse_event_request(request)
        applied = duplicates = stale = 0
        with self._lock:
            for batch in parsed.batches:
                verdict = self._gate.admit(batch.instance_id, batch.incarnation, batch.seq)
                if verdict is Admission.DUPLICATE:
                    duplicates += 1
                    continue
                if verdict is Admission.STALE:
                    stale += 1
                    continue
                if verdict is Admission.FENCE_AND_APPLY:
                    result = self._fence_locked(batch.instance_id)
                    log.info("instance %s restarted (incarnation %d): fenced %d L1 placements",
                             log_safe(batch.instance_id), batch.incarnation, result.placements)
                self._apply_batch_locked(batch)
                applied += 1
        return ApplyCounts(applied, duplicates, stale)

    def apply_batch(self, batch: Union[EventBatch, Mapping[str, Any]]) -> ApplyCounts:
        """Apply one batch (the unit a log transport such as Kafka carries)."""
        return self.apply(EventRequest((parse_event_batch(batch),)))

    def fence_instance(self, instance_id: str) -> FenceResult:
        """Drop every private L1 placement of ``instance_id`` (its memory is gone after a
        restart); its L2 placements and shared-pool placements stay. Keys left without
        placements die, and with them their namespaces' claims. Idempotent."""
        with self._lock:
            return self._fence_locked(instance_id)

    def forget_instance(self, instance_id: str) -> FenceResult:
        """Fence ``instance_id`` (as :meth:`fence_instance`) and forget its gate cursor, in one
        step under the lock: the instance is gone as far as ordering goes, and its next batch
        starts a fresh cursor at whatever ``(incarnation, seq)`` it carries.

        Why: the cursor only ever moves up, so one forged batch with a huge incarnation
        (``2**63 - 1``) would make every honest batch of that instance stale until the
        service restarts. Deleting the instance (``DELETE /instances/{id}``) calls this, which
        is the documented undo. Idempotent; an unknown instance is a no-op."""
        with self._lock:
            result = self._fence_locked(instance_id)
            self._gate.forget(instance_id)
            return result

    # ------------------------------------------------------------------ reads
    def lookup(self, keys: Iterable[ObjectKey]) -> list[tuple[Placement, ...]]:
        """Placements of each key, in request order; each sorted by (instance_id, tier,
        backend); an empty tuple for an unknown key."""
        out: list[tuple[Placement, ...]] = []
        with self._lock:
            bindings = self._bindings
            for key in keys:
                b = bindings.get(key.chunk_hash)
                pls: tuple[Placement, ...] = ()
                if b is not None:
                    for scope, placements in b.members:
                        if (scope.model_name == key.model_name and scope.kv_rank == key.kv_rank
                                and scope.object_group_id == key.object_group_id and scope.cache_salt == key.cache_salt):
                            pls = placements
                            break
                out.append(pls)
        return out

    def get_token_ids(self, chunk_hashes: Iterable[bytes]) -> list[Optional[np.ndarray]]:
        """The content bound to each chunk hash (uint32 copies the caller owns), or None
        when the chunk hash is unknown or no STORE carried its tokens yet."""
        out: list[Optional[np.ndarray]] = []
        with self._lock:
            for h in chunk_hashes:
                b = self._bindings.get(h)
                out.append(None if b is None or b.tokens is None else b.tokens.copy())
        return out

    def get_token_offset(self, chunk_hash: bytes) -> Optional[int]:
        """The binding's token offset (-1 unknown), or None for an unknown chunk hash."""
        with self._lock:
            b = self._bindings.get(chunk_hash)
            return None if b is None else b.offset

    def list_keys(self, tier: Optional[str] = None, instance_id: Optional[str] = None,
                  backend: Optional[str] = None, offset: int = 0, limit: Optional[int] = 100
                  ) -> list[KeyPlacements]:
        """Keys with at least one placement matching every given filter, with those
        placements only, in a stable order (first stored first), paginated by
        ``offset``/``limit`` (``limit=None``: all). Shared-pool placements have
        ``instance_id ""``. O(offset + limit) keys scanned at best, all of them at worst."""
        if tier is not None and tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be an integer >= 0, got {offset!r}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be an integer >= 0 or None, got {limit!r}")
        out: list[KeyPlacements] = []
        if limit == 0:
            return out
        skip = offset
        with self._lock:
            for h, b in self._bindings.items():
                for scope, placements in b.members:
                    chosen = tuple(p for p in placements
                                   if (tier is None or p.tier == tier) and (instance_id is None or p.instance_id == instance_id)
                                   and (backend is None or p.backend == backend))
                    if not chosen:
                        continue
                    if skip:
                        skip -= 1
                        continue
                    out.append(KeyPlacements(scope.object_key(h), chosen))
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    def stats(self) -> dict[str, Any]:
        """Counts for ``GET /directory/stats`` and metrics (cheap: no scan of the keys)."""
        with self._lock:
            index = self._index
            return {
                "keys": self._num_keys,
                "chunk_hashes": len(self._bindings),
                "placements": self._num_placements,
                "token_bindings": self._num_with_tokens,
                "l1_keys_per_instance": dict(self._l1_keys),
                "instances": {inst: {"incarnation": c.incarnation, "last_seq": c.last_seq}
                              for inst, c in self._gate.cursors().items()},
                "events": {**self._gate.counters(),
                           "entries_stored": self._entries_stored,
                           "entries_deleted": self._entries_deleted,
                           "entries_accessed": self._entries_accessed,
                           "entries_unfilled": self._entries_unfilled},
                "capacity": [{"instance_id": i, "tier": t, "backend": be, "capacity_bytes": cb,
                              "capacity_revision": cr} for (i, t, be), (cb, cr) in self._capacity.items()],
                "blend_lookup_enabled": index is not None,
                "blend_index": index.stats() if index is not None else None,
            }

    # ------------------------------------------------------------------ batches
    def _apply_batch_locked(self, batch: EventBatch) -> None:
        kind = batch.event_type
        if kind == "store":
            self._store_locked(batch)
        elif kind == "delete":
            self._delete_locked(batch)
        elif kind == "access":
            self._entries_accessed += len(batch.entries)
        else:
            self._config_locked(batch)

    def _config_locked(self, batch: EventBatch) -> None:
        """Record a backend's capacity; a lower ``capacity_revision`` than the one held is
        ignored (revisions order reports that may arrive out of order across restarts)."""
        inst = SHARED_POOL_INSTANCE if batch.shared else batch.instance_id
        slot = (inst, batch.tier, batch.backend)
        old = self._capacity.get(slot)
        rev = batch.capacity_revision
        if old is not None and old[1] is not None and rev is not None and rev < old[1]:
            return
        cap = batch.capacity_bytes if batch.capacity_bytes is not None else (old[0] if old else None)
        self._capacity[slot] = (cap, rev if rev is not None else (old[1] if old else None))

    def _placement_of(self, batch: EventBatch, size: int) -> Placement:
        if batch.shared:
            p = Placement(SHARED_POOL_INSTANCE, 0, batch.tier, batch.backend, size, True)
        else:
            p = Placement(batch.instance_id, batch.incarnation, batch.tier, batch.backend, size, False)
        return self._intern(p)

    def _intern(self, value: Any) -> Any:
        table = self._interned
        got = table.get(value)
        if got is None:
            if len(table) >= _INTERN_MAX:
                table.clear()
            got = table[value] = value
        return got

    def _single(self, scope: KeyScope, p: Placement) -> tuple[_Member, ...]:
        """The interned members tuple of a binding with one key and one placement (the
        common case, so it is looked up by object identity: no tuple hashing)."""
        ident = (id(scope), id(p))
        got = self._singles.get(ident)
        if got is None:
            if len(self._singles) >= _INTERN_MAX:
                self._singles.clear()
            got = self._singles[ident] = ((scope, (p,)),)  # holds scope and p: ids stay valid
        return got

    # ------------------------------------------------------------------ store
    def _store_locked(self, batch: EventBatch) -> None:
        """Apply a STORE batch; see the module docstring for the lifecycle.

        All-new batches go to :meth:`_store_all_new`. Otherwise entries apply in order;
        when the batch's chunk hashes are distinct, a chunk hash not seen before is still
        bound inline and its content attached after the loop in bulk (no other entry of the
        batch can observe that binding in between). Every other case goes through
        :meth:`_upsert` and :meth:`_store_content`.
        """
        entries = batch.entries
        n = len(entries)
        if not n:
            return
        if entries.distinct_hashes and self._bindings.keys().isdisjoint(entries.chunk_hashes):
            self._store_all_new(batch)
            return
        column = entries.tokens
        lengths = column.lengths
        bindings = self._bindings
        l1_inst = batch.instance_id if batch.tier == L1 and not batch.shared else None
        l1_set = self._l1_chunks.setdefault(l1_inst, set()) if l1_inst is not None else None
        placements: dict[int, Placement] = {}
        singles_get = self._singles.get
        pending = _Pending()
        fresh: list[tuple[_Binding, np.ndarray]] = []  # bindings holding a view of this batch's tokens
        deferred_b: list[_Binding] = []  # new bindings whose content (row i) is attached after the loop
        deferred_i: list[int] = []
        bulk = entries.distinct_hashes
        enabled = self._index is not None
        new_bindings = new_l1_keys = 0
        for i, (h, scope, size, offset) in enumerate(zip(entries.chunk_hashes, entries.scopes, entries.sizes,
                                                         entries.offsets)):
            p = placements.get(size)
            if p is None:
                p = placements[size] = self._placement_of(batch, size)
            b = bindings.get(h)
            if b is None and bulk:  # a new chunk hash with one key; content comes after the loop
                has_tokens = lengths[i] > 0
                b = bindings[h] = _Binding(singles_get((id(scope), id(p))) or self._single(scope, p),
                                           offset if has_tokens else -1, enabled and has_tokens)
                new_bindings += 1
                if l1_set is not None:
                    l1_set.add(h)
                if has_tokens:
                    deferred_b.append(b)
                    deferred_i.append(i)
                continue
            if b is None:
                b = bindings[h] = _Binding(())
            _, new_ns, gained_l1 = self._upsert(b, scope, p)
            if gained_l1:
                l1_set.add(h)  # type: ignore[union-attr]
                new_l1_keys += 1
            if lengths[i]:
                self._store_content(b, h, scope, column, i, offset, new_ns, pending, fresh)
            elif new_ns and b.indexed and b.tokens is not None:
                self._claim(b, h, (scope.namespace,), pending, -1)
        self._num_keys += new_bindings
        self._num_placements += new_bindings
        if l1_inst is not None and (new_bindings or new_l1_keys):
            self._l1_keys[l1_inst] = self._l1_keys.get(l1_inst, 0) + new_bindings + new_l1_keys
        if pending:
            self._flush(pending, column)
        for b, view in fresh:
            if b.tokens is view:  # not indexed: keep a private copy, not a view of the batch
                b.tokens = _own_copy(view)
        if deferred_b:
            for b, content in zip(deferred_b, self._new_contents(deferred_i, entries)):
                b.tokens = content
        self._entries_stored += n
        self._warn_unfilled(batch)

    def _store_all_new(self, batch: EventBatch) -> None:
        """A STORE batch of distinct chunk hashes none of which is bound yet (the steady
        state of ingest): each gets a one-key binding, built column-wise, with no
        per-entry lookups; content is claimed in bulk first, so each binding is built once,
        content included."""
        entries = batch.entries
        n = len(entries)
        hashes, scopes, sizes, offsets = entries.chunk_hashes, entries.scopes, entries.sizes, entries.offsets
        lengths = entries.tokens.lengths
        enabled = self._index is not None
        if sizes.count(sizes[0]) == n and scopes.count(scopes[0]) == n:  # one members tuple for all
            members: Iterable[tuple[_Member, ...]] = repeat(
                self._single(scopes[0], self._placement_of(batch, sizes[0])), n)
        else:
            placement = {size: self._placement_of(batch, size) for size in set(sizes)}
            members = [self._single(sc, placement[sz]) for sc, sz in zip(scopes, sizes)]
        if lengths.count(0) == 0:  # every entry carries content
            bs = list(map(_Binding, members, offsets, repeat(enabled, n), self._new_contents(range(n), entries)))
        else:
            rows = [i for i, ln in enumerate(lengths) if ln]
            contents: list[Optional[np.ndarray]] = [None] * n
            for i, content in zip(rows, self._new_contents(rows, entries)):
                contents[i] = content
            bs = list(map(_Binding, members, [o if ln else -1 for o, ln in zip(offsets, lengths)],
                          [enabled and ln > 0 for ln in lengths], contents))
        self._bindings.update(zip(hashes, bs))
        self._num_keys += n
        self._num_placements += n
        if batch.tier == L1 and not batch.shared:
            inst = batch.instance_id
            self._l1_chunks.setdefault(inst, set()).update(hashes)
            self._l1_keys[inst] = self._l1_keys.get(inst, 0) + n
        self._entries_stored += n
        self._warn_unfilled(batch)

    def _warn_unfilled(self, batch: EventBatch) -> None:
        unfilled = batch.entries.tokens.unfilled
        if unfilled:
            self._entries_unfilled += len(unfilled)
            log.warning("%d STORE entries from %s (seq %d) carry token ids outside 0..2^32-1; their "
                        "token bindings stay unfilled (first: chunk %s)", len(unfilled),
                        log_safe(batch.instance_id), batch.seq, batch.entries.chunk_hashes[unfilled[0]].hex())

    def _new_contents(self, rows: Sequence[int], entries: EntryColumns) -> list[np.ndarray]:
        """First content of new single-key bindings, batch rows ``rows`` (offsets known from
        the batch): claimed in one ``add_many`` where indexable. Returns what each binding
        keeps: the index's row, else a private copy (never a view of the batch buffer).
        Counts the new token bindings."""
        column = entries.tokens
        self._num_with_tokens += len(rows)
        stored: list[Optional[np.ndarray]] = [None] * len(rows)
        index = self._index
        if index is not None:
            size, lengths, offsets = index.chunk_size, column.lengths, entries.offsets
            if len(rows) == len(entries) and min(offsets) >= 0 and column.rows_of_length(size):
                # the whole batch (rows are then 0..n-1 in order): its token block as is
                results = index.add_many(column.rows(range(len(rows))), entries.chunk_hashes, offsets,
                                         _namespace_arg(entries.scopes))
                if set(map(type, results)) == _ROWS_ONLY:  # all indexed: no collision
                    return results  # type: ignore[return-value]
                pick: Sequence[int] = range(len(rows))
            else:
                pick = [k for k, i in enumerate(rows) if lengths[i] == size and offsets[i] >= 0]
                sel = [rows[k] for k in pick]
                results = index.add_many(column.rows(sel), [entries.chunk_hashes[i] for i in sel],
                                         [offsets[i] for i in sel],
                                         _namespace_arg([entries.scopes[i] for i in sel])) if sel else []
            for k, row in zip(pick, results):
                stored[k] = row
        return [row if row is not None else _own_copy(column.row(i))  # type: ignore[arg-type]
                for i, row in zip(rows, stored)]

    def _upsert(self, b: _Binding, scope: KeyScope, p: Placement) -> tuple[bool, bool, bool]:
        """Add or replace ``p`` among ``scope``'s placements in ``b``.

        Returns ``(key is new, its namespace is new to the binding, the key gained a private
        L1 placement on p's instance)``.
        """
        members = b.members
        ident = placement_ident(p)
        for j, (sc, pls) in enumerate(members):
            if sc == scope:
                had_l1 = False
                new_pls = None
                for k, q in enumerate(pls):
                    if placement_ident(q) == ident:
                        if q == p:
                            return False, False, False
                        new_pls = pls[:k] + (p,) + pls[k + 1:]
                        break
                check_l1 = p.tier == L1 and not p.shared
                if check_l1:
                    had_l1 = any(is_private_l1(q, p.instance_id) for q in pls)
                if new_pls is None:
                    new_pls = tuple(sorted(pls + (p,), key=placement_ident))
                    self._num_placements += 1
                b.members = self._intern(members[:j] + ((sc, self._intern(new_pls)),) + members[j + 1:])
                return False, False, check_l1 and not had_l1
        ns = scope.namespace
        new_ns = all(sc.namespace != ns for sc, _ in members)
        b.members = self._intern(members + ((scope, (p,)),))
        self._num_keys += 1
        self._num_placements += 1
        return True, new_ns, p.tier == L1 and not p.shared

    def _store_content(self, b: _Binding, h: bytes, scope: KeyScope, column: TokenColumn, i: int,
                       offset: int, new_ns: bool, pending: _Pending,
                       fresh: list[tuple[_Binding, np.ndarray]]) -> None:
        """A STORE entry carrying usable tokens (row ``i`` of the batch)."""
        view = column.row(i)
        enabled = self._index is not None
        old = b.tokens
        if old is None:  # first content
            self._num_with_tokens += 1
            self._set_content(b, view, offset, enabled, fresh)
            if enabled:
                self._claim(b, h, self._namespaces(b), pending, i)
            return
        if old.tobytes() == view.tobytes():  # identical content
            if enabled and not b.indexed:  # first STORE of it since enabling: claim for all
                b.indexed = True
                if offset >= 0:
                    b.offset = offset
                self._claim(b, h, self._namespaces(b), pending, -1)
            elif offset >= 0 and offset != b.offset:
                b.offset = offset
                if b.indexed:
                    self._claim(b, h, self._namespaces(b), pending, -1)
            elif new_ns and b.indexed:
                self._claim(b, h, (scope.namespace,), pending, -1)
            return
        # different content: retire the old one for every namespace at once, then re-claim
        if b.indexed and self._indexable(b):
            if pending:
                self._flush(pending, column)
            self._index.remove_chunk(old, h)  # type: ignore[union-attr]
        self._set_content(b, view, offset, enabled, fresh)
        if enabled:
            self._claim(b, h, self._namespaces(b), pending, i)

    @staticmethod
    def _set_content(b: _Binding, view: np.ndarray, offset: int, enabled: bool,
                     fresh: list[tuple[_Binding, np.ndarray]]) -> None:
        b.tokens = view
        b.offset = offset
        b.indexed = enabled
        fresh.append((b, view))

    @staticmethod
    def _namespaces(b: _Binding) -> tuple[BlendNamespace, ...]:
        members = b.members
        if len(members) == 1:
            return (members[0][0].namespace,)
        return tuple(dict.fromkeys(sc.namespace for sc, _ in members))

    def _indexable(self, b: _Binding) -> bool:
        """Could ``b``'s content be in the index (right length, known offset)?"""
        index = self._index
        return index is not None and b.offset >= 0 and b.tokens is not None and b.tokens.shape[0] == index.chunk_size

    def _claim(self, b: _Binding, h: bytes, namespaces: Iterable[BlendNamespace], pending: _Pending,
               row: int) -> None:
        """Queue ``add`` for each namespace (skipped when the content cannot be indexed)."""
        if not self._indexable(b):
            return
        for ns in namespaces:
            pending.add(b, h, ns, row)

    def _flush(self, pending: _Pending, column: TokenColumn) -> None:
        """Run the queued adds as one ``add_many`` and keep the index's rows (no copies).

        Rows of this batch are gathered from its token buffer in one step; the input is a
        fresh array, so the index may reuse freed rows while it writes.
        """
        index = self._index
        assert index is not None  # only an enabled directory queues adds
        bs, sent, hashes, offsets, nss, rows = zip(*pending.ops)
        pending.ops.clear()
        tokens2d = column.rows(rows) if min(rows) >= 0 else np.stack(sent)
        first = nss[0]
        one_ns = all(ns is first for ns in nss)  # one namespace per batch is the norm
        results = index.add_many(tokens2d, hashes, offsets, first if one_ns else nss)
        for b, view, stored in zip(bs, sent, results):
            if stored is not None and b.tokens is view:
                b.tokens = stored

    # ------------------------------------------------------------------ delete / fence
    def _delete_locked(self, batch: EventBatch) -> None:
        """Apply a DELETE batch: drop the reporter's placement of each key (the pool's
        placement for a shared batch); unknown keys and placements are no-ops."""
        entries = batch.entries
        inst = SHARED_POOL_INSTANCE if batch.shared else batch.instance_id
        ident = (inst, batch.tier, batch.backend)
        bindings = self._bindings
        for h, scope in zip(entries.chunk_hashes, entries.scopes):
            b = bindings.get(h)
            if b is None:
                continue
            members = b.members
            for j, (sc, pls) in enumerate(members):
                if sc == scope:
                    kept = tuple(q for q in pls if placement_ident(q) != ident)
                    if len(kept) != len(pls):
                        self._replace_placements(h, b, j, pls, kept)
                    break
        self._entries_deleted += len(entries)

    def _fence_locked(self, instance_id: str) -> FenceResult:
        chunks = self._l1_chunks.pop(instance_id, None)
        keys_before, placements_before = self._num_keys, self._num_placements
        for h in chunks or ():
            b = self._bindings[h]  # the set is kept exact: every hash in it is bound
            j = 0
            while j < len(b.members):
                pls = b.members[j][1]
                kept = tuple(q for q in pls if not is_private_l1(q, instance_id))
                if len(kept) != len(pls):
                    self._replace_placements(h, b, j, pls, kept, l1_exact=False)
                    if not kept:
                        continue  # member j died; the next one moved to j
                j += 1
        self._l1_keys.pop(instance_id, None)
        return FenceResult(placements_before - self._num_placements, keys_before - self._num_keys)

    def _replace_placements(self, h: bytes, b: _Binding, j: int, old: tuple[Placement, ...],
                            kept: tuple[Placement, ...], l1_exact: bool = True) -> None:
        """Member ``j`` of ``b`` keeps only ``kept`` of its placements ``old``; a member left
        without placements dies (and its namespace's claim with its last key), a binding
        without members too. ``l1_exact=False``: the caller (fencing) resets the instance's
        L1 bookkeeping itself."""
        self._num_placements -= len(old) - len(kept)
        if l1_exact:
            self._drop_l1_bookkeeping(h, b, j, old, kept)
        members = b.members
        if kept:
            b.members = self._intern(members[:j] + ((members[j][0], self._intern(kept)),) + members[j + 1:])
            return
        scope = members[j][0]
        rest = members[:j] + members[j + 1:]
        b.members = self._intern(rest) if rest else ()
        self._num_keys -= 1
        ns = scope.namespace
        if b.indexed and self._indexable(b) and all(sc.namespace != ns for sc, _ in rest):
            self._index.remove_claim(b.tokens, h, ns)  # type: ignore[union-attr]
        if not rest:
            del self._bindings[h]
            if b.tokens is not None:
                self._num_with_tokens -= 1
            b.tokens = None

    def _drop_l1_bookkeeping(self, h: bytes, b: _Binding, j: int, old: tuple[Placement, ...],
                             kept: tuple[Placement, ...]) -> None:
        for inst in {q.instance_id for q in old if q.tier == L1 and not q.shared}:
            if any(is_private_l1(q, inst) for q in kept):
                continue
            left = self._l1_keys.get(inst, 0) - 1
            if left > 0:
                self._l1_keys[inst] = left
            else:
                self._l1_keys.pop(inst, None)
            others = any(is_private_l1(q, inst) for k, (_, pls) in enumerate(b.members) if k != j for q in pls)
            if not others:
                chunks = self._l1_chunks.get(inst)
                if chunks is not None:
                    chunks.discard(h)
                    if not chunks:
                        del self._l1_chunks[inst]


_ROWS_ONLY = {np.ndarray}


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
