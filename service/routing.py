"""Where to serve it: placements on matches and the routing score, on the lookup thread.

Question answered: "where do this request's matched chunks live, and which instance could
serve most of it from cache?" (issue 26). No HTTP here: the routes hand the batcher a
query whose third item is one of these *finishers*, and the lookup thread
(``ServiceContext._run_lookups``) calls it with the query's matches and tokens instead of
encoding the plain ``{"matches": [...]}``. So placement lookups and scores are batched with
every other lookup, and the default wire is untouched (a query without a finisher is
answered exactly as before).

- :class:`PlacedMatches`: each match with its usable copies, ranked for the requester
  (``index/placement_rank.py``); a match with no live holder is dropped and counted in
  ``dropped_without_live_holder``. Bounded twice (:class:`PlacementBudget`, one per HTTP
  request, shared by a batch's queries): at most ``max_placements_per_match`` copies per
  match, best first, the rest counted in the match's ``placements_omitted``; and at most
  ``max_placement_answer_bytes`` bytes of placements per request: once a match's
  placements would pass it, that match and every later one of the request carry none
  (all their usable copies counted in ``placements_omitted``) and each answer of the
  request from there on says ``placements_truncated: true``. The work per match is
  O(cap) plus a C-speed count of its holders (``placement_rank.top_placements`` over the
  directory's memoized ranking), so a chunk held by every instance of a big fleet does not
  hold the lookup thread.
- :class:`ScoreRequest`: ``POST /route/score`` (``index/route_score.py``): the request's
  prefix-chained chunk hashes come from the fleet's token hasher, hashed in growing steps
  and stopped at the first chunk no live instance holds in L1.

Liveness is the registry's (``InstanceRegistry.live_ids``: registered and heard from within
the instance timeout), read once per answer. A finisher takes no directory lock: its
reads (``KeyDirectory.namespace_placements``) are lock-free, so it never waits for ingest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

import numpy as np

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.placement_rank import RankedCopies, top_placements
from blendmatch.index.registry import InstanceRegistry
from blendmatch.index.route_score import RouteScore, l1_holders, route_score
from blendmatch.index.token_hasher import TokenHasher
from blendmatch.index.tokens import decode_query_tokens
from blendmatch.index.types import BlendMatch, BlendNamespace

__all__ = ["PlacedMatches", "PlacementBudget", "ScoreRequest", "encode_placed", "encode_score", "finish",
           "finish_many", "prefix_placements"]

#: Prefix chunks hashed in the first step; each further step doubles it (a request whose first
#: chunk nobody holds costs one hash; a long prefix at most twice its length).
_FIRST_STEP = 4


def _placement_json(p: Any) -> str:
    return (f'{{"instance_id":{json.dumps(p.instance_id)},"tier":{json.dumps(p.tier)},'
            f'"backend":{json.dumps(p.backend)}}}')


def encode_placed(matches: Sequence[BlendMatch], placements: Sequence[str], omitted: Sequence[int], dropped: int,
                  truncated: bool) -> bytes:
    """``{"matches": [{chunk_hash, old_st, cur_st, placements: [{instance_id, tier, backend}],
    placements_omitted}], "dropped_without_live_holder": n, "placements_truncated": bool}`` as
    JSON bytes; ``placements[i]``: match i's placements, already encoded (the text between the
    brackets: :func:`_placement_json` items joined by commas)."""
    items = [f'{{"chunk_hash":"{m.chunk_hash.hex()}","old_st":{int(m.old_st)},"cur_st":{int(m.cur_st)},'
             f'"placements":[{where}],"placements_omitted":{int(k)}}}'
             for m, where, k in zip(matches, placements, omitted, strict=True)]
    return (f'{{"matches":[{",".join(items)}],"dropped_without_live_holder":{int(dropped)},'
            f'"placements_truncated":{"true" if truncated else "false"}}}').encode()


@dataclass(kw_only=True)
class PlacementBudget:
    """What one HTTP request's placement answers may hold (a single lookup, or every query
    of a batch together): ``cap`` copies per match and ``bytes_left`` bytes of encoded
    placements (module docstring). Touched by one thread at a time: the lookup thread runs
    a request's finishers one after another (or the read thread, with blend lookup off).

    ``omitted_cap`` / ``omitted_bytes`` / ``truncations``: the metrics' counters (``inc``),
    or None. ``live``: who is live, read once per request (at its first placed query) so
    that a batch's answers agree. ``seen``: per holder set and requester, the ranked answer
    already built for this request (a batch of queries over one shared prompt ranks each
    chunk once; the holder set is kept in the value, so its id is not reused meanwhile)."""

    cap: int
    bytes_left: int
    omitted_cap: Any = None
    omitted_bytes: Any = None
    truncations: Any = None
    truncated: bool = False
    live: Optional[frozenset[str]] = None
    seen: dict[tuple[int, Optional[str]], tuple[RankedCopies, str, int, int]] = field(default_factory=dict)

    def placed(self, copies: RankedCopies, requester: Optional[str]) -> tuple[str, int, int]:
        """``(encoded placements, copies kept, usable copies)`` of one match under the cap
        (before the byte bound). Call with :attr:`live` set."""
        key = (id(copies), requester)
        got = self.seen.get(key)
        if got is None or got[0] is not copies:
            kept, usable = top_placements(copies, requester, self.live, self.cap)  # type: ignore[arg-type]
            got = self.seen[key] = (copies, ",".join(map(_placement_json, kept)), len(kept), usable)
        return got[1:]


@dataclass(frozen=True, kw_only=True)
class _Finisher:
    """What every finisher reads: the directory (never replaced: a failed restore clears it
    in place), the registry (who is live) and the query's namespace."""

    directory: KeyDirectory
    registry: InstanceRegistry
    namespace: BlendNamespace

    def read(self, matches: list[BlendMatch]) -> tuple[KeyDirectory, frozenset[str], list[tuple[Any, ...]]]:
        """``(directory, live ids, the namespace's placements of each match's chunk)``."""
        live = self.registry.live_ids()
        directory = self.directory
        return directory, live, directory.namespace_placements([m.chunk_hash for m in matches], self.namespace)


