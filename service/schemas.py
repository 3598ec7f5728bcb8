"""HTTP request and response models: the wire contract (LMCache's shapes where they exist).

Lookups (``POST /directory/blend-lookup``, LMCache-compatible; ``.../batch`` is ours):
request ``{tokens_b64 | token_ids, model_name, world_size=1, cache_salt=""}`` -> response
``{"matches": [{"chunk_hash": "<lowercase hex>", "old_st": int, "cur_st": int}]}`` in
ascending ``cur_st`` (at most one match per position and one per chunk hash: LMCache's
per-position rule; matches may overlap, see
``blendmatch.service.client.resolve_overlaps``).

Validation is strict (no coercion) but reads numbers as LMCache does: ``"2"`` is not a world
size and ``true`` is not a token id, while ``2.0`` is the integer 2 (an integral float is an
integer in JSON Schema and in LMCache's models; ``2.5`` is refused). Unknown fields are ignored (forward compatibility with newer
clients). The models check shapes and types; the token *content* is decoded by
:mod:`blendmatch.index.tokens` (``token_ids`` on the event loop, ``tokens_b64`` on the
lookup thread for a whole batch at once), and a decoding failure is a 422 whose message
names the field, like a schema error. The token-count limit (413) needs the server's
configuration and is checked by the route.

The cache-event wire model lives in :mod:`blendmatch.index.wire` (the directory owns it;
``POST /events`` hands raw bytes to it); the key model of ``/directory/lookup`` reuses its
``ObjectKeyModel``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from blendmatch.index.tokens import B64_TOKENS_PATTERN, MAX_TOKEN_ID
from blendmatch.index.wire_models import ObjectKeyModel, WholeInt
from blendmatch.index.types import whole_numbers
from blendmatch.index.tokens import TokenDecodeError, check_one_form
from blendmatch.index.types import BlendNamespace


__all__ = [
    "BlendLookupRequest",
    "BlendLookupResponse",
    "BlendMatchModel",
    "BlendBatchLookupRequest",
    "BlendBatchLookupResponse",
    "CacheEventsResponse",
    "DirectoryKeyInfo",
    "DirectoryKeyPlacements",
    "DirectoryListResponse",
    "DirectoryLookupRequest",
    "DirectoryLookupResponse",
    "DirectoryStatsResponse",
    "MAX_LOOKUP_KEYS",
    "PlacementModel",
    "HealthResponse",
    "ErrorResponse",
    "MAX_BATCH_QUERIES",
    "MAX_CANDIDATES",
    "MAX_INSTANCE_ID_LENGTH",
    "BlendQuery",
    "RouteScoreRequest",
    "RouteScoreResponse",
    "RouteScoreRow",
    "MatchPlacementModel",
]

#: Most queries one ``/directory/blend-lookup/batch`` request may carry. Each query costs a
#: future and a result object even when empty; tokens are bounded separately (413).
MAX_BATCH_QUERIES = 65_536
#: Longest ``requester_instance_id`` / candidate id taken (instance ids are short names).
MAX_INSTANCE_ID_LENGTH = 1024
#: Most candidates one ``/route/score`` request may name.
MAX_CANDIDATES = 4096
#: Most keys one ``/directory/lookup`` request may resolve.
MAX_LOOKUP_KEYS = 65_536


class BlendQuery(BaseModel):
    """A query's tokens and namespace: the fields of a blend lookup, which the routing score
    (``POST /route/score``) takes too.

    Exactly one of ``tokens_b64`` (standard base64 of little-endian uint32 ids) or
    ``token_ids`` (a JSON list of ints in 0..2^32-1). The namespace
    ``(model_name, cache_salt, world_size)`` scopes matches to chunks the caller stored.
    """

    # ``_one_token_form`` in JSON Schema: exactly one of the two forms is given (null = not given).
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"oneOf": [
        {"required": ["tokens_b64"], "properties": {"tokens_b64": {"type": "string"}, "token_ids": {"type": "null"}}},
        {"required": ["token_ids"], "properties": {"token_ids": {"type": "array"}, "tokens_b64": {"type": "null"}}},
    ]})

    # The pattern and the item bounds are documentation (the schema says what the decoder
    # accepts); the decoder in index/tokens.py stays the check, on the lookup thread.
    tokens_b64: str | None = Field(default=None, description="base64 of little-endian uint32 token ids",
                                   json_schema_extra={"pattern": B64_TOKENS_PATTERN})
    token_ids: Annotated[list[StrictInt], BeforeValidator(whole_numbers)] | None = Field(default=None, description="token ids (0..2^32-1)",
                                              json_schema_extra={"items": {"type": "integer", "minimum": 0,
                                                                           "maximum": MAX_TOKEN_ID}})
    model_name: str = Field(min_length=1, description="model the KV belongs to (required)")
    world_size: WholeInt = Field(default=1, ge=1, description="parallel world size of the requester")
    cache_salt: str = Field(default="", description="per-tenant isolation salt")

    @model_validator(mode="after")
    def _one_token_form(self) -> "BlendQuery":
        try:
            check_one_form(self.tokens_b64, self.token_ids)
        except TokenDecodeError as exc:
            raise ValueError(exc.reason) from None
        return self

    @property
    def namespace(self) -> BlendNamespace:
        return BlendNamespace(self.model_name, self.cache_salt, self.world_size)


class BlendLookupRequest(BlendQuery):
    """Body of ``POST /directory/blend-lookup`` (and one query of the batch endpoint): a
    :class:`BlendQuery`, and ours, opt-in: ``include_placements`` (absent or false, the
    answer is LMCache's, byte for byte)."""

    include_placements: bool = Field(default=False, description=(
        "ours: give each match its usable copies, ranked (the requester's own L1, other live "
        "instances' L1, shared pools, live instances' L2); copies of instances that are not live in "
        "the registry are left out, and a match with none is dropped (counted in "
        "dropped_without_live_holder)"))
    requester_instance_id: str | None = Field(default=None, max_length=MAX_INSTANCE_ID_LENGTH, description=(
        "ours: the instance asking (its own L1 copies rank first); with include_placements"))


class RouteScoreRequest(BlendQuery):
    """Body of ``POST /route/score``: a :class:`BlendQuery` and optionally the instances to
    score (default: every live instance in the registry)."""

    candidates: Annotated[list[Annotated[str, Field(max_length=MAX_INSTANCE_ID_LENGTH)]],
                          Field(max_length=MAX_CANDIDATES)] | None = Field(
        default=None, description="instance ids to score, one row each (duplicates once)")


class RouteScoreRow(BaseModel):
    """One instance: ``prefix_tokens`` (leading chunks it holds in L1 under the request's
    prefix-chained hashes), ``fragment_tokens`` (tokens after that prefix covered by
    non-overlapping matches it holds in L1), ``reusable_tokens`` (their sum)."""

    instance_id: str
    prefix_tokens: int
    fragment_tokens: int
    reusable_tokens: int


class RouteScoreResponse(BaseModel):
    """``shared_tokens``: covered by non-overlapping matches in a shared pool (any instance
    can fetch them); ``instances``: sorted by ``reusable_tokens`` descending, then id."""

    shared_tokens: int
    instances: list[RouteScoreRow]


class MatchPlacementModel(BaseModel):
    """One usable copy of a matched chunk (``include_placements``): a shared pool's copy has
    ``instance_id ""``."""

    instance_id: str
    tier: str
    backend: str


class BlendMatchModel(BaseModel):
    """One match: ``chunk_hash`` (lowercase hex), ``old_st`` (stored position, the re-RoPE
    source) and ``cur_st`` (position in the query, the re-RoPE target)."""

    chunk_hash: str
    old_st: int
    cur_st: int
    placements: list[MatchPlacementModel] | None = Field(default=None, description=(
        "ours, only with include_placements: usable copies, best first, at most --max-placements-per-match "
        "(none once the answer's placements reached --max-placement-answer-bytes)"))
    placements_omitted: int | None = Field(default=None, description=(
        "ours, only with include_placements: usable copies of this match left out of placements (past the cap "
        "or the byte bound)"))


class BlendLookupResponse(BaseModel):
    """Matches in ascending ``cur_st``, at most one per position and one per chunk hash
    (LMCache's per-position rule); they may overlap. With ``include_placements`` each match
    has ``placements`` and ``placements_omitted``, and the answer ``dropped_without_live_holder`` and
    ``placements_truncated``."""

    matches: list[BlendMatchModel] = Field(default_factory=list)
    dropped_without_live_holder: int | None = Field(default=None, description=(
        "ours, only with include_placements: matches left out because no live instance or shared "
        "pool holds their chunk"))
    placements_truncated: bool | None = Field(default=None, description=(
        "ours, only with include_placements: the request's placements reached --max-placement-answer-bytes at "
        "or before this answer, so some matches list none"))


class BlendBatchLookupRequest(BaseModel):
    """Body of ``POST /directory/blend-lookup/batch``: many queries, each with its own
    namespace. Answered as one result per query, in order."""

    model_config = ConfigDict(strict=True, extra="ignore")

    queries: Annotated[list[BlendLookupRequest], Field(max_length=MAX_BATCH_QUERIES)]


class BlendBatchLookupResponse(BaseModel):
    """``results[i]`` answers ``queries[i]``."""

    results: list[BlendLookupResponse]


class CacheEventsResponse(BaseModel):
    """``POST /events``: batches applied, dropped as replays, dropped as stale incarnations
    (LMCache's three fields), plus ours: entries of applied batches, and applied STORE
    entries that fed nothing to the blend index, by reason (``tokens_outside_uint32``,
    ``wrong_length``, ``world_size_0``, ``token_offset_unknown``; absent reasons omitted)."""

    applied: int = 0
    duplicates: int = 0
    stale: int = 0
    entries_applied: int = 0
    entries_not_indexable: dict[str, int] = Field(default_factory=dict)


class PlacementModel(BaseModel):
    """One copy of a key. A shared-pool placement has ``instance_id ""`` and ``shared``."""

    instance_id: str
    incarnation: int
    tier: str
    backend: str
    size_bytes: int
    shared: bool = False


class DirectoryLookupRequest(BaseModel):
    """Body of ``POST /directory/lookup`` (LMCache's shape): exactly one of ``keys`` (resolve
    these keys to placements) or ``token_ids`` (with ``model_name``; LMCache's tokens form).

    Validation is LMCache's: both forms or neither is a 422 (an empty list counts as
    absent); ``token_ids`` without ``model_name`` is a 422; ``world_size < 1`` is a 422.
    The route answers more than 1,000,000 token ids with a 400; it hashes the tokens
    form's full chunks with the fleet's ``--hash-algorithm`` into keys.
    """

    # The one-form rule in the schema too (schemathesis checks the schema against the
    # validator): an empty list counts as absent; the tokens form needs a model name.
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"anyOf": [
        {"required": ["keys"], "properties": {"keys": {"type": "array", "minItems": 1}},
         "not": {"required": ["token_ids"], "properties": {"token_ids": {"type": "array", "minItems": 1}}}},
        {"required": ["token_ids", "model_name"],
         "properties": {"token_ids": {"type": "array", "minItems": 1}, "model_name": {"type": "string", "minLength": 1}},
         "not": {"required": ["keys"], "properties": {"keys": {"type": "array", "minItems": 1}}}},
    ]})

    keys: Annotated[list[ObjectKeyModel], Field(default_factory=list, max_length=MAX_LOOKUP_KEYS)]
    token_ids: Annotated[list[StrictInt], BeforeValidator(whole_numbers)] = Field(default_factory=list)
    model_name: str = ""
    world_size: WholeInt = Field(default=1, ge=1)
    cache_salt: str = ""

    @model_validator(mode="after")
    def _one_form(self) -> "DirectoryLookupRequest":
        if bool(self.keys) == bool(self.token_ids):
            raise ValueError("supply exactly one of 'keys' or 'token_ids'")
        if self.token_ids and not self.model_name:
            raise ValueError("'model_name' is required with 'token_ids'")
        return self


