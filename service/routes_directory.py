"""Directory reads: ``POST /directory/lookup`` (keys form), ``GET /directory/keys``,
``GET /directory/stats``. Each takes the directory's lock, so each runs off the event loop
(``ctx.read``)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response

from blendmatch.index.key_directory import KeyDirectory, Placement
from blendmatch.index.types import ObjectKey

from blendmatch.index.tokens import DEFAULT_MAX_REQUEST_TOKENS, TokenLimitExceeded, check_token_count

from .context import Ctx
from .errors import NotSupported, RequestRejected
from .routes_lookup import ERROR_RESPONSES
from .schemas import DirectoryListResponse, DirectoryLookupRequest, DirectoryLookupResponse, DirectoryStatsResponse

__all__ = ["router"]

router = APIRouter(tags=["directory"])


def _key_wire(key: ObjectKey) -> dict[str, Any]:
    return {"chunk_hash_hex": key.chunk_hash.hex(), "model_name": key.model_name, "kv_rank": key.kv_rank,
            "object_group_id": key.object_group_id, "cache_salt": key.cache_salt}


def _placement_wire(p: Placement) -> dict[str, Any]:
    return {"instance_id": p.instance_id, "incarnation": p.incarnation, "tier": p.tier, "backend": p.backend,
            "size_bytes": p.size_bytes, "shared": p.shared}


def _lookup(directory: KeyDirectory, keys: list[ObjectKey]) -> dict[str, Any]:
    placements = directory.lookup(keys)
    tokens = directory.get_token_ids([k.chunk_hash for k in keys])
    return {"chunks": len(keys), "results": [
        {"key": _key_wire(k), "placements": [_placement_wire(p) for p in pls],
         "token_ids": [] if t is None else t.tolist()}
        for k, pls, t in zip(keys, placements, tokens, strict=True)]}


def _list(directory: KeyDirectory, tier: str | None, instance_id: str | None, backend: str | None,
          offset: int, limit: int) -> dict[str, Any]:
    total, page = directory.key_page(tier, instance_id, backend, offset, limit)
    tokens = directory.get_token_ids([kp.key.chunk_hash for kp in page])
    nxt = offset + len(page)
    return {"total": total, "offset": offset, "limit": limit,
            "next_offset": nxt if nxt < total else None,
            "keys": [{"key": _key_wire(kp.key), "placements": [_placement_wire(p) for p in kp.placements],
                      "num_tokens": 0 if t is None else int(t.shape[0])}
                     for kp, t in zip(page, tokens, strict=True)]}


_TOKEN_FORM_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "more than 1,000,000 token ids"},
    501: {"description": "token form without --upstream-coordinator (needs the fleet's token hasher)"},
    502: {"description": "token form, proxied: the upstream coordinator is unreachable"},
    504: {"description": "token form, proxied: the upstream coordinator did not answer in time"},
}


@router.post("/directory/lookup", response_model=DirectoryLookupResponse,
             responses={**ERROR_RESPONSES, **_TOKEN_FORM_RESPONSES})
async def lookup_keys(body: DirectoryLookupRequest, ctx: Ctx, request: Request) -> Any:
    """Placements and token ids of each key, in request order (LMCache's keys form).

    The tokens form is validated as LMCache validates it (more than 1,000,000 token ids:
    400) and then proxied to the upstream coordinator when there is one
    (``--upstream-coordinator``), else answered 501: resolving tokens to keys needs the
    fleet's token hasher."""
    if body.token_ids:
        try:
            check_token_count(len(body.token_ids), DEFAULT_MAX_REQUEST_TOKENS, "token_ids")
        except TokenLimitExceeded as exc:
            raise RequestRejected(str(exc)) from None
        if ctx.upstream is not None:
            proxied: Response = await ctx.upstream.proxy("POST", "/directory/lookup", b"", await request.body(),
                                                         request.headers)
            return proxied
        raise NotSupported("the token_ids form of /directory/lookup needs the fleet's token hasher, which "
                           "blendmatch does not have; send 'keys', use /directory/blend-lookup, or run with "
                           "--upstream-coordinator")
    ctx.check_serving()
    keys = [ObjectKey(bytes.fromhex(k.chunk_hash_hex), k.model_name, k.kv_rank, k.object_group_id, k.cache_salt)
            for k in body.keys]
    return await ctx.read(_lookup, ctx.directory, keys)


@router.get("/directory/keys", response_model=DirectoryListResponse, responses={422: ERROR_RESPONSES[422]})
async def list_keys(
    ctx: Ctx,
    tier: Literal["all", "l1", "l2"] = "all",
    instance_id: str = Query(default="", description="only placements of this instance (empty: all)"),
    backend: str = Query(default="", description="only placements on this backend (empty: all)"),
    offset: int = Query(default=0, ge=0),
    limit: int = Query(default=1000, ge=1, le=10_000),
) -> dict[str, Any]:
    """Keys whose placements match the filters, one page at a time, in first-stored order.

    A snapshot for inspection: pages of a changing directory may skip or repeat keys.
    ``total`` counts every matching key (a full scan, as in LMCache).
    """
    return await ctx.read(_list, ctx.directory, None if tier == "all" else tier, instance_id or None,
                          backend or None, offset, limit)


@router.get("/directory/stats", response_model=DirectoryStatsResponse)
async def directory_stats(ctx: Ctx) -> dict[str, Any]:
    """Directory counts, the blend index's stats (``blend``), the engine in use, batcher totals."""
    return await ctx.read(ctx.stats)