@dataclass(frozen=True, kw_only=True)
class PlacedMatches(_Finisher):
    """Finisher of a lookup with ``include_placements`` (module docstring). ``budget``: the
    request's (shared by a batch's queries)."""

    requester: Optional[str] = None
    budget: PlacementBudget
    #: Counted by the reuse metrics as a blend lookup.
    lookup: ClassVar[bool] = True

    def __call__(self, matches: list[BlendMatch], tokens: np.ndarray) -> bytes:
        budget = self.budget
        if budget.live is None:
            budget.live = self.registry.live_ids()
        ranked = self.directory.namespace_ranked([m.chunk_hash for m in matches], self.namespace)
        kept: list[BlendMatch] = []
        where: list[str] = []
        omitted: list[int] = []
        by_cap = by_bytes = 0
        for m, copies in zip(matches, ranked, strict=True):
            if copies is None:
                continue
            text, n, usable = budget.placed(copies, self.requester)
            if not usable:
                continue
            kept.append(m)
            if not budget.truncated and len(text) + 1 > budget.bytes_left:
                budget.truncated = True
                if budget.truncations is not None:
                    budget.truncations.inc()
            if budget.truncated:
                where.append("")
                omitted.append(usable)
                by_bytes += usable
                continue
            budget.bytes_left -= len(text) + 1  # ASCII (json.dumps escapes): characters are bytes
            where.append(text)
            omitted.append(usable - n)
            by_cap += usable - n
        if by_cap and budget.omitted_cap is not None:
            budget.omitted_cap.inc(by_cap)
        if by_bytes and budget.omitted_bytes is not None:
            budget.omitted_bytes.inc(by_bytes)
        return encode_placed(kept, where, omitted, len(matches) - len(kept), budget.truncated)