class DirectoryKeyPlacements(BaseModel):
    """One resolved key: its placements (empty when unknown), its chunk's token ids
    (empty when unknown) and its access count (LMCache's: the ``ACCESS`` entries applied to
    the key since it was created; 0 when unknown)."""

    key: ObjectKeyModel
    placements: list[PlacementModel] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    access_count: int = 0


class DirectoryLookupResponse(BaseModel):
    """``chunks``: keys asked for; ``results``: one per key, in request order."""

    chunks: int = 0
    results: list[DirectoryKeyPlacements] = Field(default_factory=list)


class DirectoryKeyInfo(BaseModel):
    """One listed key with its placements that matched the filters, the token ids known for
    its chunk and its access count (as in :class:`DirectoryKeyPlacements`)."""

    key: ObjectKeyModel
    placements: list[PlacementModel] = Field(default_factory=list)
    num_tokens: int = 0
    access_count: int = 0


class DirectoryListResponse(BaseModel):
    """``GET /directory/keys``: ``total`` keys match the filters; ``keys`` is the page
    ``[offset, offset + limit)`` in first-stored order; ``next_offset`` is null on the last page."""

    total: int = 0
    keys: list[DirectoryKeyInfo] = Field(default_factory=list)
    offset: int = 0
    limit: int = 0
    next_offset: int | None = None


