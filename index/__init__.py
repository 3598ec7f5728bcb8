"""The middle room: the host truth, derived from the cache-event stream.

Tokens (``tokens``), keys and namespaces (``types``), the slot array (``slots``) and
storage, the blend index (``blend_index``), LMCache's event body (``wire``,
``wire_models``), the ingest gate (``gate``), the key directory (``key_directory``, a facade over
``bindings``, ``ingest``, ``indexable`` and ``capacity``).
Imports ``blendmatch.gpu`` (public names only) and nothing above it.

Names are loaded on first use (PEP 562), so ``import blendmatch.index.types`` or
``blendmatch.index.tokens`` (what the client needs) loads neither numba nor pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blendmatch.lazy import lazy_exports

#: Public name -> the module (in this package) that defines it. One home per name.
_EXPORTS: dict[str, str] = {
    "ApplyCounts": "ingest",
    "BlendIndex": "blend_index",
    "BlendLookupDisabled": "key_directory",
    "BlendMatch": "types",
    "BlendNamespace": "types",
    "DEFAULT_CHUNK_SIZE": "types",
    "EventBatch": "wire",
    "EventRequest": "wire",
    "EventRequestModel": "wire_models",
    "EventValidationError": "wire",
    "FenceResult": "bindings",
    "IngestGate": "gate",
    "KeyDirectory": "key_directory",
    "KeyPlacements": "placements",
    "MatchStats": "blend_index",
    "ObjectKey": "types",
    "Placement": "placements",
    "SHARED_POOL_INSTANCE": "placements",
    "SlotArray": "slots",
    "TokenDecodeError": "tokens",
    "UNKNOWN_TOKEN_OFFSET": "types",
    "pack_kv_rank": "types",
    "parse_event_batch": "wire",
    "parse_event_request": "wire",
    "unpack_kv_rank": "types",
    "wire_batch": "wire_models",
    "wire_entry": "wire_models",
    "world_size_of_kv_rank": "types",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # static checkers see ordinary imports
    from .blend_index import BlendIndex, MatchStats
    from .bindings import FenceResult
    from .gate import IngestGate
    from .ingest import ApplyCounts
    from .key_directory import BlendLookupDisabled, KeyDirectory
    from .placements import SHARED_POOL_INSTANCE, KeyPlacements, Placement
    from .slots import SlotArray
    from .tokens import TokenDecodeError
    from .types import (
        DEFAULT_CHUNK_SIZE,
        UNKNOWN_TOKEN_OFFSET,
        BlendMatch,
        BlendNamespace,
        ObjectKey,
        pack_kv_rank,
        unpack_kv_rank,
        world_size_of_kv_rank,
    )
    from .wire import EventBatch, EventRequest, EventValidationError, parse_event_batch, parse_event_request
    from .wire_models import EventRequestModel, wire_batch, wire_entry
