"""Holder logs: one key's placements when many instances hold it, added and removed in O(1).

Question answered: "how does a key that every instance of a big fleet holds (a shared
system prompt) gain or lose one holder without copying all the others, while readers that
take no lock still see a whole holder set?"

A key's placements are a small sorted tuple (interned: most keys have one or two, shared
by many chunks; ``bindings.py``) until they grow past :data:`LOG_FROM`; then a
:class:`PlacementView` over a :class:`_Log`. A tuple is replaced whole for every change,
which is O(holders): storing one chunk on 1,000 instances one by one cost O(1,000^2)
(1,000 x 200 shared chunks took 61-67 s to seed). The log:

- ``slots``: a list, only ever appended to (a placement's slot never changes while any
  view can see it);
- ``died``: a parallel ``array('q')``, ``_ALIVE`` while slot i is held, else the version
  of the change that removed it;
- ``version``: the number of the last change (a change is one add, one removal, one
  replacement: the old slot dies and the new copy is appended under one version);
- ``where``: holder -> its live slot(s), writer-side only, so a holder is found in O(1).

A :class:`PlacementView` is ``(log, n, version)``: the slots ``i < n`` with ``died[i] >
version``. A writer never changes what an existing view shows: it appends past every
view's ``n`` and writes deaths with a version above every view's. So a view is an
immutable snapshot, read without a lock (``KeyDirectory.namespace_placements``): the
binding's ``members`` tuple, holding the view, is still replaced whole per change (O(keys of
the chunk), not O(holders)). Dead slots are compacted away into a new log once they
outnumber the live ones (amortised O(1) per removal; views of the old log keep it
alive and unchanged). A log that falls to :data:`LOG_FROM` // 2 live copies turns back
into a tuple (hysteresis: a key at the threshold does not flip back and forth).

Why this and not a persistent tree or chunked copy-on-write: a persistent structure gives
O(log n) per change and a pointer-heavy node per few holders; chunked copy-on-write
still copies O(n / chunk) per add. An append-only log with a published length is O(1)
amortised for adds, removals and replacements, and a view costs three fields.

Order: a view iterates in arrival order; a tuple is sorted by ``placement_ident``.
:func:`canonical` gives the tuple, sorted, for answers and checkpoints (the outward
contract: placements sorted by ``(instance_id, tier, backend)``).

Memory: a placement in a log costs about 70 bytes (its slot, its death word, its
``where`` entry) against 8 in a tuple; only keys with more than :data:`LOG_FROM`
holders pay it. Views are never interned or shared between keys.

Writers call these functions with the directory lock held, always on the binding's
current value (a view that is not its log's newest is refused: ``ValueError``).
"""

from __future__ import annotations

from array import array
from typing import Iterator, Optional, Union

from .placements import L1, Placement, is_private_l1, placement_ident

__all__ = ["LOG_FROM", "PlacementView", "Placements", "canonical", "find", "has_private_l1", "with_placement",
           "without_ident", "without_private_l1"]

#: Above this many placements a key's placements become a log; at half of it, a tuple again.
LOG_FROM = 16

_ALIVE = (1 << 63) - 1


class _Log:
    """The writer side of one key's holder log (module docstring)."""

    __slots__ = ("slots", "died", "where", "version", "live")

    def __init__(self, placements: Iterator[Placement] | tuple[Placement, ...] | list[Placement]) -> None:
        self.slots: list[Placement] = list(placements)
        self.died = array("q", [_ALIVE]) * len(self.slots)
        self.where: dict[str, Union[int, tuple[int, ...]]] = {}
        for i, p in enumerate(self.slots):
            self._index(p.instance_id, i)
        self.version = 0
        self.live = len(self.slots)

    def _index(self, inst: str, i: int) -> None:
        got = self.where.get(inst)
        self.where[inst] = i if got is None else ((got, i) if type(got) is int else got + (i,))

    def _unindex(self, inst: str, i: int) -> None:
        got = self.where[inst]
        if type(got) is int:
            del self.where[inst]
            return
        rest = tuple(k for k in got if k != i)  # type: ignore[union-attr]
        self.where[inst] = rest[0] if len(rest) == 1 else rest

    def slots_of(self, inst: str) -> tuple[int, ...]:
        got = self.where.get(inst)
        if got is None:
            return ()
        return (got,) if type(got) is int else got  # type: ignore[return-value]

    def view(self) -> "PlacementView":
        return PlacementView(self, len(self.slots), self.version, self.live)


class PlacementView:
    """One key's placements at one instant of its log: immutable, lock-free to read (module
    docstring). A sized, iterable collection of :class:`Placement` in arrival order."""

    __slots__ = ("_log", "_n", "_version", "_len")

    def __init__(self, log: _Log, n: int, version: int, length: int) -> None:
        self._log = log
        self._n = n
        self._version = version
        self._len = length

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Placement]:
        log, version = self._log, self._version
        slots, died = log.slots, log.died
        for i in range(self._n):
            if died[i] > version:
                yield slots[i]

    def __repr__(self) -> str:
        return f"PlacementView({len(self)} placements)"

    def _current(self) -> _Log:
        log = self._log
        if self._version != log.version or self._n != len(log.slots):
            raise ValueError("a holder log changes only through its newest view")
        return log


