"""The host truth: fingerprints, the slot array, the blend index, the key directory.

Pure numpy/numba; no HTTP and no CuPy here. ``index`` reaches the engines in ``gpu/`` only
through the engine protocol (``blendmatch.gpu.engine``).
"""

from .blend_index import BlendIndex, MatchStats
from .fingerprint import chunk_fingerprint, chunk_fingerprints, prefix_fingerprints, rolling_fingerprints
from .slots import SlotArray
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

from .events import (
    EventBatch,
    EventRequest,
    EventRequestModel,
    EventValidationError,
    IngestGate,
    parse_event_batch,
    parse_event_request,
    wire_batch,
    wire_entry,
)
from .key_directory import (
    SHARED_POOL_INSTANCE,
    ApplyCounts,
    BlendLookupDisabled,
    FenceResult,
    KeyDirectory,
    KeyPlacements,
    Placement,
)

__all__ = [
    "ApplyCounts",
    "BlendIndex",
    "BlendLookupDisabled",
    "BlendMatch",
    "BlendNamespace",
    "DEFAULT_CHUNK_SIZE",
    "EventBatch",
    "EventRequest",
    "EventRequestModel",
    "EventValidationError",
    "FenceResult",
    "IngestGate",
    "KeyDirectory",
    "KeyPlacements",
    "MatchStats",
    "ObjectKey",
    "Placement",
    "SHARED_POOL_INSTANCE",
    "SlotArray",
    "UNKNOWN_TOKEN_OFFSET",
    "chunk_fingerprint",
    "chunk_fingerprints",
    "pack_kv_rank",
    "parse_event_batch",
    "parse_event_request",
    "prefix_fingerprints",
    "rolling_fingerprints",
    "unpack_kv_rank",
    "wire_batch",
    "wire_entry",
    "world_size_of_kv_rank",
]
