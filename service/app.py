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
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.types import ASGIApp, Receive, Scope, Send

import blendmatch
from blendmatch.index.wire import INT64_MAX
from blendmatch.index.wire_models import EventRequestModel
from blendmatch.index.key_directory import KeyDirectory

from . import routes_directory, routes_events, routes_instances, routes_lookup, routes_ops, routes_proxy, routes_route
from .access import AccessControl, AccessPolicy, rule_for
from .config import ServiceConfig
from .context import ServiceContext
from .fastpath import FastPath
from .handlers import install_error_handlers
from .middleware import BodyLimitMiddleware

if TYPE_CHECKING:  # lane.py imports uvicorn's private protocol module: only the protocol that uses it loads it
    from .lane import Lane

__all__ = ["create_app", "build_openapi", "JSON_BODY_PATHS"]

#: POST routes whose body must be ``Content-Type: application/json`` (else 415).
JSON_BODY_PATHS = ("/events", "/directory/blend-lookup", "/directory/blend-lookup/batch", "/directory/lookup",
                   "/route/score")

_DESCRIPTION = """\
Fragment lookups for KV-cache reuse over an LMCache cache-event stream.

LMCache-compatible: `POST /events`, `POST /directory/blend-lookup`, `POST /directory/lookup`
(keys form), `GET /directory/keys`, `GET /directory/stats`, the instance registry
(`POST /instances`, `PUT /instances/{instance_id}/heartbeat`, `GET /instances`,
`DELETE /instances/{instance_id}`, `GET /instances/usage`, `GET /instances/{instance_id}/usage`),
`GET /healthz`. Ours: `POST /directory/blend-lookup/batch`, `POST /route/score` (which instance
should serve a request: docs/routing.md), `GET /metrics` (Prometheus).
Errors: 422 for schema errors, 413 for limits, always `{"detail": "..."}` naming the field.
Access: protected by default (loopback peers only); roles, API keys and CIDR allowlists come
from `--access-file` (401 for an unknown key, 403 for a missing role). See docs/security.md.
With `--upstream-coordinator`, every path not listed here (LMCache's quotas, pins, prefetch,
delete) and the token form of `POST /directory/lookup` are proxied to that LMCache
coordinator (502 unreachable, 504 no answer in time), and events and registry calls are
forwarded to it after they are applied here.
"""


_JSON_PATHS = frozenset(JSON_BODY_PATHS)


def _body_limit(context: ServiceContext) -> int:
    """The body limit the fast path and the lookup lane apply (``--max-body-bytes``)."""
    return int(context.config.max_body_bytes)


class _BlendApp(FastAPI):
    """FastAPI entered through access control (``access.py``, outermost: nothing is reachable
    without passing the route policy, the fast path included), then the fast path
    (``fastpath.py``): well-formed lookups and health checks skip every framework layer
    (FastAPI's per-request telemetry check included); everything else goes to
    ``FastAPI.__call__`` unchanged."""

    _entry: AccessControl | None = None
    _lane: Lane | None = None

    @property
    def access(self) -> AccessControl:
        """The access-control layer (``reload()`` on SIGHUP)."""
        entry = self._entry
        if entry is None:
            context: ServiceContext = self.state.blendmatch_context
            inner: ASGIApp = super().__call__
            if self.state.blendmatch_fast_path:
                inner = FastPath(inner, context=context, limit=_body_limit(context), json_paths=_JSON_PATHS)
            entry = self._entry = AccessControl(inner, self.state.blendmatch_access,
                                                on_reject=lambda status: context.metrics.rejected.labels(str(status)).inc())
        return entry

    @property
    def blendmatch_lane(self) -> Lane | None:
        """What the lookup lane (``lane.py``) needs of this app, read by the HTTP protocol
        once a connection; None with the fast path off (every request then goes through
        the framework, the lane's included)."""
        if not self.state.blendmatch_fast_path:
            return None
        lane = self._lane
        if lane is None:
            from .lane import Lane

            context: ServiceContext = self.state.blendmatch_context
            lane = self._lane = Lane(context, self.access, _body_limit(context), _JSON_PATHS)
        return lane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        entry = self._entry
        if entry is None:
            entry = self.access
        await entry(scope, receive, send)


def create_app(config: ServiceConfig | None = None, *, directory: KeyDirectory | None = None,
               access: AccessPolicy | None = None, fast_path: bool = True) -> FastAPI:
    """A ready-to-serve app. ``directory``: use this one (tests) instead of building one.
    ``access``: this policy instead of the one ``config.access_file`` names (protected mode when
    it names none); a bad access file raises ``AccessFileError`` here, before serving.
    ``fast_path=False``: every request through the FastAPI stack (the test that holds the
    fast path to the routes' answers, byte for byte; never slower to be wrong, only slower)."""
    config = config or ServiceConfig()
    if access is None:
        access = AccessPolicy.from_file(config.access_file) if config.access_file else AccessPolicy.protected_mode()
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
    app.state.blendmatch_access = access
    app.state.blendmatch_fast_path = fast_path
    install_error_handlers(app, context.metrics)
    app.add_middleware(BodyLimitMiddleware, limit=int(config.max_body_bytes),
                       on_reject=lambda status: context.metrics.rejected.labels(str(status)).inc(),
                       json_paths=JSON_BODY_PATHS)
    for module in (routes_lookup, routes_route, routes_events, routes_directory, routes_instances, routes_ops):
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
    _document_access(schema)
    _exact_integer_bounds(schema)
    return schema


def _exact_integer_bounds(node: Any) -> None:
    """FastAPI's OpenAPI model stores ``minimum``/``maximum`` as floats, which turns the int64
    bound 2^63 - 1 into 2.0**63 (one more than the server accepts: a mismatch schemathesis
    found). Integer schemas get integer bounds again; 2.0**63 can only have been 2^63 - 1."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                v = node.get(k)
                if isinstance(v, float) and v.is_integer():
                    node[k] = INT64_MAX if v == 2.0 ** 63 else int(v)
        for v in node.values():
            _exact_integer_bounds(v)
    elif isinstance(node, list):
        for v in node:
            _exact_integer_bounds(v)


def _document_access(schema: dict[str, Any]) -> None:
    """Document what every route may answer before it runs, from the very tables that decide
    it: 401/403 from the access policy (``access.ROUTE_POLICY``), 415 for JSON-body routes,
    and the bearer scheme. So the schema cannot drift from the checks."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    schema["components"].setdefault("securitySchemes", {})["bearerKey"] = {
        "type": "http", "scheme": "bearer",
        "description": "an API key from the access file; peers on a CIDR allowlist need none (docs/security.md)"}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            rule, _ = rule_for(method.upper(), path)
            responses = op.setdefault("responses", {})
            if not rule.open:
                op["security"] = [{}, {"bearerKey": []}]
                roles = ", ".join(sorted(rule.roles))
                responses.setdefault("401", {"description": "an API key was sent and is not in the access file",
                                             "content": error})
                responses.setdefault("403", {"description": f"the peer/key lacks the role: {roles} (protected "
                                                            f"mode: any non-loopback peer)", "content": error})
            if method == "post" and path in JSON_BODY_PATHS:
                responses.setdefault("415", {"description": "Content-Type is not application/json",
                                             "content": error})
                responses.setdefault("400", {"description": "Content-Length is not an integer", "content": error})
            op["responses"] = dict(sorted(responses.items()))
