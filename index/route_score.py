"""The routing score: how many of a request's tokens each instance could serve from cache.

Question answered: "which instance should serve this request?" KV-aware routers
credit only the longest cached prefix per worker; a document placed after different
instructions earns them nothing. This score credits both, per instance:

- ``prefix_tokens``: ``chunk_size`` times the number of leading full chunks of the request
  whose prefix-chained hashes (the fleet's token hasher, as LMCache's prefix lookup computes
  them) the instance holds in L1 for the namespace; the prefix stops at the first chunk it
  does not hold;
- ``fragment_tokens``: the query tokens at or after that prefix covered by non-overlapping
  blend matches (``resolve_overlaps``: leftmost first) among the matches starting at or
  after the prefix's end whose chunk the instance holds in L1;
- ``reusable_tokens = prefix_tokens + fragment_tokens``;

and once for the request, ``shared_tokens``: tokens covered by non-overlapping matches whose
chunk has a shared-pool copy (``placement_rank.SHARED``: any instance can fetch it).

"Holds in L1" means a private L1 placement of that instance (a shared pool's L1 copy is
shared, not anyone's L1); only live instances hold anything (``live``: the caller's view of
the registry; a fenced instance's L1 copies are already gone from the directory, an expired
or unknown one is not in ``live``). Every match covers exactly ``chunk_size`` tokens.

Rows: one per candidate (duplicates once), or by default one per live instance (the
registry's live fleet: telling which instances hold anything of a namespace would take a
walk of the directory, and an instance holding nothing of the request scores 0 anyway; a
fleet serving several models passes its candidates). Sorted by ``reusable_tokens``
descending, then ``instance_id``. Pure functions over their arguments (no locks, no I/O):
the service gathers matches, placements and prefix hashes (``service/routing.py``);
``tests/test_route_score.py`` checks them against a brute-force oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, NamedTuple, Optional, Sequence

from .placement_rank import is_shared, resolve_overlaps
from .placements import L1, Placement
from .types import BlendMatch

__all__ = ["InstanceScore", "RouteScore", "l1_holders", "leading_held", "reuse_split", "route_score"]


class InstanceScore(NamedTuple):
    """One row of ``POST /route/score`` (a NamedTuple: built once per candidate per request)."""

    instance_id: str
    prefix_tokens: int
    fragment_tokens: int
    reusable_tokens: int

    def as_wire(self) -> dict[str, object]:
        return self._asdict()


@dataclass(frozen=True, slots=True)
class RouteScore:
    """The whole answer: ``shared_tokens`` and the rows, sorted (module docstring)."""

    shared_tokens: int
    instances: list[InstanceScore]

    def as_wire(self) -> dict[str, object]:
        return {"shared_tokens": self.shared_tokens, "instances": [r.as_wire() for r in self.instances]}


def l1_holders(placements: Sequence[Placement], live: Collection[str]) -> set[str]:
    """The live instances holding a private L1 copy among ``placements``."""
    return {p.instance_id for p in placements
            if p.tier == L1 and not is_shared(p.instance_id) and p.instance_id in live}


def leading_held(held: Sequence[bool]) -> int:
    """How many leading items of ``held`` are true (a chained prefix stops at its first miss)."""
    for k, h in enumerate(held):
        if not h:
            return k
    return len(held)


def _covered(matches: Sequence[BlendMatch], chunk_size: int) -> int:
    return chunk_size * len(resolve_overlaps(matches, chunk_size))


def route_score(matches: Sequence[BlendMatch], match_placements: Sequence[Sequence[Placement]],
                prefix_placements: Sequence[Sequence[Placement]], chunk_size: int, live: Collection[str],
                candidates: Optional[Sequence[str]] = None) -> RouteScore:
    """The score of one request (module docstring).

    ``match_placements[i]``: the namespace's placements of ``matches[i]``'s chunk.
    ``prefix_placements[j]``: those of the request's ``j``-th prefix-chained chunk hash, for
    ``j`` from 0 on; it may stop after the first chunk no live instance holds in L1 (no prefix
    goes past it). ``live``: the live instance ids (the default rows)."""
    if len(match_placements) != len(matches):
        raise ValueError(f"{len(match_placements)} placement lists for {len(matches)} matches")
    rows_for = sorted(live) if candidates is None else list(dict.fromkeys(candidates))
    # one pass over the prefix chunks for every instance at once: the ones still extending
    # their prefix, and where each one stopped
    prefix_chunks: dict[str, int] = {}
    extending = set(rows_for)
    for j, pls in enumerate(prefix_placements):
        if not extending:
            break
        held = l1_holders(pls, live)
        for inst in extending - held:
            prefix_chunks[inst] = j
        extending &= held
    for inst in extending:
        prefix_chunks[inst] = len(prefix_placements)
    # one pass over the matches: each instance's L1 matches, in the given order
    mine: dict[str, list[BlendMatch]] = {}
    for m, pls in zip(matches, match_placements):
        for inst in l1_holders(pls, live):
            mine.setdefault(inst, []).append(m)
    rows = []
    for inst in rows_for:
        prefix = chunk_size * prefix_chunks[inst]
        after = [m for m in mine.get(inst, ()) if m.cur_st >= prefix]
        frag = _covered(after, chunk_size) if after else 0
        rows.append(InstanceScore(inst, prefix, frag, prefix + frag))
    rows.sort(key=lambda r: (-r.reusable_tokens, r.instance_id))
    shared = [m for m, pls in zip(matches, match_placements) if any(is_shared(p.instance_id) for p in pls)]
    return RouteScore(_covered(shared, chunk_size), rows)


def reuse_split(matches: Sequence[BlendMatch], prefix_chunks: int, chunk_size: int, *, resolved: bool = False
                ) -> tuple[int, int]:
    """``(prefix_tokens, non_prefix_tokens)`` of one lookup, fleet-wide (the reuse metrics):
    ``prefix_chunks`` leading chunks a prefix cache holds, then the tokens at or after them
    covered by non-overlapping matches (the score's rule with every holder counted).
    ``resolved``: ``matches`` are :func:`resolve_overlaps`' answer already (non-overlapping,
    ascending), whose tail after the prefix is its own answer (it saves a second pass)."""
    prefix = chunk_size * prefix_chunks
    after = [m for m in matches if m.cur_st >= prefix]
    return prefix, chunk_size * len(after) if resolved else _covered(after, chunk_size)
