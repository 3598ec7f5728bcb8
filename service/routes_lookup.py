"""Blend lookups: ``POST /directory/blend-lookup`` (LMCache) and ``.../batch`` (ours).

The route bodies are ``answer_lookup`` / ``answer_lookup_batch``, which the fast path
(``fastpath.py``) calls too. The schema checks the body's shape (422 naming the field); the
token count is checked against ``--max-request-tokens`` (413); the query goes through the
micro-batcher (``ctx.lookup`` / ``ctx.lookup_many``), whose thread decodes ``tokens_b64``
(a string that does not decode is a 422 naming the field, e.g. ``body.queries.3.tokens_b64``)
and encodes the answer, so no per-match model objects are built on the event loop. With
blend lookup disabled every query answers ``{"matches": []}`` (bad input is still a 422).
A query with ``include_placements`` (ours, issue 26) carries a finisher (``routing.py``) that
the lookup thread runs in place of the plain encoding; without it the bytes are LMCache's.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Response

from .context import Ctx, LookupQuery, ServiceContext, query_tokens
from blendmatch.index.tokens import TokenDecodeError, decode_token_ids

from .errors import InvalidRequest
from .routing import PlacedMatches, PlacementBudget, finish, finish_many
from .schemas import (
    BlendBatchLookupRequest,
    BlendBatchLookupResponse,
    BlendLookupRequest,
    BlendLookupResponse,
    ErrorResponse,
)

__all__ = ["router", "ERROR_RESPONSES", "answer_lookup", "answer_lookup_batch", "checked_query", "query_of"]

router = APIRouter(tags=["lookup"])

#: Error responses documented on every route that takes a body.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorResponse, "description": "body or token count over a configured limit"},
    422: {"model": ErrorResponse, "description": "missing, mistyped or undecodable field"},
}


def query_of(body: BlendLookupRequest, where: str = "body") -> LookupQuery:
    """The batcher's form of one request: ``token_ids`` decoded here (they are Python ints
    already), ``tokens_b64`` left for the lookup thread to decode with its batch."""
    if body.tokens_b64 is not None:
        return body.tokens_b64, body.namespace
    try:
        return decode_token_ids(body.token_ids), body.namespace
    except TokenDecodeError as exc:
        raise InvalidRequest(f"{where}.{exc}") from None


def checked_query(ctx: ServiceContext, body: BlendLookupRequest, tokens: Any = None) -> LookupQuery:
    """One validated lookup as the batcher's query, its token count checked (413 over the
    limit): the first step of the route, the fast path and the lookup lane (``lane.py``).
    ``tokens``: the ids already taken out of the body, in place of ``body``'s fields."""
    query = (tokens, body.namespace) if tokens is not None else query_of(body)
    ctx.check_tokens(query_tokens(query))
    return query


def placement_budget(ctx: ServiceContext) -> PlacementBudget:
    """One request's bounds on its placements (``routing.py``): a single lookup's, or a whole
    batch's, shared by its queries."""
    m = ctx.metrics
    return PlacementBudget(cap=ctx.config.max_placements_per_match, bytes_left=ctx.config.max_placement_answer_bytes,
                           omitted_cap=m.placements_omitted_cap, omitted_bytes=m.placements_omitted_bytes,
                           truncations=m.placement_truncations)


def placed(ctx: ServiceContext, body: BlendLookupRequest, query: LookupQuery, budget: PlacementBudget) -> LookupQuery:
    """``query`` answered with placements (``include_placements``, issue 26: ``routing.py``)
    within ``budget``."""
    return (*query[:2], PlacedMatches(directory=ctx.directory, registry=ctx.registry, namespace=body.namespace,
                                      requester=body.requester_instance_id, budget=budget))


async def answer_lookup(ctx: ServiceContext, body: BlendLookupRequest, tokens: Any = None) -> bytes:
    """The answer to one validated blend lookup (shared by the route and the fast path).
    ``tokens``: the query's ids already taken out of the body as uint32 (the fast path's
    ``split_token_arrays``), in place of ``body.token_ids``."""
    t0 = time.perf_counter()
    query = checked_query(ctx, body, tokens)
    try:
        if body.include_placements:
            payload = await finish(ctx, placed(ctx, body, query, placement_budget(ctx)))
        else:
            payload = await ctx.lookup(query)
    except TokenDecodeError as exc:
        raise InvalidRequest(f"body.{exc}") from None
    ctx.metrics.lookup_latency_single.observe(time.perf_counter() - t0)
    return payload


async def answer_lookup_batch(ctx: ServiceContext, body: BlendBatchLookupRequest, tokens: Any = None) -> bytes:
    """The answer to one validated batch lookup (shared by the route and the fast path).
    ``tokens``: per query, its ids already decoded (or None: decode its fields)."""
    t0 = time.perf_counter()
    queries = [(tokens[i], q.namespace) if tokens is not None and tokens[i] is not None
               else query_of(q, f"body.queries.{i}") for i, q in enumerate(body.queries)]
    ctx.check_tokens(sum(query_tokens(q) for q in queries))
    if any(q.include_placements for q in body.queries):
        budget = placement_budget(ctx)
        parts = await finish_many(ctx, [placed(ctx, q, query, budget) if q.include_placements else query
                                        for q, query in zip(body.queries, queries)])
    else:
        parts = await ctx.lookup_many(queries)
    for i, part in enumerate(parts):
        if isinstance(part, TokenDecodeError):
            raise InvalidRequest(f"body.queries.{i}.{part}")
        if isinstance(part, BaseException):
            raise part
    ctx.metrics.lookup_latency_batch.observe(time.perf_counter() - t0)
    return b'{"results":[' + b",".join(parts) + b"]}"  # type: ignore[arg-type]


@router.post("/directory/blend-lookup", response_model=BlendLookupResponse, responses=ERROR_RESPONSES)
async def blend_lookup(body: BlendLookupRequest, ctx: Ctx) -> Response:
    """Which stored chunks does this token sequence contain, and where (for this namespace)?

    Matches come in ascending ``cur_st``, at most one per position and one per chunk hash
    (LMCache's per-position rule); they may overlap
    (``blendmatch.service.client.resolve_overlaps`` picks a non-overlapping set).
    """
    return Response(await answer_lookup(ctx, body), media_type="application/json")


@router.post("/directory/blend-lookup/batch", response_model=BlendBatchLookupResponse, responses=ERROR_RESPONSES)
async def blend_lookup_batch(body: BlendBatchLookupRequest, ctx: Ctx) -> Response:
    """Many queries, each with its own namespace, in one request: ``results[i]`` answers
    ``queries[i]``. The token limit applies to the sum over all queries."""
    return Response(await answer_lookup_batch(ctx, body), media_type="application/json")