#: One key's placements: a tuple sorted by ``placement_ident``, or a log's view.
Placements = Union[tuple[Placement, ...], PlacementView]


def canonical(pls: Placements) -> tuple[Placement, ...]:
    """``pls`` as a tuple sorted by ``placement_ident`` (a tuple is returned as it is)."""
    if type(pls) is tuple:
        return pls
    return tuple(sorted(pls, key=placement_ident))


def find(pls: Placements, ident: tuple[str, str, str]) -> Optional[Placement]:
    """The placement of ``pls`` with ``ident`` (``placement_ident``), or None. O(1) on a view."""
    if type(pls) is tuple:
        for q in pls:
            if placement_ident(q) == ident:
                return q
        return None
    log = pls._log  # type: ignore[union-attr]
    for i in log.slots_of(ident[0]):
        if i < pls._n and log.died[i] > pls._version:  # type: ignore[union-attr]
            q = log.slots[i]
            if placement_ident(q) == ident:
                return q
    return None


def has_private_l1(pls: Placements, inst: str) -> bool:
    """Does ``pls`` hold a private L1 copy on ``inst`` (``is_private_l1``)? O(1) on a view."""
    if type(pls) is tuple:
        return any(is_private_l1(q, inst) for q in pls)
    log = pls._current()  # type: ignore[union-attr]
    return any(is_private_l1(log.slots[i], inst) for i in log.slots_of(inst))


def with_placement(pls: Placements, p: Placement) -> tuple[Placements, Optional[Placement]]:
    """``pls`` with ``p`` added, or replacing the placement of the same ident: ``(new
    placements, the replaced one or None)``. The caller has checked that ``p`` is not
    already there as it is. O(1) amortised on a view; a tuple that would grow past
    :data:`LOG_FROM` becomes a view."""
    ident = placement_ident(p)
    pls = _logged(pls)
    if type(pls) is tuple:
        for k, q in enumerate(pls):
            if placement_ident(q) == ident:
                return pls[:k] + (p,) + pls[k + 1:], q
        if len(pls) < LOG_FROM:
            return tuple(sorted(pls + (p,), key=placement_ident)), None
        log = _Log(pls + (p,))
        return log.view(), None
    log = pls._current()  # type: ignore[union-attr]
    old = None
    log.version += 1
    for i in log.slots_of(p.instance_id):
        q = log.slots[i]
        if placement_ident(q) == ident:
            old = q
            log.died[i] = log.version
            log._unindex(q.instance_id, i)
            log.live -= 1
            break
    log.slots.append(p)
    log.died.append(_ALIVE)
    log._index(p.instance_id, len(log.slots) - 1)
    log.live += 1
    return _settled(log), old


def without_ident(pls: Placements, ident: tuple[str, str, str]) -> tuple[Placements, Optional[Placement]]:
    """``pls`` without the placement of ``ident``: ``(new placements, the removed one)``;
    ``(pls, None)`` when there is none. O(1) amortised on a view."""
    pls = _logged(pls)
    if type(pls) is tuple:
        kept = tuple(q for q in pls if placement_ident(q) != ident)
        if len(kept) == len(pls):
            return pls, None
        return kept, next(q for q in pls if placement_ident(q) == ident)
    log = pls._current()  # type: ignore[union-attr]
    for i in log.slots_of(ident[0]):
        q = log.slots[i]
        if placement_ident(q) == ident:
            log.version += 1
            _kill(log, i)
            return _settled(log), q
    return pls, None


def without_private_l1(pls: Placements, inst: str) -> tuple[Placements, list[Placement]]:
    """``pls`` without the private L1 copies on ``inst`` (fencing): ``(new placements, the
    removed ones)``. O(copies on ``inst``) amortised on a view."""
    pls = _logged(pls)
    if type(pls) is tuple:
        gone = [q for q in pls if is_private_l1(q, inst)]
        if not gone:
            return pls, gone
        return tuple(q for q in pls if not is_private_l1(q, inst)), gone
    log = pls._current()  # type: ignore[union-attr]
    hit = [i for i in log.slots_of(inst) if is_private_l1(log.slots[i], inst)]
    if not hit:
        return pls, []
    log.version += 1
    gone = []
    for i in hit:
        gone.append(log.slots[i])
        _kill(log, i)
    return _settled(log), gone


def _logged(pls: Placements) -> Placements:
    """A tuple longer than :data:`LOG_FROM` (a restored checkpoint's) as a log's view, so
    that its changes cost O(1) from now on (O(n) once); anything else as it is."""
    if type(pls) is tuple and len(pls) > LOG_FROM:
        return _Log(pls).view()
    return pls


def _kill(log: _Log, i: int) -> None:
    """Slot ``i`` dies at the log's (already advanced) version."""
    log.died[i] = log.version
    log._unindex(log.slots[i].instance_id, i)
    log.live -= 1


def _settled(log: _Log) -> Placements:
    """The newest value of ``log`` after a change: a tuple once it is small again, a view
    of a compacted log once dead slots outnumber live ones, else a view of ``log``."""
    if log.live <= LOG_FROM // 2:
        return canonical(log.view())
    if len(log.slots) - log.live > log.live + LOG_FROM:
        return _Log(iter(log.view())).view()
    return log.view()