class DirectoryStatsResponse(BaseModel):
    """``GET /directory/stats``: LMCache 0.5.6's ``DirectoryStats`` at the top level (same
    names and meaning, nothing else there: LMCache's tests assert what is absent), and ours
    under ``blendmatch``: the directory's counts (``keys``, ``chunk_hashes``, ``placements``,
    ``token_bindings``, ``l1_keys_per_instance``, ``instances`` (each emitter's
    ``incarnation`` and ``last_seq``), ``events``, ``capacity``, ``blend_lookup_enabled``),
    ``blend`` (the blend index's full stats; empty when blend lookup is disabled),
    ``chunk_size``, ``registry``, ``log`` (Kafka mode), ``engine`` (the probe engine in use
    and why) and ``batcher`` (micro-batcher totals)."""

    num_keys: int
    num_placements: int
    l1_keys_by_instance: dict[str, int]
    blend: dict[str, int] = Field(description="LMCache's BlendIndexStats: num_contents, num_chunks, num_claims, "
                                              "num_namespaces, table_size (zeros while blend lookup is off)")
    l1_count: int
    l1_size_bytes: int
    l2_count: int
    l2_size_bytes: int
    blendmatch: dict[str, Any] = Field(description="ours (see docs/service.md)")


class HealthResponse(BaseModel):
    status: str = "healthy"


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body. ``errors`` (schema errors only) lists ``{loc, msg, type}``."""

    detail: str
    errors: list[dict[str, Any]] | None = None
