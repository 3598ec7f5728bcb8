"""The app factory: ``create_app(config) -> FastAPI``.

Builds one :class:`~blendmatch.service.context.ServiceContext` (directory, engine, batcher,
metrics), mounts the routes, installs the error handlers, the body limit and the fast path
for well-formed lookups (``fastpath.py``: same models, same answer functions, no framework
layers; anything that does not parse and validate goes to the routes). The lifespan
starts the batcher worker and the events thread and stops them in ``finally``, so a failed
start-up or a shutdown never leaves a thread or a waiting request behind.

Tests pass their own ``ServiceConfig`` (and optionally a pre-filled ``KeyDirectory``) and
drive the app in-process (``httpx.ASGITransport`` inside ``app.router.lifespan_context``,
or FastAPI's ``TestClient``).
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.types import Receive, Scope, Send

import blendmatch
from blendmatch.index.wire_models import EventRequestModel
from blendmatch.index.key_directory import KeyDirectory

from . import routes_directory, routes_events, routes_instances, routes_lookup, routes_ops, routes_proxy
from .config import ServiceConfig
from .context import ServiceContext
from .fastpath import FastPath
from .handlers import install_error_handlers
from .middleware import BodyLimitMiddleware

__all__ = ["create_app", "build_openapi"]

_DESCRIPTION = """\
Fragment lookups for KV-cache reuse over an LMCache cache-event stream.

LMCache-compatible: `POST /events`, `POST /directory/blend-lookup`, `POST /directory/lookup`
(keys form), `GET /directory/keys`, `GET /directory/stats`, the instance registry
(`POST /instances`, `PUT /instances/{instance_id}/heartbeat`, `GET /instances`,
`DELETE /instances/{instance_id}`, `GET /instances/usage`, `GET /instances/{instance_id}/usage`),
`GET /healthz`. Ours: `POST /directory/blend-lookup/batch`, `GET /metrics` (Prometheus).
Errors: 422 for schema errors, 413 for limits, always `{"detail": "..."}` naming the field.
With `--upstream-coordinator`, every path not listed here (LMCache's quotas, pins, prefetch,
delete) and the token form of `POST /directory/lookup` are proxied to that LMCache
coordinator (502 unreachable, 504 no answer in time), and events and registry calls are
forwarded to it after they are applied here.
"""


class _BlendApp(FastAPI):
    """FastAPI entered through the fast path (``fastpath.py``): well-formed lookups and health
    checks skip every framework layer (FastAPI's per-request telemetry check included);
    everything else goes to ``FastAPI.__call__`` unchanged."""

    _fast_path: FastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self._fast_path
        if fast is None:
            context: ServiceContext = self.state.blendmatch_context
            fast = self._fast_path = FastPath(super().__call__, context=context, limit=int(context.config.max_body_bytes))
        await fast(scope, receive, send)


def create_app(config: ServiceConfig | None = None, *, directory: KeyDirectory | None = None) -> FastAPI:
    """A ready-to-serve app. ``directory``: use this one (tests) instead of building one."""
    config = config or ServiceConfig()
    context = ServiceContext(config, directory)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await context.start()
            yield
        finally:
            await context.stop()

    app = _BlendApp(title="blendmatch", version=blendmatch.__version__, description=_DESCRIPTION,
                    lifespan=lifespan)
    app.state.blendmatch_context = context
    install_error_handlers(app, context.metrics)
    app.add_middleware(BodyLimitMiddleware, limit=int(config.max_body_bytes),
                       on_reject=lambda status: context.metrics.rejected.labels(str(status)).inc())
    for module in (routes_lookup, routes_events, routes_directory, routes_instances, routes_ops):
        # Flattened into the app's own route list rather than include_router(): recent
        # FastAPI versions match included routers through an extra layer per router, which
        # cost about half of a trivial request's time. The routes are the same objects.
        app.router.routes.extend(module.router.routes)
    if config.upstream_coordinator:  # last: it takes only what no route above matches (routes_proxy.py)
        app.router.routes.extend(routes_proxy.router.routes)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI schema, plus the ``POST /events`` body schema (that route reads raw
    bytes for speed, so FastAPI cannot see its model)."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    events = EventRequestModel.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, sub in events.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components[routes_events.EVENT_REQUEST_SCHEMA_NAME] = events
    schema["components"]["schemas"] = dict(sorted(components.items()))
    return schema
