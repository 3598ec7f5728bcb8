"""Directory reads: ``POST /directory/lookup`` (keys form), ``GET /directory/keys``,
``GET /directory/stats``. Each takes the directory's lock, so each runs off the event loop
(``ctx.read``)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query

from blendmatch.index.key_directory import KeyDirectory, Placement
from blendmatch.index.types import ObjectKey

from blendmatch.index.token_hasher import TokenHasher
from blendmatch.index.tokens import DEFAULT_MAX_REQUEST_TOKENS, TokenLimitExceeded, check_token_count

from .context import Ctx
from .errors import RequestRejected
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
    counts = directory.access_counts(keys)
    return {"chunks": len(keys), "results": [
        {"key": _key_wire(k), "placements": [_placement_wire(p) for p in pls],
         "token_ids": [] if t is None else t.tolist(), "access_count": c}
        for k, pls, t, c in zip(keys, placements, tokens, counts, strict=True)]}


def _list(directory: KeyDirectory, tier: str | None, instance_id: str | None, backend: str | None,
          offset: int, limit: int) -> dict[str, Any]:
    total, page = directory.key_page(tier, instance_id, backend, offset, limit)
    tokens = directory.get_token_ids([kp.key.chunk_hash for kp in page])
    counts = directory.access_counts([kp.key for kp in page])
    nxt = offset + len(page)
    return {"total": total, "offset": offset, "limit": limit,
            "next_offset": nxt if nxt < total else None,
            "keys": [{"key": _key_wire(kp.key), "placements": [_placement_wire(p) for p in kp.placements],
                      "num_tokens": 0 if t is None else int(t.shape[0]), "access_count": c}
                     for kp, t, c in zip(page, tokens, counts, strict=True)]}


#: Most keys the token form may resolve to (chunks x world size): 1,000,000 tokens at world
#: size 64 fit; a body asking for more (a huge ``world_size``) is a 400, not minutes of work.
MAX_TOKEN_FORM_KEYS = 1 << 18
#: LMCache's rules for the salt of a token-form request (its IPC key's): at most 128
#: characters, none of ``@ / \\ NUL``.
_SALT_FORBIDDEN = frozenset("@/\\\x00")
_SALT_MAX_CHARS = 128

_TOKEN_FORM_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "token form: more than 1,000,000 token ids, a bad cache_salt or model_name (LMCache's "
                         "key rules), a token id the hash cannot take, or more than 262,144 resolved keys"},
}


def _token_form_reason(body: DirectoryLookupRequest, hasher: TokenHasher) -> tuple[list[bytes], str | None]:
    """The chunk hashes of the body's tokens, or why the body is a 400 (LMCache's checks,
    in its order: the token cap, the salt, the hashing, then the key fields)."""
    try:
        check_token_count(len(body.token_ids), DEFAULT_MAX_REQUEST_TOKENS, "token_ids")
    except TokenLimitExceeded as exc:
        return [], str(exc)
    bad = _SALT_FORBIDDEN & set(body.cache_salt)
    if bad:
        return [], f"cache_salt must not contain {sorted(bad)!r} (got {body.cache_salt!r})"
    if len(body.cache_salt) > _SALT_MAX_CHARS:
        return [], f"cache_salt exceeds max length {_SALT_MAX_CHARS} (got {len(body.cache_salt)})"
    try:
        hashes = hasher.chunk_hashes(body.token_ids)
    except ValueError as exc:
        return [], f"token_ids: {exc}"
    if hashes and "@" in body.model_name:
        return [], f"model_name must not contain '@' (got {body.model_name!r})"
    if len(hashes) * body.world_size > MAX_TOKEN_FORM_KEYS:
        return [], (f"token_ids resolve to {len(hashes)} chunks x world_size {body.world_size} keys, more than "
                    f"{MAX_TOKEN_FORM_KEYS}")
    return hashes, None


def _resolve_tokens(directory: KeyDirectory, hasher: TokenHasher, body: DirectoryLookupRequest) -> dict[str, Any]:
    """LMCache's token form: each full chunk's hash, fanned out to one key per rank of the
    world size in object group 0 (its lookup fan-out), each followed by the stored keys that
    differ from it only in object group, then looked up like the keys form. Raises
    :class:`RequestRejected` (400) where LMCache answers 400."""
    hashes, reason = _token_form_reason(body, hasher)
    if reason is not None:
        raise RequestRejected(reason)
    if not hashes:
        return {"chunks": 0, "results": []}
    ws = body.world_size
    # LMCache's ComputeKVRank(ws, rank, ws, rank), unchecked there (a world size over 255
    # spills into the higher fields); a stored key's kv_rank never does
    ranks = [(ws << 24) | (r << 16) | (ws << 8) | r for r in range(ws)]
    keys = [ObjectKey(h, body.model_name, rank, 0, body.cache_salt) for h in hashes for rank in ranks]
    out = _lookup(directory, directory.keys_across_object_groups(keys))
    out["chunks"] = len(hashes)
    return out


@router.post("/directory/lookup", response_model=DirectoryLookupResponse,
             responses={**ERROR_RESPONSES, **_TOKEN_FORM_RESPONSES})
async def lookup_keys(body: DirectoryLookupRequest, ctx: Ctx) -> Any:
    """Placements and token ids of each key, in request order: LMCache's keys form, or its
    tokens form (``token_ids`` from position 0, with ``model_name``, ``world_size``,
    ``cache_salt``), whose full chunks are hashed with the fleet's ``--hash-algorithm`` into
    the keys the servers stored them under (a sequence shorter than a chunk resolves none)."""
    ctx.check_serving()
    if body.token_ids:  # hashing a long sequence is work: off the event loop, like the reads
        return await ctx.read(_resolve_tokens, ctx.directory, ctx.token_hasher, body)
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
