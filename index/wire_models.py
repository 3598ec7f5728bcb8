"""LMCache's ``POST /events`` body as pydantic models (the OpenAPI schema), and wire builders.

The models describe exactly the shape the fast parser in ``wire.py`` accepts; they are not
used on the ingest path (validating 256 token ids per entry with pydantic costs more than
the whole ingest budget). A test checks that both accept and reject the same payloads.
:func:`wire_entry` / :func:`wire_batch` build bodies in wire (JSON) form for producers,
tests and benchmarks.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterable, Literal, Optional, Sequence

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from .tokens import B64_TOKENS_PATTERN, TokenDecodeError, decode_b64
from .types import UNKNOWN_TOKEN_OFFSET, whole_number, whole_numbers
from .wire import INT64_MAX, KV_RANK_MAX, MAX_CACHE_SALT_CHARS, MAX_CHUNK_HASH_BYTES

__all__ = [
    "EventBatchModel",
    "EventEntryModel",
    "EventRequestModel",
    "EventType",
    "ObjectKeyModel",
    "Tier",
    "wire_batch",
    "wire_entry",
]

EventType = Literal["store", "delete", "access", "config"]
Tier = Literal["l1", "l2"]


def wire_entry(chunk_hash: bytes | str, model_name: str, kv_rank: int = 1 << 24, *,
               object_group_id: int = 0, cache_salt: str = "", size_bytes: int = 0,
               token_ids: Optional[Iterable[int]] = None,
               token_offset: int = UNKNOWN_TOKEN_OFFSET) -> dict[str, Any]:
    """One entry in wire (JSON) form, for producers, tests and benchmarks.

    ``chunk_hash`` may be bytes (hex-encoded here) or a hex string; ``kv_rank`` defaults to
    world size 1, rank 0.
    """
    hex_hash = chunk_hash.hex() if isinstance(chunk_hash, (bytes, bytearray)) else chunk_hash
    entry: dict[str, Any] = {
        "key": {"chunk_hash_hex": hex_hash, "model_name": model_name, "kv_rank": kv_rank,
                "object_group_id": object_group_id, "cache_salt": cache_salt},
        "size_bytes": size_bytes,
        "token_offset": token_offset,
    }
    if token_ids is not None:
        entry["token_ids"] = [int(t) for t in token_ids] if not isinstance(token_ids, list) else token_ids
    return entry


def wire_batch(instance_id: str, seq: int, event_type: str = "store", entries: Sequence[dict] = (), *,
               incarnation: int = 0, tier: str = "l1", backend: str = "LocalCPUBackend",
               shared: bool = False, ts: float = 0.0, **extra: Any) -> dict[str, Any]:
    """One batch in wire (JSON) form; ``extra`` adds fields (``capacity_bytes`` ...)."""
    batch: dict[str, Any] = {
        "instance_id": instance_id, "incarnation": incarnation, "seq": seq,
        "event_type": event_type, "tier": tier, "backend": backend, "shared": shared,
        "ts": ts, "entries": list(entries),
    }
    batch.update(extra)
    return batch


#: An integer field as LMCache reads it (:func:`~blendmatch.index.types.whole_number`): an
#: integral float is that integer; strings, booleans and fractional floats are refused.
WholeInt = Annotated[int, BeforeValidator(whole_number)]
#: ``token_ids`` of an entry: integers (bool accepted as 0/1, as the fast parser does:
#: ``array('I').fromlist`` takes bools, and refusing them would cost a per-token type check on
#: the ingest hot path, ~4x its cost), integral floats read as integers.
WholeInts = Annotated[list[int | bool], BeforeValidator(whole_numbers)]

# The same wire shape as pydantic v2 models: for the OpenAPI schema and as an executable
# specification (tests check the fast validator above agrees with them). Not used on the
# ingest path: validating 256 token ids per entry here costs more than the whole ingest.


class ObjectKeyModel(BaseModel):
    """``key`` of an entry."""

    model_config = ConfigDict(strict=True, extra="ignore")

    chunk_hash_hex: str = Field(min_length=2, max_length=2 * MAX_CHUNK_HASH_BYTES,
                                pattern=r"^(?:[0-9a-fA-F]{2})+$")
    model_name: str = Field(min_length=1, pattern=r"^[^@]+$")
    kv_rank: WholeInt = Field(ge=0, le=KV_RANK_MAX)
    object_group_id: WholeInt = Field(default=0, ge=0, le=INT64_MAX)
    cache_salt: str = Field(default="", max_length=MAX_CACHE_SALT_CHARS, pattern=r"^[^@/\\\x00]*$")


class EventEntryModel(BaseModel):
    """One entry; ids outside uint32 in ``token_ids`` are accepted (they fill no binding)."""

    # ``_one_token_form`` in JSON Schema (schemathesis checks that schema-valid bodies are
    # accepted): not both a non-empty token_ids and a non-empty tokens_b64.
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"not": {
        "required": ["token_ids", "tokens_b64"],
        "properties": {"token_ids": {"type": "array", "minItems": 1},
                       "tokens_b64": {"type": "string", "minLength": 1}}}})

    key: ObjectKeyModel
    size_bytes: WholeInt = Field(default=0, ge=0, le=INT64_MAX,
                            description="bytes of the stored copy; meaningful on store only (ignored on "
                                        "delete and access, where LMCache sends 0)")
    token_ids: WholeInts = Field(default_factory=list)
    tokens_b64: Optional[str] = Field(
        default=None, pattern=B64_TOKENS_PATTERN,
        description="blendmatch extension (not LMCache's): the entry's token ids as standard base64 "
                    "(alphabet A-Z a-z 0-9 + /, '=' padding; decoded strictly, as Python's "
                    "base64.b64decode(s, validate=True)) of little-endian uint32, instead of token_ids; "
                    "the decoded length must be a multiple of 4 bytes. \"\" or null: no tokens. An entry "
                    "may not give both token_ids and tokens_b64 non-empty. Much cheaper to decode "
                    "from JSON than the same ids as a list.")
    token_offset: WholeInt = Field(default=UNKNOWN_TOKEN_OFFSET, ge=UNKNOWN_TOKEN_OFFSET, le=INT64_MAX)

    @field_validator("tokens_b64")
    @classmethod
    def _strict_base64(cls, value: Optional[str]) -> Optional[str]:
        if value:
            try:
                decode_b64(value)
            except TokenDecodeError as bad:
                raise ValueError(bad.reason) from None
        return value

    @model_validator(mode="after")
    def _one_token_form(self) -> "EventEntryModel":
        if self.tokens_b64 and self.token_ids:
            raise ValueError("give token_ids or tokens_b64, not both")
        return self


#: ``_cross_field_rules`` below, said in JSON Schema, so that the published schema accepts
#: exactly what the validator accepts (schemathesis checks that schema-valid bodies are
#: accepted). Change both together.
_BATCH_CROSS_FIELD_SCHEMA: dict[str, Any] = {"allOf": [
    {"if": {"properties": {"event_type": {"const": "access"}}},
     "else": {"required": ["backend"], "properties": {"backend": {"minLength": 1}}}},
    {"if": {"properties": {"event_type": {"const": "config"}}},
     "then": {"properties": {"entries": {"maxItems": 0}}}},
]}


class EventBatchModel(BaseModel):
    """One batch from one instance."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_BATCH_CROSS_FIELD_SCHEMA)

    instance_id: str = Field(min_length=1)
    incarnation: WholeInt = Field(ge=0, le=INT64_MAX)
    seq: WholeInt = Field(ge=1, le=INT64_MAX)
    event_type: EventType
    tier: Tier
    backend: str = ""
    shared: bool = False
    ts: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    capacity_bytes: WholeInt = Field(
        default=0, ge=0, le=INT64_MAX,
        description="accepted on every batch (LMCache's serializer always sends it); meaningful on "
                    "config batches only: the compartment's declared capacity (0: no limit declared)")
    capacity_revision: WholeInt = Field(
        default=0, ge=0, le=INT64_MAX,
        description="accepted on every batch; on config batches, which declaration this belongs to: "
                    "a newer (incarnation, capacity_revision) replaces the instance's declaration, an "
                    "equal one extends it, an older one is dropped")
    entries: list[EventEntryModel] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "EventBatchModel":
        if not self.backend and self.event_type != "access":
            raise ValueError(f"backend must not be empty for {self.event_type} events")
        if self.event_type == "config" and self.entries:
            raise ValueError("config batches carry no entries")
        return self


class EventRequestModel(BaseModel):
    """``POST /events`` body."""

    model_config = ConfigDict(strict=True, extra="ignore")

    batches: list[EventBatchModel]
