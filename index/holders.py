"""Holder-set changes: what a router may learn of the directory, batch by batch.

Question answered: "which chunks did each holder gain or lose at this admitted batch?" A
*spot* is where a router can send a request: one holder (an instance, or a shared pool:
holder ``""``) for one model, on one tier and backend. The **holder set** of the directory
is the set of ``(spot, chunk_hash)`` for which some key of that chunk hash and model has a
placement at that holder, tier and backend **and** the chunk's tokens are known (routers
hash tokens; a chunk whose STORE carried none is not part of it, and is counted as
``tokenless`` when it first appears at a spot). Ranks, object groups and cache salts of a
chunk collapse into one spot: many ranks of one chunk are one entry.

:class:`HolderWatch` is the directory's one hook (``KeyDirectory.set_holder_watch``): the
directory calls :meth:`HolderWatch.before_batch` / :meth:`HolderWatch.before_fence` with its
bindings before it changes them and :meth:`HolderWatch.after` after, then
:meth:`HolderWatch.commit` at the batch boundary, which hands one :class:`HolderChanges` to
the sink (a publisher), under the directory lock, in the applied order. Only the chunk
hashes a batch touches are compared (the steady state, a batch of new chunks, takes a
column-wise path with no per-entry work), so the hook costs nothing when no watch is set
and little when one is. The changes are a pure function of the applied stream: replicas
that apply the same stream hand the same changes to their sinks.

Token rows handed out are immutable copies or the batch's own read-only buffer (never a
view of the index's storage, which reuses rows), so a sink may encode them later, on
another thread.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np

from .placements import L1, SHARED_POOL_INSTANCE, Placement

__all__ = ["Spot", "StoredChunks", "HolderChanges", "HolderWatch"]


class Spot(NamedTuple):
    """Where a router may send a request for a chunk: ``holder`` is the instance id, or
    ``""`` for a shared pool (then ``backend`` names the pool)."""

    holder: str
    model_name: str
    tier: str
    backend: str
    shared: bool

    @property
    def private_l1(self) -> bool:
        return self.tier == L1 and not self.shared


class StoredChunks(NamedTuple):
    """Chunks that appeared at one spot: ``hashes[k]`` with tokens ``tokens[k]`` (a uint32
    row; ``tokens`` is a 2-D array when every row has one length, else a list of rows)."""

    hashes: list[bytes]
    tokens: Union[np.ndarray, list[np.ndarray]]


class HolderChanges(NamedTuple):
    """What one batch boundary changed in the holder set (a pure function of the applied
    stream: spots sorted, hashes in entry order), in the order a subscriber must apply it:
    ``fenced`` (the instance whose private L1 copies were dropped first, or None) with
    ``fence_removed``, then ``removed``, then ``stored``. ``ts`` is the stream's time
    of the boundary (the batch's ``ts``; the last one seen when the batch carries none, or
    for a fence that came from outside the event stream). ``tokenless``: first placements
    of chunks without tokens at a spot, left out. ``cleared``: the whole holder set is gone
    (the directory was cleared: a resync after the event log was reset), and nothing else
    is in this change."""

    ts: float
    fenced: Optional[str]
    fence_removed: dict[Spot, list[bytes]]
    removed: dict[Spot, list[bytes]]
    stored: dict[Spot, StoredChunks]
    tokenless: int
    cleared: bool = False

    def __bool__(self) -> bool:  # type: ignore[override]
        return bool(self.fenced or self.removed or self.stored or self.tokenless or self.cleared)


_NONE: frozenset = frozenset()
#: ``(spots, tokens or None, token bytes or None)`` of a chunk hash before a change (its
#: spots count as published only when it has tokens).
_View = tuple[frozenset, Optional[np.ndarray], Optional[bytes]]


def _spot(p: Placement, model_name: str) -> Spot:
    return Spot(SHARED_POOL_INSTANCE if p.shared else p.instance_id, model_name, p.tier, p.backend, p.shared)


class HolderWatch:
    """The directory's hook; see the module docstring. ``sink(changes)`` is called under the
    directory lock at every batch boundary that changed something: it must not block."""

    def __init__(self, sink: Callable[[HolderChanges], None]) -> None:
        self._sink = sink
        self._spots: dict[int, tuple[Any, frozenset]] = {}  # id(members) -> (members, spots)
        self.last_ts = 0.0
        self._reset()

    def _reset(self) -> None:
        self._fenced: Optional[str] = None
        self._fence_removed: dict[Spot, list[bytes]] = {}
        self._removed: dict[Spot, list[bytes]] = {}
        self._stored: dict[Spot, tuple[list[bytes], list[np.ndarray]]] = {}
        self._fast: list[tuple[Spot, list[bytes], np.ndarray]] = []
        self._tokenless = 0

    # ------------------------------------------------------------------ views
    def spots_of(self, members: Sequence[tuple[Any, tuple[Placement, ...]]]) -> frozenset:
        """The spots of one binding's members (memoized: members tuples are interned)."""
        got = self._spots.get(id(members))
        if got is not None and got[0] is members:
            return got[1]
        spots = frozenset(_spot(p, scope.model_name) for scope, pls in members for p in pls)
        if len(self._spots) >= 4096:
            self._spots.clear()
        self._spots[id(members)] = (members, spots)
        return spots

    def _view(self, b: Any, keep_bytes: bool) -> _View:
        tokens = b.tokens
        keep = keep_bytes and tokens is not None
        return self.spots_of(b.members), tokens, tokens.tobytes() if keep else None

    # ------------------------------------------------------------------ before
    def before_batch(self, bindings: dict, batch: Any) -> Optional[dict[bytes, _View]]:
        """The views of the chunk hashes a STORE or DELETE batch touches that are bound now
        (None for other batches). Content of a STORE is kept as bytes: it may change."""
        if batch.event_type not in ("store", "delete"):
            return None
        keep = batch.event_type == "store"
        get = bindings.get
        out: dict[bytes, _View] = {}
        for h in batch.entries.chunk_hashes:
            b = get(h)
            if b is not None and h not in out:
                out[h] = self._view(b, keep)
        return out

    def before_fence(self, bindings: dict, instance_id: str, chunks: Iterable[bytes]) -> tuple[str, dict]:
        """Views of the chunk hashes that fencing ``instance_id`` touches (its L1 chunks,
        each once: ``BindingStore.l1_chunks_of``)."""
        self._fenced = instance_id
        # sorted: the chunks come in the L1 log's order, which follows when the log was last
        # compacted; the changes published must not depend on a replica's history
        return instance_id, {h: self._view(bindings[h], False) for h in sorted(chunks)}

    # ------------------------------------------------------------------ after
    def after_fence(self, bindings: dict, token: tuple[str, dict]) -> None:
        _, before = token
        self._diff(bindings, before, before.keys(), self._fence_removed, None)

    def after_batch(self, bindings: dict, batch: Any, before: Optional[dict[bytes, _View]],
                    settle: Optional[Callable[[], None]] = None) -> None:
        """Compare the touched chunk hashes with ``before``; remember the batch's ``ts``.
        ``settle``: makes every binding's tokens final (the ingest path's deferred index
        writes give new bindings their rows at a flush); called only when the comparison
        reads tokens, not for the steady state (new chunks, content from the batch)."""
        if batch.ts > 0:
            self.last_ts = float(batch.ts)
        if before is None:
            return
        entries = batch.entries
        if not len(entries):
            return
        if batch.event_type == "store" and not before and self._store_fast(batch):
            return
        if settle is not None:
            settle()
        self._diff(bindings, before, dict.fromkeys(entries.chunk_hashes), self._removed, self._stored)

    def _store_fast(self, batch: Any) -> bool:
        """A STORE of new, distinct chunk hashes, each with tokens: every entry is a first
        placement at the batch's spot (its model's), content straight from the batch."""
        entries = batch.entries
        column = entries.tokens
        if not entries.distinct_hashes or column.unfilled or 0 in column.lengths:
            return False
        scopes = entries.scopes
        n = len(entries)
        holder = SHARED_POOL_INSTANCE if batch.shared else batch.instance_id
        lengths = column.lengths
        one_length = lengths.count(lengths[0]) == n
        if scopes.count(scopes[0]) == n or all(sc.model_name == scopes[0].model_name for sc in scopes):
            groups: dict[str, Sequence[int]] = {scopes[0].model_name: range(n)}
        else:  # several models in one batch: one spot each
            groups = {}
            for i, sc in enumerate(scopes):
                groups.setdefault(sc.model_name, []).append(i)  # type: ignore[attr-defined]
        hashes = entries.chunk_hashes
        for model, rows in groups.items():
            spot = Spot(holder, model, batch.tier, batch.backend, bool(batch.shared))
            if one_length:
                block: Any = column.rows(rows)
            else:
                block = [column.row(i) for i in rows]
            picked = hashes if type(rows) is range else [hashes[i] for i in rows]
            self._fast.append((spot, picked, block))
        return True

    def _diff(self, bindings: dict, before: dict[bytes, _View], hashes: Any, removed: dict,
              stored: Optional[dict]) -> None:
        get = bindings.get
        for h in hashes:
            all_old, old_tokens, old_bytes = before.get(h, (_NONE, None, None))
            old_spots = all_old if old_tokens is not None else _NONE  # published only with tokens
            b = get(h)
            if b is None:
                new_spots: frozenset = _NONE
                new_tokens = None
            elif b.tokens is None:
                new_spots, new_tokens = _NONE, None
                if stored is not None:
                    self._tokenless += len(self.spots_of(b.members) - all_old)
            else:
                new_spots, new_tokens = self.spots_of(b.members), b.tokens
            # by value, even for the same array object: the index may rewrite a freed row in place
            changed = old_bytes is not None and new_tokens is not None and old_bytes != new_tokens.tobytes()
            gone = old_spots if changed else old_spots - new_spots
            for s in gone:
                removed.setdefault(s, []).append(h)
            if stored is None:
                continue
            came = new_spots if changed else new_spots - old_spots
            if came:
                row = np.array(new_tokens, dtype=np.uint32)  # a copy: index rows get reused
                row.setflags(write=False)
                for s in came:
                    got = stored.get(s)
                    if got is None:
                        got = stored[s] = ([], [])
                    got[0].append(h)
                    got[1].append(row)

    # ------------------------------------------------------------------ commit
    def cleared_all(self) -> None:
        """The directory forgot everything (``KeyDirectory.clear``): hand the sink one change
        that empties the holder set, before anything rebuilt reaches it. Any partial
        boundary is dropped with the state it described."""
        self._reset()
        self._spots.clear()
        self._sink(HolderChanges(self.last_ts, None, {}, {}, {}, 0, cleared=True))

    def commit(self) -> None:
        """End of a batch boundary: hand what changed to the sink (nothing when nothing did).
        Spots come sorted (they were gathered from sets, whose order follows the process's
        hash seed); each spot's hashes in the batch's entry order (sorted for a fence)."""
        if not (self._fenced or self._removed or self._stored or self._fast or self._tokenless):
            return
        stored: dict[Spot, StoredChunks] = {}
        for spot, hashes, block in self._fast:
            got = stored.get(spot)
            if got is None:
                stored[spot] = StoredChunks(hashes, block)
            else:  # two fast batches in one boundary never happen; kept general
                stored[spot] = StoredChunks(got.hashes + hashes, list(got.tokens) + list(block))
        for spot, (hashes, rows) in self._stored.items():
            got = stored.get(spot)
            if got is not None:
                hashes, rows = got.hashes + hashes, list(got.tokens) + rows
            if rows and all(r.shape == rows[0].shape for r in rows):
                stored[spot] = StoredChunks(hashes, np.stack(rows))
            else:
                stored[spot] = StoredChunks(hashes, rows)
        changes = HolderChanges(self.last_ts, self._fenced, dict(sorted(self._fence_removed.items())),
                                dict(sorted(self._removed.items())), dict(sorted(stored.items())), self._tokenless)
        self._reset()
        self._sink(changes)
