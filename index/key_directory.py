"""KeyDirectory: where is each cached object, what tokens does each chunk hold, and the index.

Question answered: "given the fleet's cache-event stream, which keys are stored where, which
tokens does each chunk hash carry, and which chunks may a blend lookup offer to whom?"

A facade over parts with one job each, all guarded by one lock:

- ``bindings.py`` (:class:`BindingStore`): bindings, placements, per-instance L1
  bookkeeping; deletes and fencing;
- ``ingest.py`` (:class:`IngestPath`): the one ingest path: the gate, the STORE rules, the
  one deferral buffer of index adds, the entry counters; which content is claimed is the
  one rule of ``indexable.py``;
- ``capacity.py``: declared capacities (:class:`CapacityDeclarations`) and the used-bytes
  ledger (:class:`UsageLedger`);
- ``blend_index.py`` (:class:`BlendIndex`, optional): a derived view; nothing writes to it
  but the ingest path and the binding store, with this lock held.

Each part captures and restores its own checkpoint state (``export_state`` /
``restore_state``); :meth:`KeyDirectory.export_state` joins them into the one dict that
``checkpoint.py`` encodes (the file format is unchanged by the split).

Thread safety: one lock guards all state (:attr:`KeyDirectory.ingest_lock`); the index is
called with it held (lock order: directory -> index writer -> index; the index never calls back). Blend
lookups call the index without the directory lock, so lookups do not wait for ingest.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from blendmatch.gpu import Engine

from .bindings import BindingStore, FenceResult, KeyPage
from .blend_index import BlendIndex
from .capacity import CapacityDeclarations, UsageLedger, instance_usage_report, usage_report
from .holders import HolderWatch
from .indexable import NOT_INDEXABLE_REASONS
from .ingest import ApplyCounts, ApplyReport, IngestPath
from .placement_rank import RankedCopies, ranked_copies
from .placements import SHARED_POOL_INSTANCE, KeyPlacements, Placement
from .wire import EventRequest, parse_event_request
from .types import BlendMatch, BlendNamespace, ObjectKey

__all__ = [
    "NOT_INDEXABLE_REASONS",
    "SHARED_POOL_INSTANCE",
    "ApplyCounts",
    "ApplyReport",
    "BlendLookupDisabled",
    "FenceResult",
    "KeyDirectory",
    "KeyPage",
    "KeyPlacements",
    "Placement",
]

log = logging.getLogger(__name__)

#: Copies :meth:`KeyDirectory.namespace_ranked` keeps ranked at most (about 16 bytes each:
#: two pointers; the placements themselves are the bindings' own); past it the memo starts
#: over. 1M copies is 5,000 chunks each held by 200 instances, about 16 MiB.
_RANKED_MEMO_COPIES = 1 << 20


class BlendLookupDisabled(RuntimeError):
    """A blend lookup was asked for before :meth:`KeyDirectory.enable_blend_lookup`."""


class KeyDirectory:
    """Placements, token bindings and (optionally) the blend index, driven by cache events.

    See the module docstring for the parts and ``ingest.py`` for the rules. Typical use::

        d = KeyDirectory()
        d.enable_blend_lookup(chunk_size=256, probe_stride=1, engine="auto")
        d.apply({"batches": [...]})             # -> ApplyCounts(applied, duplicates, stale)
        d.blend_match(tokens, BlendNamespace("llama", "", 1))
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._watch: Optional[HolderWatch] = None
        # (id(members), namespace) -> (members, ranked copies): see namespace_ranked
        self._ranked: dict[tuple[int, BlendNamespace], tuple[Any, RankedCopies]] = {}
        self._ranked_copies = 0
        self._reset(None)

    def _reset(self, index: Optional[BlendIndex]) -> None:
        """Empty parts around ``index`` (the lock is held or not yet shared)."""
        self._index = index
        self._capacity = CapacityDeclarations()
        self._usage = UsageLedger()
        self._store = BindingStore(self._usage, index)
        self._ingest = IngestPath(self._store, self._capacity, self._usage, index)
        self._ingest.watch = self._watch

    def set_holder_watch(self, watch: Optional[HolderWatch]) -> None:
        """Report holder-set changes at every batch boundary to ``watch`` (``holders.py``:
        what a KV-events publisher republishes); None stops it. Set it before ingest starts
        (changes before it are not reported; a restore is not a change)."""
        with self._lock:
            self._watch = self._ingest.watch = watch

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
            self._index = self._store.index = self._ingest.index = BlendIndex(
                chunk_size=chunk_size, probe_stride=probe_stride, engine=engine, filter=filter)  # type: ignore[arg-type]
            return self._index

    @property
    def blend_index(self) -> Optional[BlendIndex]:
        """The blend index, or None while blend lookup is disabled."""
        return self._index

    def blend_match(self, tokens: Any, namespace: BlendNamespace) -> list[BlendMatch]:
        """Blend matches of one query (see :meth:`BlendIndex.match`): the directory's one
        blend-lookup method. Many queries in one engine probe: ``blend_index.match_batch``.
        Raises :class:`BlendLookupDisabled` before :meth:`enable_blend_lookup`."""
        index = self._index
        if index is None:
            raise BlendLookupDisabled("blend lookup is not enabled (enable_blend_lookup / --enable-blend-lookup)")
        return index.match(tokens, namespace)

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
        The run's index adds go to the index together (``ingest.py``: one deferral
        buffer), with the same resulting state as applying the requests one by one."""
        with self._lock:
            return self._ingest.apply_run(requests)

    def unknown_instances(self, instance_ids: Iterable[str]) -> tuple[int, list[str]]:
        """``(instances with an event cursor, those of instance_ids without one)``: what a
        bound on tracked instances needs, without copying every cursor."""
        with self._lock:
            gate = self._ingest.gate
            return gate.tracked, [i for i in dict.fromkeys(instance_ids) if gate.cursor(i) is None]

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
            result = self._ingest.fence(instance_id)
            self._ingest.gate.forget(instance_id)
            if forget_capacity:
                self._capacity.forget(instance_id)
            return result

    def fence_instance(self, instance_id: str) -> FenceResult:
        """Drop every private L1 placement of ``instance_id`` (its memory is gone after a
        restart); its L2 placements and shared-pool placements stay. Keys left without
        placements die, and with them their namespaces' claims. Idempotent."""
        with self._lock:
            return self._ingest.fence(instance_id)

    # ------------------------------------------------------------------ reads
    def lookup(self, keys: Iterable[ObjectKey]) -> list[tuple[Placement, ...]]:
        """Placements of each key, in request order; each sorted by (instance_id, tier,
        backend); an empty tuple for an unknown key."""
        with self._lock:
            return self._store.lookup(keys)

    def access_counts(self, keys: Iterable[ObjectKey]) -> list[int]:
        """Per key, in request order, the ``ACCESS`` entries applied to it since it was
        created (LMCache 0.5.6's ``access_count``: 0 for an unknown key, reset when the key
        dies and is stored again)."""
        with self._lock:
            return self._store.access_counts(keys)

    def keys_across_object_groups(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """Each key followed by the stored keys that differ from it only in object group,
        in ascending group order (LMCache's ``get_keys_across_object_groups``: a token-form
        lookup resolves group 0 and reaches the other groups through what is stored)."""
        out: list[ObjectKey] = []
        with self._lock:
            for key in keys:
                b = self._store.bindings.get(key.chunk_hash)
                if b is None:
                    out.append(key)
                    continue
                group = [key] + [scope.object_key(key.chunk_hash) for scope, _ in b.members
                                 if scope.object_group_id != key.object_group_id and scope.model_name == key.model_name
                                 and scope.kv_rank == key.kv_rank and scope.cache_salt == key.cache_salt]
                group.sort(key=lambda k: k.object_group_id)
                out.extend(group)
        return out

    def namespace_placements(self, chunk_hashes: Iterable[bytes], namespace: BlendNamespace
                             ) -> list[tuple[Placement, ...]]:
        """Per chunk hash, the placements of its keys stored for ``namespace`` (every rank
        and object group of that namespace, each copy as stored; empty for an unknown chunk
        hash or one this namespace holds no key of): where the chunk a blend match offered
        lives (issue 26; ranking and liveness: ``placement_rank.py``).

        Takes no lock, on purpose: the lookup thread calls it (placements, the routing score,
        the reuse metrics) and lookups never wait for ingest. Safe because a read here is one
        dict ``get`` and one attribute read per chunk hash, and a binding's ``members`` is an
        immutable tuple the store replaces whole (``bindings.py``): each chunk's answer is
        its placements at some instant of the call, never a torn value. Chunks are not read
        at one instant together (an event run may land between two of them), which is what
        an answer that advises a router needs."""
        bindings = self._store.bindings
        out: list[tuple[Placement, ...]] = []
        for h in chunk_hashes:
            b = bindings.get(h)
            if b is None:
                out.append(())
                continue
            out.append(tuple(p for scope, placements in b.members if scope.namespace == namespace
                             for p in placements))
        return out

    def namespace_ranked(self, chunk_hashes: Iterable[bytes], namespace: BlendNamespace
                         ) -> list[Optional[RankedCopies]]:
        """Per chunk hash, :func:`placement_rank.ranked_copies` of what
        :meth:`namespace_placements` answers (None where that is empty): what a capped
        placement answer walks (``placement_rank.top_placements``).

        Lock-free, with the same guarantee as :meth:`namespace_placements`. Memoized per
        holder set: a binding's ``members`` is replaced whole on every change and never
        mutated, so ``(id(members), namespace)``, checked by identity against the members
        kept in the memo, names one holder set for as long as the memo holds it. A chunk
        held by every instance of a fleet is ranked once per change, not once per answer;
        chunks that share an interned members tuple share one entry. The memo holds at
        most ``_RANKED_MEMO_COPIES`` copies (then starts over). Concurrent callers may both
        rank one holder set; either result is right."""
        get = self._store.bindings.get
        memo = self._ranked
        out: list[Optional[RankedCopies]] = []
        for h in chunk_hashes:
            b = get(h)
            if b is None:
                out.append(None)
                continue
            members = b.members  # one read: the holder set of this answer
            key = (id(members), namespace)
            got = memo.get(key)
            if got is not None and got[0] is members:
                out.append(got[1])
                continue
            pls = [p for scope, placements in members if scope.namespace == namespace for p in placements]
            if not pls:
                out.append(None)
                continue
            ranked = ranked_copies(pls)
            self._ranked_copies += len(ranked.order)
            if self._ranked_copies > _RANKED_MEMO_COPIES:
                memo.clear()
                self._ranked_copies = len(ranked.order)
            memo[key] = (members, ranked)
            out.append(ranked)
        return out

    def namespace_holds(self, chunk_hashes: Iterable[bytes], namespace: BlendNamespace) -> list[bool]:
        """Per chunk hash, whether ``namespace`` holds a key of it (any placement): what
        :meth:`namespace_placements` would answer non-empty, without building the tuples
        (the reuse metrics ask it for every prefix-hit lookup). Lock-free, for the same
        reason and with the same guarantee."""
        get = self._store.bindings.get
        out: list[bool] = []
        for h in chunk_hashes:
            b = get(h)
            held = False
            if b is not None:
                for scope, _ in b.members:
                    if scope.namespace == namespace:
                        held = True
                        break
            out.append(held)
        return out

    def get_token_ids(self, chunk_hashes: Iterable[bytes]) -> list[Optional[np.ndarray]]:
        """The content bound to each chunk hash (uint32 copies the caller owns), or None
        when the chunk hash is unknown or no STORE carried its tokens yet."""
        with self._lock:
            return self._store.token_ids(chunk_hashes)

    @property
    def _l1_chunks(self) -> dict[str, set[bytes]]:
        """Per instance, the chunk hashes with its private L1 copy (the directory model test
        checks this bookkeeping against its naive model; not an API)."""
        return self._store.l1_chunks

    def list_keys(self, tier: Optional[str] = None, instance_id: Optional[str] = None,
                  backend: Optional[str] = None, offset: int = 0, limit: Optional[int] = 100
                  ) -> list[KeyPlacements]:
        """Keys with at least one placement matching every given filter, with those
        placements only, in a stable order (first stored first), paginated by
        ``offset``/``limit`` (``limit=None``: all). Shared-pool placements have
        ``instance_id ""``. Scans ``offset + limit`` keys and builds ``limit`` of them."""
        with self._lock:
            return self._store.page(tier, instance_id, backend, offset, limit, count_all=False).keys

    def key_page(self, tier: Optional[str] = None, instance_id: Optional[str] = None,
                 backend: Optional[str] = None, offset: int = 0, limit: int = 100) -> KeyPage:
        """:meth:`list_keys` plus ``total``, every matching key counted (``GET
        /directory/keys``): one scan under the lock that builds only the page's keys."""
        with self._lock:
            return self._store.page(tier, instance_id, backend, offset, limit, count_all=True)

    def stats(self) -> dict[str, Any]:
        """Counts for ``GET /directory/stats`` and metrics (cheap: no scan of the keys)."""
        with self._lock:
            index = self._index
            usage = self._usage
            store = self._store
            blend = index.stats() if index is not None else None
            return {
                # LMCache 0.5.6's DirectoryStats names first (same meaning), then ours
                "num_keys": store.num_keys,
                "num_placements": store.num_placements,
                "l1_keys_by_instance": {inst: store.l1_keys.get(inst, 0)
                                        for inst in store.reporters | store.l1_keys.keys()},
                "l1_count": usage.tier_count.get("l1", 0),
                "l1_size_bytes": usage.tier_bytes.get("l1", 0),
                "l2_count": usage.tier_count.get("l2", 0),
                "l2_size_bytes": usage.tier_bytes.get("l2", 0),
                "keys": store.num_keys,
                "chunk_hashes": len(store.bindings),
                "placements": store.num_placements,
                "token_bindings": store.num_with_tokens,
                "l1_keys_per_instance": dict(store.l1_keys),
                "instances": {inst: {"incarnation": c.incarnation, "last_seq": c.last_seq}
                              for inst, c in self._ingest.gate.cursors().items()},
                "events": self._ingest.counters(),
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
        fencing; :meth:`restore_state` calls this. O(placements)."""
        with self._lock:
            self._usage.rebuild(self._store.placements())

    # ------------------------------------------------------------------ checkpoints
    @property
    def ingest_lock(self) -> threading.RLock:
        """The lock every write holds: held (``with d.ingest_lock: ...``), ingest is paused.
        Lookups do not take it; a checkpoint holds it only while it captures the state."""
        return self._lock

    def export_state(self) -> dict[str, Any]:
        """Everything that decides an answer, as plain data (bulk encoding:
        ``checkpoint.py``), joined from each part's ``export_state``. Call with
        :attr:`ingest_lock` held, or in a forked copy of the process; the values are the
        live objects (shared, not copied): encode them before the next write. Bindings come
        in dict order, which ``list_keys`` pages by."""
        state = self._store.export_state()
        ingest = self._ingest.export_state()
        state["counters"].update(ingest["counters"])
        state.update(capacity=self._capacity.export_state(), gate=ingest["gate"], index=self._index)
        return state

    def clear(self) -> None:
        """Forget everything (a cold start after a failed restore, a resync after the event
        log was reset): empty parts with a fresh, empty index on the same engine (no second
        engine selection). A holder watch is told first (``HolderWatch.cleared_all``), so a
        KV-events subscriber drops what it held before the rebuilt state arrives."""
        with self._lock:
            if self._watch is not None:
                self._watch.cleared_all()
            index = self._index
            if index is not None:
                index = BlendIndex(chunk_size=index.chunk_size, probe_stride=index.probe_stride,
                                   engine=index.engine, filter=index.filter)  # type: ignore[arg-type]
            self._reset(index)

    def restore_state(self, state: dict[str, Any]) -> None:
        """Replace this (empty) directory's state by an :meth:`export_state` as decoded by
        ``checkpoint.py``: ``tokens`` are then the restored index's own rows for indexed
        content (the caller restored the index first) and private read-only arrays for the
        rest. Raises ``ValueError`` when the directory is not empty."""
        with self._lock:
            if self._store.bindings or self._ingest.gate.cursors():
                raise ValueError("restore needs an empty directory")
            self._store.restore_state(state)
            self._ingest.restore_state(state)
            # every instance with a cursor had a batch applied since its last fence (the
            # service fences only through drop_instance, which forgets the cursor too)
            self._store.reporters = set(self._ingest.gate.cursors())
            self._capacity.restore_state(state["capacity"])
            self.rebuild_usage()  # the used-bytes ledger is derived from the placements
