"""The service room: everything a user talks to (HTTP app, micro-batcher, CLI, client).

Public surface (sorted; modules themselves are implementation detail)::

    from blendmatch.service import BlendClient, ServiceConfig, create_app, resolve_overlaps
"""

from .app import create_app
from .batcher import BatchRecord, MicroBatcher
from .client import (
    AsyncBlendClient,
    BlendClient,
    BlendClientError,
    BlendConnectionError,
    BlendHTTPError,
    resolve_overlaps,
)
from .config import ServiceConfig
from .context import ServiceContext
from .errors import (
    BatchError,
    BatchOutputMismatch,
    InvalidRequest,
    LimitExceeded,
    RequestRejected,
    ServiceError,
    ServiceUnavailable,
    TokenDecodeError,
)
from .metrics import ServiceMetrics
from .tokens import decode_tokens, encode_tokens

__all__ = [
    "AsyncBlendClient",
    "BatchError",
    "BatchOutputMismatch",
    "BatchRecord",
    "BlendClient",
    "BlendClientError",
    "BlendConnectionError",
    "BlendHTTPError",
    "InvalidRequest",
    "LimitExceeded",
    "MicroBatcher",
    "RequestRejected",
    "ServiceConfig",
    "ServiceContext",
    "ServiceError",
    "ServiceMetrics",
    "ServiceUnavailable",
    "TokenDecodeError",
    "create_app",
    "decode_tokens",
    "encode_tokens",
    "resolve_overlaps",
]
