"""Bindings: which keys each chunk hash has, where each key is stored, what content it holds.

Question answered: "where is each key stored, and which tokens does each chunk hash hold?"
One part of the key directory (``key_directory.py`` is the facade; ``ingest.py`` writes
here; the usage ledger is ``capacity.py``). No lock of its own: the directory's lock is held
around every call.

State:
- Placements per key: :class:`Placement` ``(instance_id, incarnation, tier, backend,
  size_bytes, shared)``, one per ``(instance_id, tier, backend)`` (``placements.py``). A
  key's record dies with its last placement.
- Token binding per chunk hash (:class:`Binding`): content (None until a STORE carries
  tokens), its ``token_offset`` (-1 unknown) and the keys bound to it (every key of that
  chunk hash: one per rank / object group / model / salt, each with its placements (a tuple, or
  past ``holder_log.LOG_FROM`` of them a holder log's view: O(1) per holder change), the
  ``members`` tuple). The binding dies with its last key, and a namespace's claim on the
  blend index with its namespace's last key there (:meth:`BindingStore.replace_placements`).
- Per key, LMCache's access record (:attr:`BindingStore.access`): the ``ACCESS`` entries
  applied to the key since it was created and the newest such batch's ``ts``. Only keys
  that were accessed have one (a dict entry of about 200 B); it goes with the key, so a key
  that dies and is stored again starts at 0, as in LMCache's ``KeyDirectory``.
- Per instance, the number of keys with a private L1 placement on it, and a log of the
  chunk hashes that gained one (what fencing walks: only that instance's chunks, never
  every key). The log is a list, appended to in order and never searched: a chunk hash
  may repeat in it, or stay after its copy went, and :meth:`BindingStore.l1_chunks_of`
  filters it against the bindings (exact). Why a list and not a set: a set insert into a
  table of millions is a cache miss per entry (5% of the events thread at 1,000-entry
  bodies) and its resize held the GIL 41-96 ms at 1.3-2.5M keys; an append is neither.
  A key's loss of its copy compacts the log when it holds more than twice the instance's
  L1 keys plus a slack (amortised O(1) a loss; an append cannot break that bound). Under
  churn (an instance evicting as it stores) the log holds up to that many entries, stale
  ones keeping their chunk hash alive until the compaction: measured at 100k L1 keys, 300k
  deletes and stores took 2.01-2.02 s against 2.13-2.23 s with a set.

Memory (docs/performance.md, "Memory per chunk": at most 1.6 KB per stored 256-token chunk, index included): one dict
entry, the chunk hash bytes (the very object the index keeps too), a 4-slot
:class:`Binding` and the token row the index returns (a view of the index's storage: no
copy of indexed tokens is kept here). Placements, key scopes and members tuples are
interned: a fleet has few distinct ones, so a chunk's whole key record is shared. Holding
an index row is safe because a binding holds it only while its chunk hash is an occupant of
that content (it has at least one claim); the index reuses a row only after its content's
last occupant left.

GC note: every binding is a GC-tracked object, so a full collection walks them all (about
1 us per stored entry, amortised, at 100k entries on the dev VM). The service may call
``gc.freeze()`` after bulk loads; this module does not touch process-wide GC settings.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from .blend_index import BlendIndex
from .capacity import UsageLedger
from .indexable import content_indexable, namespace_indexable
from .holder_log import (Placements, canonical, find, has_private_l1, with_placement, without_ident,
                         without_private_l1)
from .placements import L1, SHARED_POOL_INSTANCE, KeyPlacements, Placement, placement_ident
from .wire import TIERS, EventBatch, KeyScope
from .types import BlendNamespace, ObjectKey

__all__ = ["Binding", "BindingStore", "FenceResult", "KeyPage", "Member"]

# (scope, placements: a tuple sorted by (instance_id, tier, backend), or past holder_log.LOG_FROM
# of them a holder log's view); one per key bound to a chunk hash.
Member = tuple[KeyScope, Placements]

#: Stale or repeated entries a per-instance L1 log may hold beyond its instance's L1 keys
#: before it is compacted (see :meth:`BindingStore.l1_chunks_of`).
_L1_LOG_SLACK = 4096

#: Interned values kept at most (placements, members tuples); past it the table starts
#: over. Interning only saves memory; nothing relies on identity.
_INTERN_MAX = 1 << 14


class FenceResult(NamedTuple):
    """What fencing an instance dropped."""

    placements: int
    keys: int


class KeyPage(NamedTuple):
    """One page of :meth:`BindingStore.page`: every matching key counted, one page built."""

    total: int
    keys: list[KeyPlacements]


class Binding:
    """One chunk hash: its content, offset, keys, and whether it takes part in the index.

    ``tokens``: read-only uint32 row (the index's own row when indexed, else a private
    copy; during an apply possibly a view of the batch's buffer or None while its first
    content waits in ingest's deferral buffer) or None. ``indexed``: content was stored
    while blend lookup was enabled, so a claim is kept for every key's namespace (when the
    content and the namespace are indexable: ``indexable.py``).
    """

    __slots__ = ("tokens", "offset", "members", "indexed")

    def __init__(self, members: tuple[Member, ...], offset: int = -1, indexed: bool = False,
                 tokens: Optional[np.ndarray] = None) -> None:
        self.tokens = tokens
        self.offset = offset
        self.members = members
        self.indexed = indexed


class BindingStore:
    """Bindings, placements and the per-instance L1 bookkeeping (see the module docstring)."""

    def __init__(self, usage: UsageLedger, index: Optional[BlendIndex] = None) -> None:
        self.bindings: dict[bytes, Binding] = {}
        self.usage = usage
        self.index = index
        # instance -> chunk hashes that gained its private L1 copy, in order (may repeat or
        # be stale: l1_chunks_of is the exact set)
        self.l1_log: dict[str, list[bytes]] = {}
        self.l1_keys: dict[str, int] = {}  # instance -> keys with a private L1 placement there
        # instances with a batch applied since their last fence: LMCache's
        # ``l1_keys_by_instance`` lists each of them, at 0 when it holds no L1 key
        self.reporters: set[str] = set()
        # key -> [ACCESS entries applied since the key was created, newest such batch's ts]
        self.access: dict[ObjectKey, list] = {}
        self.num_keys = 0
        self.num_placements = 0
        self.num_with_tokens = 0
        self._interned: dict[Any, Any] = {}
        self._singles: dict[tuple[int, int], tuple[Member, ...]] = {}

    # ------------------------------------------------------------------ interning
    def intern(self, value: Any) -> Any:
        table = self._interned
        got = table.get(value)
        if got is None:
            if len(table) >= _INTERN_MAX:
                table.clear()
            got = table[value] = value
        return got

    def single(self, scope: KeyScope, p: Placement) -> tuple[Member, ...]:
        """The interned members tuple of a binding with one key and one placement (the
        common case, so it is looked up by object identity: no tuple hashing)."""
        ident = (id(scope), id(p))
        got = self._singles.get(ident)
        if got is None:
            if len(self._singles) >= _INTERN_MAX:
                self._singles.clear()
            got = self._singles[ident] = ((scope, (p,)),)  # holds scope and p: ids stay valid
        return got

    def placement_of(self, batch: EventBatch, size: int) -> Placement:
        if batch.shared:
            p = Placement(SHARED_POOL_INSTANCE, 0, batch.tier, batch.backend, size, True)
        else:
            p = Placement(batch.instance_id, batch.incarnation, batch.tier, batch.backend, size, False)
        return self.intern(p)

    # ------------------------------------------------------------------ rules
    @staticmethod
    def namespaces(b: Binding) -> tuple[BlendNamespace, ...]:
        members = b.members
        if len(members) == 1:
            return (members[0][0].namespace,)
        return tuple(dict.fromkeys(sc.namespace for sc, _ in members))

    def content_in_index(self, b: Binding) -> bool:
        """Could ``b``'s content be in the index (``indexable.content_indexable``)?"""
        index = self.index
        return index is not None and b.tokens is not None and content_indexable(
            b.tokens.shape[0], index.chunk_size, b.offset)

    # ------------------------------------------------------------------ writes
    def upsert(self, b: Binding, scope: KeyScope, p: Placement) -> tuple[bool, bool, bool]:
        """Add or replace ``p`` among ``scope``'s placements in ``b``.

        Returns ``(key is new, its namespace is new to the binding, the key gained a private
        L1 placement on p's instance)``.
        """
        members = b.members
        for j, (sc, pls) in enumerate(members):
            if sc == scope:
                if find(pls, placement_ident(p)) == p:
                    return False, False, False
                check_l1 = p.tier == L1 and not p.shared
                had_l1 = check_l1 and has_private_l1(pls, p.instance_id)
                new_pls, replaced = with_placement(pls, p)
                if replaced is None:
                    self.num_placements += 1
                b.members = self.members_with(members, j, new_pls)
                return False, False, check_l1 and not had_l1
        ns = scope.namespace
        new_ns = all(sc.namespace != ns for sc, _ in members)
        b.members = self.members_with(members, len(members), (p,), scope)
        self.num_keys += 1
        self.num_placements += 1
        return True, new_ns, p.tier == L1 and not p.shared

    def members_with(self, members: tuple[Member, ...], j: int, pls: Placements,
                     scope: Optional[KeyScope] = None) -> tuple[Member, ...]:
        """``members`` with member ``j``'s placements replaced by ``pls`` (``j ==
        len(members)``: a new member of ``scope``), interned when every member's placements
        are a tuple (a holder log's view is one key's own: never interned, and not hashed:
        hashing would cost O(holders))."""
        sc = members[j][0] if j < len(members) else scope
        if type(pls) is tuple:
            pls = self.intern(pls)
        out = members[:j] + ((sc, pls),) + members[j + 1:]
        if all(type(q) is tuple for _, q in out):
            return self.intern(out)
        return out

    def add_new(self, batch: EventBatch, hashes: Sequence[bytes], bindings: list[Binding]) -> None:
        """Bind new, distinct chunk hashes of ``batch``, one key and one placement each."""
        n = len(hashes)
        self.bindings.update(zip(hashes, bindings))
        self.num_keys += n
        self.num_placements += n
        if batch.tier == L1 and not batch.shared:
            self.log_l1(batch.instance_id, hashes)

    # ------------------------------------------------------------------ the L1 logs
    def log_l1(self, inst: str, hashes: Sequence[bytes]) -> None:
        """Keys gained a private L1 copy on ``inst``, one per entry of ``hashes`` (their
        chunk hashes: a chunk hash twice for two of its keys)."""
        log = self.l1_log.get(inst)
        if log is None:
            log = self.l1_log[inst] = []
        log.extend(hashes)  # keeps the log's bound: it grows by as many entries as keys
        self.l1_keys[inst] = self.l1_keys.get(inst, 0) + len(hashes)

    def l1_chunks_of(self, inst: str) -> list[bytes]:
        """The chunk hashes with a private L1 copy on ``inst``, each once, in the order they
        first gained one (exact: the log filtered against the bindings)."""
        log = self.l1_log.get(inst)
        if not log:
            return []
        get = self.bindings.get
        holds: dict[int, bool] = {}  # id(members) -> the answer: members tuples are interned, and
        # every one seen stays alive (bound) for the whole call, so its id is not reused
        out = []
        for h in dict.fromkeys(log):
            b = get(h)
            if b is None:
                continue
            members = b.members
            got = holds.get(id(members))
            if got is None:
                got = holds[id(members)] = any(has_private_l1(pls, inst) for _, pls in members)
            if got:
                out.append(h)
        return out

    @property
    def l1_chunks(self) -> dict[str, set[bytes]]:
        """Per instance holding any, the chunk hashes with its private L1 copy (exact; a
        scan of the logs: for tests and checks, not the ingest path)."""
        out = {inst: set(self.l1_chunks_of(inst)) for inst in self.l1_log}
        return {inst: hs for inst, hs in out.items() if hs}

    def delete(self, batch: EventBatch) -> None:
        """Apply a DELETE batch: drop the reporter's placement of each key (the pool's
        placement for a shared batch); unknown keys and placements are no-ops."""
        entries = batch.entries
        inst = SHARED_POOL_INSTANCE if batch.shared else batch.instance_id
        ident = (inst, batch.tier, batch.backend)
        bindings = self.bindings
        for h, scope in zip(entries.chunk_hashes, entries.scopes):
            b = bindings.get(h)
            if b is None:
                continue
            for j, (sc, pls) in enumerate(b.members):
                if sc == scope:
                    kept, gone = without_ident(pls, ident)
                    if gone is not None:
                        self.replace_placements(h, b, j, (gone,), kept)
                    break

    def record_access(self, batch: EventBatch) -> None:
        """Apply an ACCESS batch as LMCache 0.5.6 does: each entry whose key exists counts
        one access and raises its last access time to the batch's ``ts``; an entry for an
        unknown key is a no-op (it creates nothing)."""
        bindings = self.bindings
        access = self.access
        ts = float(batch.ts)
        entries = batch.entries
        for h, scope in zip(entries.chunk_hashes, entries.scopes):
            b = bindings.get(h)
            if b is None:
                continue
            for sc, _ in b.members:
                if sc == scope:
                    key = sc.object_key(h)
                    rec = access.get(key)
                    if rec is None:
                        access[key] = [1, ts]
                    else:
                        rec[0] += 1
                        if ts > rec[1]:
                            rec[1] = ts
                    break

    def access_counts(self, keys: Iterable[ObjectKey]) -> list[int]:
        """Per key, the ACCESS entries applied to it since it was created (0 for an unknown
        key or one never accessed)."""
        get = self.access.get
        return [rec[0] if (rec := get(k)) is not None else 0 for k in keys]

    def fence(self, instance_id: str) -> FenceResult:
        """Drop every private L1 placement of ``instance_id`` (its memory is gone after a
        restart); keys left without placements die, and with them their namespaces' claims."""
        chunks = self.l1_chunks_of(instance_id)
        self.l1_log.pop(instance_id, None)
        keys_before, placements_before = self.num_keys, self.num_placements
        for h in chunks:
            b = self.bindings[h]  # l1_chunks_of is exact: every hash in it is bound
            j = 0
            while j < len(b.members):
                kept, gone = without_private_l1(b.members[j][1], instance_id)
                if gone:
                    self.replace_placements(h, b, j, gone, kept, l1_exact=False)
                    if not kept:
                        continue  # member j died; the next one moved to j
                j += 1
        self.l1_keys.pop(instance_id, None)
        self.reporters.discard(instance_id)
        return FenceResult(placements_before - self.num_placements, keys_before - self.num_keys)

    def replace_placements(self, h: bytes, b: Binding, j: int, gone: Sequence[Placement],
                           kept: Placements, l1_exact: bool = True) -> None:
        """Member ``j`` of ``b`` lost ``gone`` and keeps ``kept`` (``holder_log.py``'s
        ``without_*`` made both); a member left without placements dies (and its
        namespace's claim with its last key), a binding without members too.
        ``l1_exact=False``: the caller (fencing) resets the instance's L1 bookkeeping itself."""
        self.num_placements -= len(gone)
        self.usage.remove_placements(gone)
        if l1_exact:
            self._drop_l1_bookkeeping(gone, kept)
        members = b.members
        if kept:
            b.members = self.members_with(members, j, kept)
            return
        scope = members[j][0]
        if self.access:
            self.access.pop(scope.object_key(h), None)  # the key died: its access record too
        rest = members[:j] + members[j + 1:]
        b.members = (self.intern(rest) if all(type(q) is tuple for _, q in rest) else rest) if rest else ()
        self.num_keys -= 1
        ns = scope.namespace
        if b.indexed and self.content_in_index(b) and all(sc.namespace != ns for sc, _ in rest):
            self.index.remove_claim(b.tokens, h, ns)  # type: ignore[union-attr]
            if rest and not any(namespace_indexable(sc.namespace) for sc, _ in rest):
                # that was the last claim (world-size-0 keys are never claimed): the index
                # frees the row and may reuse it, so the binding keeps a copy of its own
                own = b.tokens.copy()  # type: ignore[union-attr]
                own.setflags(write=False)
                b.tokens = own
        if not rest:
            del self.bindings[h]
            if b.tokens is not None:
                self.num_with_tokens -= 1
            b.tokens = None

    def _drop_l1_bookkeeping(self, gone: Sequence[Placement], kept: Placements) -> None:
        """A key lost ``gone`` and keeps ``kept``: count down each instance whose last private
        L1 copy of the key went (its log keeps the chunk hash until a compaction: stale)."""
        for inst in {q.instance_id for q in gone if q.tier == L1 and not q.shared}:
            if has_private_l1(kept, inst):
                continue
            left = self.l1_keys.get(inst, 0) - 1
            if left > 0:
                self.l1_keys[inst] = left
                log = self.l1_log.get(inst)
                if log is not None and len(log) > 2 * left + _L1_LOG_SLACK:
                    # the key losing its copy is still bound as it was: its chunk may stay, stale
                    log[:] = self.l1_chunks_of(inst)
            else:  # no key of any chunk holds a private L1 copy there: the log is all stale
                self.l1_keys.pop(inst, None)
                self.l1_log.pop(inst, None)

    # ------------------------------------------------------------------ reads
    def lookup(self, keys: Iterable[ObjectKey]) -> list[tuple[Placement, ...]]:
        out: list[tuple[Placement, ...]] = []
        bindings = self.bindings
        for key in keys:
            b = bindings.get(key.chunk_hash)
            pls: tuple[Placement, ...] = ()
            if b is not None:
                for scope, placements in b.members:
                    if (scope.model_name == key.model_name and scope.kv_rank == key.kv_rank
                            and scope.object_group_id == key.object_group_id and scope.cache_salt == key.cache_salt):
                        pls = canonical(placements)
                        break
            out.append(pls)
        return out

    def token_ids(self, chunk_hashes: Iterable[bytes]) -> list[Optional[np.ndarray]]:
        out: list[Optional[np.ndarray]] = []
        for h in chunk_hashes:
            b = self.bindings.get(h)
            out.append(None if b is None or b.tokens is None else b.tokens.copy())
        return out

    def page(self, tier: Optional[str], instance_id: Optional[str], backend: Optional[str], offset: int,
             limit: Optional[int], count_all: bool) -> KeyPage:
        """Keys with at least one placement matching every given filter (with those
        placements only), first stored first: ``limit`` of them (None: all) after skipping
        ``offset``. Only the page's keys are built; the others are counted (``count_all``:
        every match, a full scan; else the scan stops at the end of the page and ``total``
        is what was seen). See :meth:`KeyDirectory.list_keys`."""
        if tier is not None and tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be an integer >= 0, got {offset!r}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be an integer >= 0 or None, got {limit!r}")
        out: list[KeyPlacements] = []
        end = None if limit is None else offset + limit
        seen = 0

        def wanted(p: Placement) -> bool:
            return ((tier is None or p.tier == tier) and (instance_id is None or p.instance_id == instance_id)
                    and (backend is None or p.backend == backend))

        everything = tier is None and instance_id is None and backend is None
        for h, b in self.bindings.items():
            for scope, placements in b.members:
                if not everything and not any(map(wanted, placements)):
                    continue
                if offset <= seen and (end is None or seen < end):
                    chosen = canonical(placements) if everything else tuple(filter(wanted, canonical(placements)))
                    out.append(KeyPlacements(scope.object_key(h), chosen))
                seen += 1
                if not count_all and end is not None and seen >= end:
                    return KeyPage(seen, out)
        return KeyPage(seen, out)

    # ------------------------------------------------------------------ checkpoints
    def export_state(self) -> dict[str, Any]:
        """This part's checkpoint state: the live objects (shared, not copied; encode them
        before the next write), bindings in dict order, which :meth:`page` pages by."""
        bindings = list(self.bindings.values())
        return {
            "hashes": list(self.bindings),
            "members": [m if all(type(pls) is tuple for _, pls in m) else
                        tuple((sc, canonical(pls)) for sc, pls in m) for m in (b.members for b in bindings)],
            "offsets": [b.offset for b in bindings],
            "indexed": [b.indexed for b in bindings],
            "tokens": [b.tokens for b in bindings],
            "l1_chunks": {inst: hs for inst in self.l1_log if (hs := self.l1_chunks_of(inst))},
            "l1_keys": dict(self.l1_keys),
            "access": self.access,
            "counters": {"num_keys": self.num_keys, "num_placements": self.num_placements,
                         "num_with_tokens": self.num_with_tokens},
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        """Replace this (empty) store's state by an :meth:`export_state` as decoded by
        ``checkpoint.py`` (``tokens``: the restored index's own rows for indexed content)."""
        hashes = state["hashes"]
        self.bindings = dict(zip(hashes, map(Binding, state["members"], state["offsets"], state["indexed"],
                                             state["tokens"])))
        if len(self.bindings) != len(hashes):
            raise ValueError("a chunk hash appears twice in the snapshot")
        self.l1_log = {inst: list(hs) for inst, hs in state["l1_chunks"].items()}
        self.l1_keys = {inst: int(n) for inst, n in state["l1_keys"].items()}
        self.access = dict(state.get("access", {}))
        c = state["counters"]
        self.num_keys, self.num_placements = int(c["num_keys"]), int(c["num_placements"])
        self.num_with_tokens = int(c["num_with_tokens"])

    def placements(self) -> Iterable[Placement]:
        """Every placement held (to rebuild the usage ledger). O(placements)."""
        for b in self.bindings.values():
            for _, pls in b.members:
                yield from pls
