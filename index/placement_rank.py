"""Placement ranking: which copies of a matched chunk may serve a requester, best first.

Question answered: "of the copies the directory knows for a chunk, which are usable now, and
which should this requester read?" (issue 26: LMCache's index offers a match without saying
where it lives, though the directory knows both the peers' L1 copies and the shared L2 ones).

A copy is usable when its holder is live: a private copy (L1 or L2) of an instance that is
not in ``live`` (expired, deregistered, fenced away by the registry; the caller decides who
is live, see ``InstanceRegistry.live_ids``) is left out. A shared-pool copy (``instance_id
""``) belongs to no instance and is always usable. Usable copies are ranked by class
(lower is better), then the requester's own copy first, then ``(instance_id, tier,
backend)`` so the order is total and deterministic:

====  =================  ============================================================
rank  class              why
====  =================  ============================================================
0     ``OWN_L1``         the requester's own L1: no transfer at all
1     ``PEER_L1``        another live instance's L1: one peer-to-peer transfer
2     ``SHARED``         a shared pool (any tier): any instance can fetch it
3     ``PRIVATE_L2``     a live instance's own L2 (its disk): slower, and only that instance
====  =================  ============================================================

:class:`RankedCopies` and :func:`top_placements` give the first ``cap`` of that ranking and
how many copies it holds without ranking every copy per requester: a chunk held by every
instance of a big fleet (a shared system prompt) has one copy per instance, and an answer
must not cost O(holders) per match. :func:`ranked_copies` sorts a chunk's copies once by a
requester-independent key (its class for a requester that holds none of them, then
``(instance_id, tier, backend)``); a requester's own copies are contiguous in that order (one
instance id), found by bisection and moved where the module table puts them: its L1 first,
its L2 first among the private L2s. So :func:`top_placements` walks ``cap`` usable copies
(plus the dead ones it skips) and counts the usable ones at C speed; it equals
``rank_placements(...)[:cap]`` and ``len(rank_placements(...))`` exactly
(``tests/test_placement_cap.py`` checks it against that oracle). The caller memoizes
:class:`RankedCopies` per stored holder set (``KeyDirectory.namespace_ranked``).

:func:`resolve_overlaps` is THE non-overlap rule for matches (leftmost first, LMCache's blend
path); with ``rank`` it prefers the better-placed of two overlapping matches. The client,
the routing score and the reuse metrics all call it. Pure functions, no I/O, no locks.
"""

from __future__ import annotations

import bisect
from itertools import chain
from typing import Callable, Container, Iterable, NamedTuple, Optional, Sequence, TypeVar

from .placements import L1, SHARED_POOL_INSTANCE, Placement

__all__ = [
    "OWN_L1",
    "PEER_L1",
    "PRIVATE_L2",
    "RankedCopies",
    "SHARED",
    "UNPLACED",
    "best_rank",
    "is_shared",
    "placement_class",
    "rank_placements",
    "ranked_copies",
    "resolve_overlaps",
    "top_placements",
]

OWN_L1 = 0
PEER_L1 = 1
SHARED = 2
PRIVATE_L2 = 3
#: The rank of a match with no usable copy (worse than every class).
UNPLACED = 4

M = TypeVar("M")


def is_shared(instance_id: str) -> bool:
    """Is a copy held by ``instance_id`` a shared-pool copy (any instance can fetch it)?"""
    return instance_id == SHARED_POOL_INSTANCE


def placement_class(instance_id: str, tier: str, requester: Optional[str]) -> int:
    """The class of one copy for ``requester`` (None: nobody's own): see the module table.
    Takes the fields, not a :class:`Placement`, so the client can rank what it received."""
    if is_shared(instance_id):
        return SHARED
    if tier == L1:
        return OWN_L1 if instance_id == requester else PEER_L1
    return PRIVATE_L2


def rank_placements(placements: Iterable[Placement], requester: Optional[str], live: Container[str]
                    ) -> list[Placement]:
    """The usable copies among ``placements``, best first (module docstring). Duplicates of
    one ``(instance_id, tier, backend)`` (several keys of one chunk in a namespace, e.g. one
    per rank) are reported once."""
    seen: set[tuple[str, str, str]] = set()
    out: list[Placement] = []
    for p in placements:
        ident = (p.instance_id, p.tier, p.backend)
        if ident in seen or not (is_shared(p.instance_id) or p.instance_id in live):
            continue
        seen.add(ident)
        out.append(p)
    out.sort(key=lambda p: (placement_class(p.instance_id, p.tier, requester), p.instance_id != requester,
                            p.instance_id, p.tier, p.backend))
    return out


class RankedCopies(NamedTuple):
    """One chunk's distinct copies (one per ``(instance_id, tier, backend)``, the first seen
    kept, as :func:`rank_placements` keeps it), ranked for a requester that holds none of
    them (:func:`ranked_copies`). Immutable: shared by every reader of the same holder set."""

    #: sorted by :func:`_base_key`, then ``(tier, backend)``
    order: tuple[Placement, ...]
    #: the instance ids of the private copies, for counting the live ones
    private_ids: tuple[str, ...]
    #: shared-pool copies (always usable)
    shared: int


def _base_class(p: Placement) -> int:
    """The class of ``p`` for a requester that is not its holder."""
    if is_shared(p.instance_id):
        return SHARED
    return PEER_L1 if p.tier == L1 else PRIVATE_L2


