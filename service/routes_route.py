"""The routing score: ``POST /route/score`` (ours; docs/routing.md).

Thin: the body is a blend lookup's (``BlendQuery``) plus ``candidates``; the token limit
is the lookups' (413); the query goes through the micro-batcher with the score's finisher
(``routing.ScoreRequest``), so it shares the lookup thread's batches and one engine probe.
The score itself is a pure function (``index/route_score.py``). Role: ``reader`` (it
answers counts of tokens per instance, no chunk hashes, no token ids).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Response

from blendmatch.index.tokens import TokenDecodeError

from .context import Ctx, ServiceContext, query_tokens
from .errors import InvalidRequest
from .routes_lookup import ERROR_RESPONSES, query_of
from .routing import ScoreRequest, finish
from .schemas import RouteScoreRequest, RouteScoreResponse

__all__ = ["router", "answer_score"]

router = APIRouter(tags=["routing"])


async def answer_score(ctx: ServiceContext, body: RouteScoreRequest, tokens: Any = None) -> bytes:
    """The answer to one validated score request (``tokens``: its ids already taken out of
    the body as uint32, as the lookups' fast path does)."""
    t0 = time.perf_counter()
    query = (tokens, body.namespace) if tokens is not None else query_of(body)  # type: ignore[arg-type]
    ctx.check_tokens(query_tokens(query))
    scorer = ScoreRequest(directory=ctx.directory, registry=ctx.registry, namespace=body.namespace,
                          hasher=ctx.token_hasher, candidates=body.candidates)
    try:
        payload = await finish(ctx, (*query, scorer))
    except TokenDecodeError as exc:
        raise InvalidRequest(f"body.{exc}") from None
    ctx.metrics.lookup_latency.labels("route_score").observe(time.perf_counter() - t0)
    return payload


@router.post("/route/score", response_model=RouteScoreResponse, responses=ERROR_RESPONSES)
async def route_score(body: RouteScoreRequest, ctx: Ctx) -> Response:
    """Which instance should serve this request? Per candidate instance (default: every live
    instance in the registry): ``prefix_tokens`` it holds in L1 under the request's
    prefix-chained hashes, ``fragment_tokens`` after that prefix covered by non-overlapping
    blend matches it holds in L1, ``reusable_tokens`` (their sum); and ``shared_tokens``,
    covered by matches in a shared pool. Sorted by ``reusable_tokens`` descending, then id."""
    return Response(await answer_score(ctx, body), media_type="application/json")
