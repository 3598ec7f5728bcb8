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

Speed (issue 3 asks >= 200k STORE entries/s with 256 tokens): ``wire.py`` converts tokens
in bulk (``tokens.pack_token_lists``: lists of ints, or packed arrays with no per-token
work). There is one store path (:meth:`KeyDirectory._store_locked`): entries whose chunk
hash is bound apply one by one (:meth:`_store_entries`), with index writes deferred and
flushed as one ``add_many`` (deferral keeps the exact per-entry order: pending adds are
flushed before any removal, and writes to different chunk hashes commute); entries of new,
distinct chunk hashes (the steady state) take its vector form (:meth:`_bind_new`): their
token block goes to one ``BlendIndex.add_many`` without a copy, and each binding is built
once, with the index's row. Measured figures: ``docs/performance.md`` and
``python -m blendmatch.bench.events``.

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
from operator import itemgetter
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from blendmatch.gpu import Engine

from .blend_index import BlendIndex
from .capacity import CapacityDeclarations, UsageLedger, instance_usage_report, usage_report
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
    "NOT_INDEXABLE_REASONS",
    "SHARED_POOL_INSTANCE",
    "ApplyCounts",
    "ApplyReport",
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


#: Why an applied STORE entry fed nothing to the blend index (each entry gets at most one,
#: in this order of precedence): ids outside uint32; content whose length is not the chunk
#: size; a key of world size 0 (no lookup can ask for it: world_size >= 1); content with
#: ``token_offset -1`` and no known offset for it (a wrong ``old_st`` is never offered).
NOT_INDEXABLE_REASONS = ("tokens_outside_uint32", "wrong_length", "world_size_0", "token_offset_unknown")


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