def _base_key(p: Placement) -> tuple[int, str]:
    return _base_class(p), p.instance_id


def ranked_copies(placements: Iterable[Placement]) -> RankedCopies:
    """The distinct copies among ``placements`` in requester-independent order (module
    docstring). O(n log n); the result is meant to be kept while the holder set lasts."""
    seen: set[tuple[str, str, str]] = set()
    distinct: list[Placement] = []
    for p in placements:
        ident = (p.instance_id, p.tier, p.backend)
        if ident not in seen:
            seen.add(ident)
            distinct.append(p)
    distinct.sort(key=lambda p: (_base_class(p), p.instance_id, p.tier, p.backend))
    private_ids = tuple(p.instance_id for p in distinct if not is_shared(p.instance_id))
    return RankedCopies(tuple(distinct), private_ids, len(distinct) - len(private_ids))


def top_placements(copies: RankedCopies, requester: Optional[str], live: Container[str], cap: int
                   ) -> tuple[list[Placement], int]:
    """``(rank_placements(copies)[:cap], len(rank_placements(copies)))`` for ``requester``
    and ``live``, without ranking every copy: O(cap + dead copies skipped + log n) Python
    steps, and one C-speed pass over the private ids to count the live ones (``live``
    should be a set). ``cap`` >= 0."""
    order = copies.order
    n = len(order)
    # the requester's own copies: one instance id, so contiguous in each class
    if requester is None or is_shared(requester):
        l1_lo = l1_hi = 0
        l2_lo = l2_hi = l2_at = bisect.bisect_left(order, PRIVATE_L2, key=_base_class)
    else:
        l1_lo = bisect.bisect_left(order, (PEER_L1, requester), key=_base_key)
        l1_hi = bisect.bisect_right(order, (PEER_L1, requester), lo=l1_lo, key=_base_key)
        l2_at = bisect.bisect_left(order, PRIVATE_L2, lo=l1_hi, key=_base_class)
        l2_lo = bisect.bisect_left(order, (PRIVATE_L2, requester), lo=l2_at, key=_base_key)
        l2_hi = bisect.bisect_right(order, (PRIVATE_L2, requester), lo=l2_lo, key=_base_key)
    # own L1 | L1 and shared but own L1 | own L2 | other L2 before it | other L2 after it
    walk = chain(range(l1_lo, l1_hi), range(0, l1_lo), range(l1_hi, l2_at), range(l2_lo, l2_hi),
                 range(l2_at, l2_lo), range(l2_hi, n))
    kept: list[Placement] = []
    if cap > 0:
        for i in walk:
            p = order[i]
            if p.instance_id in live or is_shared(p.instance_id):
                kept.append(p)
                if len(kept) == cap:
                    break
    usable = copies.shared + sum(map(live.__contains__, copies.private_ids))
    return kept, usable


def resolve_overlaps(matches: Iterable[M], chunk_size: int = 256, *,
                     rank: Optional[Callable[[M], int]] = None) -> list[M]:
    """Non-overlapping matches (anything with a ``cur_st``), in ascending ``cur_st``.

    A match covers query positions ``[cur_st, cur_st + chunk_size)``. Without ``rank``:
    walking matches in ascending ``cur_st`` (ties keep their given order, i.e. the server's:
    the first-indexed occupant wins), a match is kept iff it starts at or after the end of
    the last kept one. Because every match has the same length, this leftmost-greedy rule
    keeps the largest possible number of non-overlapping chunks (the classic
    interval-scheduling argument), and it is the rule LMCache's blend path applies.

    With ``rank`` (lower is better, e.g. a match's best placement class): matches are
    walked by ``(rank, cur_st)`` instead and a match is kept iff it overlaps no kept one, so
    of two overlapping matches the better-placed wins (equal ranks: the leftmost, as
    above; all ranks equal gives exactly the rule above). This may keep fewer chunks than
    the leftmost rule: one well-placed chunk can displace two poorly placed neighbours.
    ``chunk_size`` must be the server's.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if rank is None:
        out: list[M] = []
        end = None
        for m in sorted(matches, key=_cur_st):  # stable: ties keep their order
            if end is None or m.cur_st >= end:  # type: ignore[attr-defined]
                out.append(m)
                end = m.cur_st + chunk_size  # type: ignore[attr-defined]
        return out
    kept_starts: list[int] = []
    kept: list[tuple[int, int, M]] = []
    for k, m in enumerate(sorted(matches, key=lambda m: (rank(m), _cur_st(m)))):
        st = _cur_st(m)
        i = bisect.bisect_left(kept_starts, st)
        if i < len(kept_starts) and kept_starts[i] < st + chunk_size:
            continue  # a kept one starts inside this one
        if i > 0 and kept_starts[i - 1] + chunk_size > st:
            continue  # this one starts inside a kept one
        kept_starts.insert(i, st)
        kept.insert(i, (st, k, m))
    return [m for _, _, m in kept]


def _cur_st(m: object) -> int:
    return m.cur_st  # type: ignore[attr-defined,no-any-return]


def best_rank(placements: Sequence[tuple[str, str]], requester: Optional[str]) -> int:
    """The best class among ``(instance_id, tier)`` pairs (:data:`UNPLACED` when empty)."""
    return min((placement_class(i, t, requester) for i, t in placements), default=UNPLACED)