def prefix_placements(directory: KeyDirectory, hasher: TokenHasher, tokens: np.ndarray, namespace: BlendNamespace,
                      live: frozenset[str], first_step: int = _FIRST_STEP) -> list[tuple[Any, ...]]:
    """The namespace's placements of the request's leading prefix-chained chunks, up to and
    including the first chunk no live instance holds in L1 (or every full chunk): what
    :func:`route_score` needs. Hashed in doubling steps from ``first_step`` chunks, each
    chained to the last (the step sizes change the work, never the answer)."""
    c = hasher.chunk_size
    total = hasher.num_chunks(int(tokens.shape[0]))
    out: list[tuple[Any, ...]] = []
    prev: Optional[bytes] = None
    step = max(1, first_step)
    while len(out) < total:
        start = len(out)
        end = min(total, start + step)
        hashes = hasher.chunk_hashes(tokens[start * c:end * c], prefix_hash=prev)
        got = directory.namespace_placements(hashes, namespace)
        for pls in got:
            out.append(pls)
            if not l1_holders(pls, live):
                return out
        prev = hashes[-1]
        step *= 2
    return out


@dataclass(frozen=True, kw_only=True)
class ScoreRequest(_Finisher):
    """Finisher of ``POST /route/score``: the score's JSON bytes (module docstring)."""

    hasher: TokenHasher
    candidates: Optional[list[str]] = None
    #: Not a blend lookup for the reuse metrics (a router scores what the engine looks up).
    lookup: ClassVar[bool] = False

    def __call__(self, matches: list[BlendMatch], tokens: np.ndarray) -> bytes:
        directory, live, stored = self.read(matches)
        # a stored chunk with its tokens is matched where it sits, so the matches' leading run
        # from position 0 is where a prefix most likely ends: one step covers it
        c = self.hasher.chunk_size
        run = 0
        while run < len(matches) and matches[run].cur_st == run * c:
            run += 1
        prefix = prefix_placements(directory, self.hasher, tokens, self.namespace, live, max(_FIRST_STEP, run + 1))
        return encode_score(route_score(matches, stored, prefix, c, live, self.candidates))


def encode_score(score: RouteScore) -> bytes:
    """``POST /route/score``'s JSON bytes, formatted directly (instance ids escaped by
    ``json.dumps``): a few times cheaper than ``json.dumps`` of the whole answer."""
    rows = ",".join(f'{{"instance_id":{json.dumps(r.instance_id)},"prefix_tokens":{r.prefix_tokens},'
                    f'"fragment_tokens":{r.fragment_tokens},"reusable_tokens":{r.reusable_tokens}}}'
                    for r in score.instances)
    return f'{{"shared_tokens":{score.shared_tokens},"instances":[{rows}]}}'.encode()


async def finish(ctx: Any, query: tuple[Any, ...]) -> bytes:
    """One query with a finisher through the batcher (or, with blend lookup disabled, its
    finisher over no matches: placements of nothing, a score from prefixes only)."""
    (got,) = await finish_many(ctx, [query])
    if isinstance(got, BaseException):
        raise got
    return got


async def finish_many(ctx: Any, queries: list[tuple[Any, ...]]) -> list["bytes | BaseException"]:
    """Queries, some with finishers, through the batcher; each item its bytes or its error.
    With blend lookup disabled the batcher answers ``{"matches": []}`` to every query: the
    finishers then run here (off the event loop) over no matches."""
    plain = await ctx.lookup_many(queries)  # readiness, decoding errors: as for any lookup
    if ctx.blend_enabled:
        return plain
    finished = [i for i, q in enumerate(queries) if len(q) > 2 and not isinstance(plain[i], BaseException)]
    if finished:
        tokens, offsets, _ = decode_query_tokens([queries[i][0] for i in finished])
        done = await ctx.read(lambda: [queries[i][2]([], tokens[offsets[k]:offsets[k + 1]])
                                       for k, i in enumerate(finished)])
        for i, payload in zip(finished, done):
            plain[i] = payload
    return plain