class _DeferredNew:
    """New contents of whole STORE batches (see ``KeyDirectory._defers``) whose index insert
    waits for the next flush, so that consecutive small batches cost one ``add_many``.
    ``bindings[k]`` is the waiting binding of token row ``k`` of the concatenated blocks
    (its ``tokens`` is None until the flush, which happens before the lock is released)."""

    __slots__ = ("blocks", "hashes", "offsets", "namespaces", "bindings")

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []
        self.hashes: list[bytes] = []
        self.offsets: list[int] = []
        self.namespaces: list[Union[BlendNamespace, list[BlendNamespace]]] = []
        self.bindings: list[_Binding] = []


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
        self._capacity = CapacityDeclarations()
        self._usage = UsageLedger()
        self._entries_applied = 0
        self._not_indexable = dict.fromkeys(NOT_INDEXABLE_REASONS, 0)
        self._warned: set[tuple[str, str]] = set()  # (instance, reason) already logged once
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
        self._deferred: Optional[_DeferredNew] = None  # set only while apply_many holds the lock

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
        """Blend matches of one query (see :meth:`BlendIndex.match`): the directory's one
        blend-lookup method. Many queries in one engine probe: ``blend_index.match_batch``.
        Raises :class:`BlendLookupDisabled` before :meth:`enable_blend_lookup`."""
        return self._require_index().match(tokens, namespace)

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
        return self.apply_detailed(request).counts

    def apply_detailed(self, request: Union[EventRequest, Mapping[str, Any]]) -> ApplyReport:
        """:meth:`apply`, also reporting per-entry counts (:class:`ApplyReport`)."""
        (report,) = self.apply_many([parse_event_request(request)])
        if isinstance(report, Exception):
            raise report
        return report

    def apply_many(self, requests: Sequence[EventRequest]) -> list[Union[ApplyReport, Exception]]:
        """Apply already-validated requests in order, in one hold of the lock: the result of
        each is its :class:`ApplyReport`, or the exception it raised (the others still
        apply; one that raised may be partly applied, as with :meth:`apply_detailed`).

        Why: a log transport carries one small batch per record (LMCache's Kafka sink: one
        batch of ~25 entries). Applied one by one, each paid the blend index's fixed cost
        of an insert (fingerprints, map probe, allocations: ~110 us); here consecutive
        batches of new content are inserted in one ``add_many`` (:class:`_DeferredNew`),
        with the same resulting state as applying them one after the other.
        """
        out: list[Union[ApplyReport, Exception]] = []
        with self._lock:
            self._deferred = _DeferredNew()
            try:
                for parsed in requests:
                    try:
                        out.append(self._apply_request_locked(parsed))
                    except Exception as exc:  # noqa: BLE001 - reported to the caller per request
                        self._flush_deferred()
                        out.append(exc)
            finally:
                try:
                    self._flush_deferred()
                finally:
                    self._deferred = None  # outside an apply, stores insert at once
        return out

    def _apply_request_locked(self, parsed: EventRequest) -> ApplyReport:
        applied = duplicates = stale = entries = 0
        skipped = dict.fromkeys(NOT_INDEXABLE_REASONS, 0)
        for batch in parsed.batches:
            verdict = self._gate.admit(batch.instance_id, batch.incarnation, batch.seq)
            if verdict is Admission.DUPLICATE:
                duplicates += 1
                continue
            if verdict is Admission.STALE:
                stale += 1
                continue
            if verdict is not Admission.APPLY or not self._defers(batch):
                self._flush_deferred()  # every other write sees the index as if applied in order
            if verdict is Admission.FENCE_AND_APPLY:
                result = self._fence_locked(batch.instance_id)
                log.info("instance %s restarted (incarnation %d): fenced %d L1 placements",
                         log_safe(batch.instance_id), batch.incarnation, result.placements)
            if batch.event_type == "store":
                self._classify_store_locked(batch, skipped)
            self._apply_batch_locked(batch)
            applied += 1
            entries += len(batch.entries)
        self._entries_applied += entries
        return ApplyReport(ApplyCounts(applied, duplicates, stale), entries,
                           {k: v for k, v in skipped.items() if v})

    def _defers(self, batch: EventBatch) -> bool:
        """Whether ``batch`` takes the all-vector store path whose index insert may wait for
        the next flush: a STORE of distinct chunk hashes, none bound yet, every entry with
        a chunk of content at a known offset. Nothing else reads what it writes before the
        flush (its hashes are new; the checks of later batches read bindings, never the
        index, and any batch not of this kind flushes first)."""
        index = self._index
        entries = batch.entries
        if index is None or batch.event_type != "store" or not len(entries) or not entries.distinct_hashes:
            return False
        return _whole_block_indexable(entries, index.chunk_size) and self._bindings.keys().isdisjoint(
            entries.chunk_hashes)

    def _flush_deferred(self) -> None:
        """Insert the deferred new contents (:class:`_DeferredNew`) as one ``add_many`` and
        give each waiting binding what it keeps: the index's row, else a private copy."""
        d = self._deferred
        if d is None or not d.bindings:
            return
        self._deferred = _DeferredNew()
        index = self._index
        assert index is not None
        tokens = d.blocks[0] if len(d.blocks) == 1 else np.concatenate(d.blocks)
        first = d.namespaces[0]
        if all(ns is first for ns in d.namespaces) and isinstance(first, BlendNamespace):
            nss: Union[BlendNamespace, list[BlendNamespace]] = first
        else:
            nss = []
            for ns, block in zip(d.namespaces, d.blocks):
                nss.extend(repeat(ns, block.shape[0]) if isinstance(ns, BlendNamespace) else ns)
        results = index.add_many(tokens, d.hashes, d.offsets, nss)
        for k, (b, row) in enumerate(zip(d.bindings, results)):
            b.tokens = row if row is not None else _own_copy(tokens[k])

    def apply_batch(self, batch: Union[EventBatch, Mapping[str, Any]]) -> ApplyCounts:
        """Apply one batch (the unit a log transport such as Kafka carries)."""
        return self.apply(EventRequest((parse_event_batch(batch),)))

    def drop_instance(self, instance_id: str, *, forget_capacity: bool = True) -> FenceResult:
        """The instance left: fence its private L1 placements and forget its event cursor (a
        later reconnect starts fresh at any incarnation); with ``forget_capacity`` (a
        deregistration) also its declared capacity. Its L2 and shared placements stay
        (their storage outlives the process). Idempotent. Also the documented undo for a
        forged incarnation: the cursor only ever moves up, so one forged batch with a huge
        incarnation would make every honest batch stale until a restart. LMCache's
        ``EventGate.drop_instance`` (the reaper: capacity kept) plus
        ``ServerConfigRegistry.forget`` (``DELETE /instances/{id}``)."""
        with self._lock:
            result = self._fence_locked(instance_id)
            self._gate.forget(instance_id)
            if forget_capacity:
                self._capacity.forget(instance_id)
            return result

    def fence_instance(self, instance_id: str) -> FenceResult:
        """Drop every private L1 placement of ``instance_id`` (its memory is gone after a
        restart); its L2 placements and shared-pool placements stay. Keys left without
        placements die, and with them their namespaces' claims. Idempotent."""
        with self._lock:
            return self._fence_locked(instance_id)

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

    def keys_across_object_groups(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """Each key followed by the stored keys that differ from it only in object group,
        in ascending group order (LMCache's ``get_keys_across_object_groups``: a token-form
        lookup resolves group 0 and reaches the other groups through what is stored)."""
        out: list[ObjectKey] = []
        with self._lock:
            for key in keys:
                b = self._bindings.get(key.chunk_hash)
                if b is None:
                    out.append(key)
                    continue
                group = [key] + [scope.object_key(key.chunk_hash) for scope, _ in b.members
                                 if scope.object_group_id != key.object_group_id and scope.model_name == key.model_name
                                 and scope.kv_rank == key.kv_rank and scope.cache_salt == key.cache_salt]
                group.sort(key=lambda k: k.object_group_id)
                out.extend(group)
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
            usage = self._usage
            blend = index.stats() if index is not None else None
            return {
                # LMCache 0.5.6's DirectoryStats names first (same meaning), then ours
                "num_keys": self._num_keys,
                "num_placements": self._num_placements,
                "l1_keys_by_instance": dict(self._l1_keys),
                "l1_count": usage.tier_count.get("l1", 0),
                "l1_size_bytes": usage.tier_bytes.get("l1", 0),
                "l2_count": usage.tier_count.get("l2", 0),
                "l2_size_bytes": usage.tier_bytes.get("l2", 0),
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
                           "entries_unfilled": self._entries_unfilled,
                           "entries_applied": self._entries_applied,
                           "entries_not_indexable": dict(self._not_indexable)},
                "capacity": self._capacity.rows(),
                "blend_lookup_enabled": index is not None,
                "blend_index": blend,
            }

    def usage(self, registered: Iterable[str] = ()) -> dict[str, Any]:
        """LMCache's ``GET /instances/usage`` body: every instance that is registered
        (``registered``), holds bytes or declared capacity, with its private compartments
        (used bytes joined to declared capacity, ``usage_ratio`` None when undeclared), and
        the shared pools counted once (capacity only where every declaring instance agrees)."""
        with self._lock:
            owners = self._usage.owners()
            declared = {inst: self._capacity.get(inst) for inst in self._capacity.instances()}
        return usage_report(owners, declared, registered)

    def instance_usage(self, instance_id: str, registered: bool) -> Optional[dict[str, Any]]:
        """One instance's entry of :meth:`usage`, or None when it is unknown (not
        registered, holding no bytes, having declared nothing)."""
        with self._lock:
            used = self._usage.owners().get(instance_id, {}) if instance_id != SHARED_POOL_INSTANCE else {}
            declared = self._capacity.get(instance_id)
        if not registered and not used and not declared:
            return None
        return instance_usage_report(instance_id, used, declared, registered)

    def rebuild_usage(self) -> None:
        """Recompute the usage ledger (bytes per owner/tier/backend, count and bytes per tier)
        from the placements held. The ledger is kept incrementally by apply, delete and
        fencing; call this after restoring placements by any other path (a checkpoint).
        O(placements)."""
        with self._lock:
            ledger = UsageLedger()
            for b in self._bindings.values():
                for _, pls in b.members:
                    for p in pls:
                        ledger.add(p.instance_id, p.tier, p.backend, 1, p.size_bytes)
            self._usage = ledger

    def capacity_snapshot(self) -> dict[str, Any]:
        """Declared capacities as plain JSON-able data (for checkpoints)."""
        with self._lock:
            return self._capacity.snapshot()

    def restore_capacity(self, state: Mapping[str, Any]) -> None:
        """Load a :meth:`capacity_snapshot` value (replaces what is held)."""
        with self._lock:
            self._capacity.restore(state)

    # ------------------------------------------------------------------ checkpoints
    def pause_ingest(self) -> threading.RLock:
        """The lock that, held, stops every write (``with d.pause_ingest(): ...``). Lookups
        do not take it; a checkpoint holds it only while it captures the state."""
        return self._lock

    def snapshot(self) -> dict[str, Any]:
        """Everything that decides an answer, as plain data (bulk encoding:
        ``checkpoint.py``). Call with :meth:`pause_ingest` held, or in a forked copy of the
        process; the values are the live objects (shared, not copied): encode them before
        the next write. Bindings come in dict order, which ``list_keys`` pages by."""
        bindings = list(self._bindings.values())
        return {
            "hashes": list(self._bindings),
            "members": [b.members for b in bindings],
            "offsets": [b.offset for b in bindings],
            "indexed": [b.indexed for b in bindings],
            "tokens": [b.tokens for b in bindings],
            "l1_chunks": {inst: list(hs) for inst, hs in self._l1_chunks.items()},
            "l1_keys": dict(self._l1_keys),
            "capacity": self._capacity.snapshot(),  # declared capacities (plain JSON data)
            "counters": {"num_keys": self._num_keys, "num_placements": self._num_placements,
                         "num_with_tokens": self._num_with_tokens, "entries_stored": self._entries_stored,
                         "entries_deleted": self._entries_deleted, "entries_unfilled": self._entries_unfilled,
                         "entries_accessed": self._entries_accessed, "entries_applied": self._entries_applied,
                         "entries_not_indexable": dict(self._not_indexable)},
            "gate": self._gate.snapshot(),
            "index": self._index,
        }

    def clear(self) -> None:
        """Forget everything (a cold start after a failed restore): an empty directory with
        a fresh, empty index on the same engine (no second engine selection)."""
        with self._lock:
            index, lock = self._index, self._lock
            self.__init__()  # type: ignore[misc]
            self._lock = lock
            if index is not None:
                self._index = BlendIndex(chunk_size=index.chunk_size, probe_stride=index.probe_stride,
                                         engine=index.engine, filter=index.filter)  # type: ignore[arg-type]

    def restore(self, state: dict[str, Any]) -> None:
        """Replace this (empty) directory's state by a :meth:`snapshot` as decoded by
        ``checkpoint.py``: ``tokens`` are then the restored index's own rows for indexed
        content (the caller restored the index first) and private read-only arrays for the
        rest. Raises ``ValueError`` when the directory is not empty."""
        with self._lock:
            if self._bindings or self._gate.cursors():
                raise ValueError("restore needs an empty directory")
            hashes = state["hashes"]
            self._bindings = dict(zip(hashes, map(_Binding, state["members"], state["offsets"], state["indexed"],
                                                  state["tokens"])))
            if len(self._bindings) != len(hashes):
                raise ValueError("a chunk hash appears twice in the snapshot")
            self._l1_chunks = {inst: set(hs) for inst, hs in state["l1_chunks"].items()}
            self._l1_keys = {inst: int(n) for inst, n in state["l1_keys"].items()}
            self._capacity.restore(state["capacity"])
            c = state["counters"]
            self._num_keys, self._num_placements = int(c["num_keys"]), int(c["num_placements"])
            self._num_with_tokens = int(c["num_with_tokens"])
            self._entries_stored, self._entries_deleted = int(c["entries_stored"]), int(c["entries_deleted"])
            self._entries_unfilled, self._entries_accessed = int(c["entries_unfilled"]), int(c["entries_accessed"])
            self._entries_applied = int(c.get("entries_applied", 0))
            for reason, n in dict(c.get("entries_not_indexable", {})).items():
                if reason in self._not_indexable:
                    self._not_indexable[reason] = int(n)
            self._gate.restore(state["gate"])
            self.rebuild_usage()  # the used-bytes ledger is derived from the placements

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
        """Record one compartment of an instance's capacity declaration: a newer
        ``(incarnation, capacity_revision)`` stamp replaces the instance's declaration, an
        equal one extends it, an older one is dropped (``capacity.CapacityDeclarations``)."""
        if not self._capacity.consume(batch.instance_id, batch.incarnation, batch.capacity_revision, batch.tier,
                                      batch.backend, batch.capacity_bytes, batch.shared):
            log.info("capacity declaration from %s (incarnation %d, revision %d) is older than the one held; "
                     "dropped", log_safe(batch.instance_id), batch.incarnation, batch.capacity_revision)

    def _classify_store_locked(self, batch: EventBatch, skipped: dict[str, int]) -> None:
        """Before a STORE batch is applied: account its placement bytes (the usage ledger,
        from the placements it replaces) and count its entries that will feed nothing to the
        blend index, by reason (logged once per instance and reason). Reads the state the
        store is about to change, so it runs first; column-wise in the common case."""
        entries = batch.entries
        n = len(entries)
        if not n:
            return
        self._account_store_bytes(batch)
        index = self._index
        if index is None:
            return
        column = entries.tokens
        lengths = column.lengths
        reason_of: dict[int, str] = {}
        for i in column.unfilled:
            reason_of[i] = "tokens_outside_uint32"
        size = index.chunk_size
        if not column.rows_of_length(size):
            for i, ln in enumerate(lengths):
                if ln and ln != size and i not in reason_of:
                    reason_of[i] = "wrong_length"
        if any(sc.namespace.world_size == 0 for sc in set(entries.scopes)):
            for i, sc in enumerate(entries.scopes):
                if sc.namespace.world_size == 0 and i not in reason_of:
                    reason_of[i] = "world_size_0"
        if -1 in entries.offsets:
            bindings = self._bindings
            for i, (h, off) in enumerate(zip(entries.chunk_hashes, entries.offsets)):
                if off == -1 and lengths[i] and i not in reason_of:
                    b = bindings.get(h)
                    if b is None or b.offset < 0 or b.tokens is None or not np.array_equal(b.tokens, column.row(i)):
                        reason_of[i] = "token_offset_unknown"
        if not reason_of:
            return
        for i, reason in reason_of.items():
            skipped[reason] += 1
            self._not_indexable[reason] += 1
            if (batch.instance_id, reason) not in self._warned and len(self._warned) < 65536:
                self._warned.add((batch.instance_id, reason))
                log.warning("STORE entries from %s are not indexable for blend lookup (%s; first: chunk %s, "
                            "seq %d); counted in entries_not_indexable, logged once per instance and reason",
                            log_safe(batch.instance_id), reason, entries.chunk_hashes[i].hex(), batch.seq)

    def _account_store_bytes(self, batch: EventBatch) -> None:
        """Usage-ledger delta of a STORE batch: each entry adds a placement with its size, or
        replaces the same copy (same instance, tier, backend) of the same key."""
        entries = batch.entries
        owner = SHARED_POOL_INSTANCE if batch.shared else batch.instance_id
        ident = (owner, batch.tier, batch.backend)
        bindings = self._bindings
        if entries.distinct_hashes and bindings.keys().isdisjoint(entries.chunk_hashes):
            self._usage.add(owner, batch.tier, batch.backend, len(entries), sum(entries.sizes))
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
                            for q in pls:
                                if placement_ident(q) == ident:
                                    old = q.size_bytes
                            break
            if old is None:
                count += 1
                delta += size
            else:
                delta += size - old
            seen[(h, scope)] = size
        self._usage.add(owner, batch.tier, batch.backend, count, delta)

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
        """Apply a STORE batch; see the module docstring for the lifecycle. The one store path.

        Entries whose chunk hash is already bound (or repeats within the batch) apply one by
        one, in order (:meth:`_store_entry`). When the batch's chunk hashes are distinct, the
        entries whose chunk hash is not bound yet are then bound in one vector step
        (:meth:`_bind_new`, the same rules as :meth:`_store_entry` for a one-key binding:
        nothing else can observe those bindings in between, and writes to different chunk
        hashes commute). The steady state of ingest, a batch of new chunks, is all vector.
        """
        entries = batch.entries
        n = len(entries)
        if not n:
            return
        hashes = entries.chunk_hashes
        bindings = self._bindings
        if not entries.distinct_hashes:
            one_by_one: Sequence[int] = range(n)
            new_rows: Sequence[int] = ()
        elif bindings.keys().isdisjoint(hashes):
            one_by_one, new_rows = (), range(n)
        else:
            bound = list(map(bindings.__contains__, hashes))
            one_by_one = [i for i, known in enumerate(bound) if known]
            new_rows = [i for i, known in enumerate(bound) if not known]
        if one_by_one:
            self._store_entries(batch, one_by_one)
        if new_rows:
            self._bind_new(batch, new_rows)
        self._entries_stored += n
        self._warn_unfilled(batch)

    def _store_entries(self, batch: EventBatch, rows: Sequence[int]) -> None:
        """Apply entries ``rows`` of a STORE batch one by one, in order; index writes are
        deferred and flushed as one ``add_many`` (pending adds are flushed before any
        removal, so the per-entry order of index writes is kept)."""
        entries = batch.entries
        column = entries.tokens
        lengths = column.lengths
        bindings = self._bindings
        l1_inst = batch.instance_id if batch.tier == L1 and not batch.shared else None
        l1_set = self._l1_chunks.setdefault(l1_inst, set()) if l1_inst is not None else None
        placements: dict[int, Placement] = {}
        pending = _Pending()
        fresh: list[tuple[_Binding, np.ndarray]] = []  # bindings holding a view of this batch's tokens
        new_l1_keys = 0
        hashes, scopes, sizes, offsets = entries.chunk_hashes, entries.scopes, entries.sizes, entries.offsets
        for i in rows:
            h, scope, size = hashes[i], scopes[i], sizes[i]
            p = placements.get(size)
            if p is None:
                p = placements[size] = self._placement_of(batch, size)
            b = bindings.get(h)
            if b is None:
                b = bindings[h] = _Binding(())
            _, new_ns, gained_l1 = self._upsert(b, scope, p)
            if gained_l1:
                l1_set.add(h)  # type: ignore[union-attr]
                new_l1_keys += 1
            if lengths[i]:
                self._store_content(b, h, scope, column, i, offsets[i], new_ns, pending, fresh)
            elif new_ns and b.indexed and b.tokens is not None:
                self._claim(b, h, (scope.namespace,), pending, -1)
        if l1_inst is not None and new_l1_keys:
            self._l1_keys[l1_inst] = self._l1_keys.get(l1_inst, 0) + new_l1_keys
        if pending:
            self._flush(pending, column)
        for b, view in fresh:
            if b.tokens is view:  # not indexed: keep a private copy, not a view of the batch
                b.tokens = _own_copy(view)

    def _bind_new(self, batch: EventBatch, rows: Sequence[int]) -> None:
        """Entries ``rows`` of a STORE batch, whose chunk hashes are distinct and not bound:
        each gets a one-key binding, built column-wise with no per-entry lookups. Content is
        claimed in bulk first (``_new_contents``), so each binding is built once, content
        included. The vector form of :meth:`_store_entries` for this case."""
        entries = batch.entries
        n = len(rows)
        if n == len(entries):  # the whole batch: its columns as they are
            hashes, scopes, sizes, offsets = entries.chunk_hashes, entries.scopes, entries.sizes, entries.offsets
            lengths = entries.tokens.lengths
        else:
            pick = itemgetter(*rows) if n > 1 else (lambda col: (col[rows[0]],))
            hashes, scopes, sizes, offsets = (list(pick(col)) for col in (
                entries.chunk_hashes, entries.scopes, entries.sizes, entries.offsets))
            lengths = list(pick(entries.tokens.lengths))
        enabled = self._index is not None
        if sizes.count(sizes[0]) == n and scopes.count(scopes[0]) == n:  # one members tuple for all
            members: Iterable[tuple[_Member, ...]] = repeat(
                self._single(scopes[0], self._placement_of(batch, sizes[0])), n)
        else:
            placement = {size: self._placement_of(batch, size) for size in set(sizes)}
            members = [self._single(sc, placement[sz]) for sc, sz in zip(scopes, sizes)]
        if lengths.count(0) == 0:  # every entry carries content
            got = self._new_contents(rows, entries)
            if got is None:  # deferred: the flush fills them in
                bs = list(map(_Binding, members, offsets, repeat(enabled, n)))
                self._deferred.bindings.extend(bs)  # type: ignore[union-attr]
            else:
                bs = list(map(_Binding, members, offsets, repeat(enabled, n), got))
        else:
            with_tokens = [k for k, ln in enumerate(lengths) if ln]
            contents: list[Optional[np.ndarray]] = [None] * n
            for k, content in zip(with_tokens, self._new_contents([rows[k] for k in with_tokens], entries) or ()):
                contents[k] = content
            bs = list(map(_Binding, members, [o if ln else -1 for o, ln in zip(offsets, lengths)],
                          [enabled and ln > 0 for ln in lengths], contents))
        self._bindings.update(zip(hashes, bs))
        self._num_keys += n
        self._num_placements += n
        if batch.tier == L1 and not batch.shared:
            inst = batch.instance_id
            self._l1_chunks.setdefault(inst, set()).update(hashes)
            self._l1_keys[inst] = self._l1_keys.get(inst, 0) + n

    def _warn_unfilled(self, batch: EventBatch) -> None:
        unfilled = batch.entries.tokens.unfilled
        if unfilled:
            self._entries_unfilled += len(unfilled)
            log.warning("%d STORE entries from %s (seq %d) carry token ids outside 0..2^32-1; their "
                        "token bindings stay unfilled (first: chunk %s)", len(unfilled),
                        log_safe(batch.instance_id), batch.seq, batch.entries.chunk_hashes[unfilled[0]].hex())

    def _new_contents(self, rows: Sequence[int], entries: EntryColumns) -> Optional[list[np.ndarray]]:
        """First content of new single-key bindings, batch rows ``rows`` (offsets known from
        the batch): claimed in one ``add_many`` where indexable. Returns what each binding
        keeps: the index's row, else a private copy (never a view of the batch buffer).
        Inside an apply, a whole batch of indexable rows is deferred instead (returns None:
        the caller hands its bindings to ``_deferred``). Counts the new token bindings."""
        column = entries.tokens
        self._num_with_tokens += len(rows)
        stored: list[Optional[np.ndarray]] = [None] * len(rows)
        index = self._index
        if index is not None:
            size, lengths, offsets = index.chunk_size, column.lengths, entries.offsets
            if len(rows) == len(entries) and _whole_block_indexable(entries, size):
                # the whole batch (rows are then 0..n-1 in order): its token block as is
                block = column.rows(range(len(rows)))
                if self._deferred is not None:  # inside an apply: inserted at the next flush
                    d = self._deferred
                    d.blocks.append(block)
                    d.hashes.extend(entries.chunk_hashes)
                    d.offsets.extend(offsets)
                    d.namespaces.append(_namespace_arg(entries.scopes))
                    return None
                results = index.add_many(block, entries.chunk_hashes, offsets, _namespace_arg(entries.scopes))
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
        self._usage.remove_placements(q for q in old if q not in kept)
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


def _whole_block_indexable(entries: EntryColumns, chunk_size: int) -> bool:
    """Every entry carries one chunk of content (``chunk_size`` usable ids) at a known
    offset: the batch's token block goes to ``add_many`` as it is (or waits for a flush)."""
    return min(entries.offsets) >= 0 and entries.tokens.rows_of_length(chunk_size)


def _own_copy(view: np.ndarray) -> np.ndarray:
    out = view.copy()
    out.setflags(write=False)
    return out
