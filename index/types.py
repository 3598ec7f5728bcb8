"""The vocabulary shared by the index, the directory and the service.

Why a module of its own: the namespace rule (who may see which chunk) and the kv_rank
packing are fleet-wide conventions. They are defined once here and every other module
calls them, so that the store side (keys in cache events) and the query side (lookup
requests) can never disagree on what a namespace is.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, NamedTuple

__all__ = [
    "UNKNOWN_TOKEN_OFFSET",
    "DEFAULT_CHUNK_SIZE",
    "BlendNamespace",
    "BlendMatch",
    "ObjectKey",
    "pack_kv_rank",
    "unpack_kv_rank",
    "world_size_of_kv_rank",
    "check_chunk_hash",
    "check_namespace",
    "check_token_offset",
    "whole_number",
    "whole_numbers",
]

#: ``token_offset`` of a chunk whose position in its stored sequence is not known. Such a
#: chunk is never offered as a match: a wrong ``old_st`` gives wrong KV after re-RoPE.
UNKNOWN_TOKEN_OFFSET = -1

#: LMCache's default chunk size in tokens.
DEFAULT_CHUNK_SIZE = 256


class BlendNamespace(NamedTuple):
    """Who may reuse a chunk: ``(model_name, cache_salt, world_size)``.

    A match is offered only to a requester whose namespace claims the chunk; never across
    namespaces. A NamedTuple: hashable, cheap, and equal by value, so the index can intern
    it. ``world_size`` comes from the key's ``kv_rank`` on the store side
    (:func:`world_size_of_kv_rank`) and from the request on the query side.
    """

    model_name: str
    cache_salt: str = ""
    world_size: int = 1

    @classmethod
    def from_object_key(cls, key: "ObjectKey") -> "BlendNamespace":
        """The namespace a stored key claims for."""
        return cls(key.model_name, key.cache_salt, world_size_of_kv_rank(key.kv_rank))


class BlendMatch(NamedTuple):
    """One reusable chunk found in a query.

    ``old_st``: the token offset the chunk had in the sequence it was stored under (the
    re-RoPE source). ``cur_st``: where its content starts in the query (the re-RoPE target).
    """

    chunk_hash: bytes
    old_st: int
    cur_st: int


def pack_kv_rank(world_size: int, global_rank: int = 0, local_world_size: int = 1, local_rank: int = 0) -> int:
    """LMCache's kv_rank packing: ``(ws<<24)|(global_rank<<16)|(local_ws<<8)|local_rank``.

    Every field is one byte; a value outside 0..255 is a caller bug, so it raises.
    """
    for name, value in (
        ("world_size", world_size),
        ("global_rank", global_rank),
        ("local_world_size", local_world_size),
        ("local_rank", local_rank),
    ):
        if not 0 <= value <= 0xFF:
            raise ValueError(f"{name} must be in 0..255, got {value!r}")
    return (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank


def unpack_kv_rank(kv_rank: int) -> tuple[int, int, int, int]:
    """Inverse of :func:`pack_kv_rank`: ``(world_size, global_rank, local_world_size, local_rank)``."""
    return (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF, (kv_rank >> 8) & 0xFF, kv_rank & 0xFF


def world_size_of_kv_rank(kv_rank: int) -> int:
    """The world size a key's ``kv_rank`` encodes: ``(kv_rank >> 24) & 0xFF``."""
    return (kv_rank >> 24) & 0xFF


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """The key LMCache names a stored object by.

    ``chunk_hash`` is opaque bytes (prefix-chained by the servers). Several keys (one per
    rank / object group) may share one chunk hash; they all bind to the same content.
    """

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""

    @property
    def world_size(self) -> int:
        return world_size_of_kv_rank(self.kv_rank)

    @property
    def namespace(self) -> BlendNamespace:
        return BlendNamespace.from_object_key(self)


def check_chunk_hash(chunk_hash: Any) -> None:
    """A chunk hash is bytes (the index's argument rule)."""
    if not isinstance(chunk_hash, bytes):
        raise ValueError(f"chunk_hash must be bytes, got {type(chunk_hash).__name__}")


def check_token_offset(token_offset: Any) -> int:
    """A ``token_offset`` is an integer >= -1 (:data:`UNKNOWN_TOKEN_OFFSET`)."""
    if isinstance(token_offset, bool) or not isinstance(token_offset, Integral):
        raise ValueError(f"token_offset must be an integer, got {token_offset!r}")
    if token_offset < UNKNOWN_TOKEN_OFFSET:
        raise ValueError(f"token_offset must be >= -1, got {token_offset}")
    return int(token_offset)


def check_namespace(ns: Any) -> None:
    """A namespace argument is a :class:`BlendNamespace`."""
    if not isinstance(ns, BlendNamespace):
        raise ValueError(f"namespace must be a BlendNamespace, got {type(ns).__name__}")


#: pydantic's bounds for a float read as an integer (exclusive): the int64 range as floats.
_FLOAT_INT_LOW, _FLOAT_INT_HIGH = -(2.0**63), 2.0**63


def whole_number(value: Any) -> Any:
    """An integer field's value as LMCache reads it: a JSON float with no fractional part
    (``870926.0``, ``1e3``, ``-0.0``) is that integer, as JSON Schema and LMCache's lax
    pydantic models say; anything else is returned unchanged for the caller's own check
    (a fractional float, ``inf``, a string and a boolean stay what they are and are
    refused there: JSON Schema calls neither ``"5"`` nor ``true`` an integer, though
    LMCache's pydantic would take them; docs/lmcache.md).

    Only floats strictly inside the 64-bit signed range convert, as in pydantic (which
    answers ``1e30`` "exceeded maximum size" even where an integer literal of any size would
    do): a float that large has lost its low digits, so it names no exact integer."""
    if type(value) is float and value.is_integer() and _FLOAT_INT_LOW < value < _FLOAT_INT_HIGH:
        return int(value)
    return value


def whole_numbers(values: Any) -> Any:
    """:func:`whole_number` over a list's items; the list itself (no copy, one C-speed pass)
    when it holds no float."""
    if type(values) is list and float in set(map(type, values)):
        return [whole_number(v) for v in values]
    return values
