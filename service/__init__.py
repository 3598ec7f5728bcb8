"""The top room: what users talk to over the network (HTTP app, micro-batcher, CLI, client).

Public surface (loaded on first use, so ``import blendmatch.service.client`` loads neither
FastAPI nor numba)::

    from blendmatch.service import BlendClient, AsyncBlendClient, ServiceConfig, create_app

Everything else is an implementation detail of its module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the module (in this package) that defines it.
_EXPORTS: dict[str, str] = {
    "AsyncBlendClient": "client",
    "BlendClient": "client",
    "BlendClientError": "client",
    "ServiceConfig": "config",
    "create_app": "app",
    "resolve_overlaps": "client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from .app import create_app
    from .client import AsyncBlendClient, BlendClient, BlendClientError, resolve_overlaps
    from .config import ServiceConfig
