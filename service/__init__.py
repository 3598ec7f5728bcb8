"""The top room: what users talk to over the network (HTTP app, micro-batcher, CLI, client).

Public surface (loaded on first use, so ``import blendmatch.service.client`` loads neither
FastAPI nor numba)::

    from blendmatch.service import BlendClient, AsyncBlendClient, ServiceConfig, create_app

Everything else is an implementation detail of its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blendmatch.lazy import lazy_exports

#: Public name -> the module (in this package) that defines it.
_EXPORTS: dict[str, str] = {
    "AsyncBlendClient": "client",
    "BlendClient": "client",
    "BlendClientError": "client",
    "BlendCoordinatorClient": "client",
    "MatchPlacement": "client",
    "PENDING": "client",
    "PlacedMatch": "client",
    "ServiceConfig": "config",
    "create_app": "app",
    "resolve_overlaps": "client",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:
    from .app import create_app
    from .client import (PENDING, AsyncBlendClient, BlendClient, BlendClientError, BlendCoordinatorClient,
                         MatchPlacement, PlacedMatch, resolve_overlaps)
    from .config import ServiceConfig
