"""Exception handlers: every error leaves the service as a stable JSON body.

=====================================  ======  ==============================================
exception                              status  body
=====================================  ======  ==============================================
``RequestValidationError`` (pydantic)  422     ``{"detail": "body.world_size: Input should be
                                               greater than or equal to 1, got 0", "errors":
                                               [{"loc", "msg", "type"}]}``
``EventValidationError`` (directory)   422     same shape; ``loc`` from the event parser
``ServiceError`` subclasses            4xx/5xx ``{"detail": ...}`` (see ``errors.py``)
``HTTPException`` (routing, 404, 405,  as set  ``{"detail": ...}``
413 from the body limit)
a body that is not JSON at all         422     as a schema error, ``type: json_invalid``
(invalid UTF-8, nested too deeply)
``ClientDisconnected`` (middleware)    (none)  counted, one log line, no traceback
anything else                          500     ``{"detail": "internal error (<type>)"}``,
                                               logged with its traceback and counted
=====================================  ======  ==============================================

The ``detail`` string names the field (its path, ``body.queries.3.token_ids``) and the bad
value where it is short; the request's input is never echoed whole (a 4 MB body must not
come back in an error).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response
from starlette.exceptions import HTTPException

from blendmatch.index.wire import EventValidationError

from blendmatch.index.logsafe import log_safe

from .errors import ServiceError
from .http_rules import json_response
from .middleware import ClientDisconnected
from .metrics import ServiceMetrics

__all__ = ["install_error_handlers", "format_validation_errors", "service_error_response",
           "unexpected_error_response", "validation_error_response", "event_validation_error_response"]

log = logging.getLogger(__name__)

_MAX_LISTED_ERRORS = 5
_MAX_VALUE_REPR = 60


def format_validation_errors(errors: Iterable[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """``(detail, errors)``: one readable sentence, and the errors without their inputs."""
    clean: list[dict[str, Any]] = []
    parts: list[str] = []
    for err in errors:
        loc = [x for x in err.get("loc", ()) if x != "__root__"]
        path = _path(loc)
        msg = str(err.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        etype = str(err.get("type", "value_error"))
        if etype == "json_invalid":
            ctx = err.get("ctx") or {}
            msg = f"{msg}: {ctx.get('error', 'malformed JSON')}"
            path = f"body (at character {loc[1]})" if len(loc) > 1 and isinstance(loc[1], int) else "body"
        elif "input" in err and _is_scalar(err["input"]) and etype not in ("missing", "value_error"):
            msg = f"{msg}, got {_short(err['input'])}"
        clean.append({"loc": loc, "msg": msg, "type": etype})
        if len(parts) < _MAX_LISTED_ERRORS:
            parts.append(f"{path}: {msg}" if path else msg)
    detail = "; ".join(parts) or "invalid request"
    if len(clean) > _MAX_LISTED_ERRORS:
        detail += f" (and {len(clean) - _MAX_LISTED_ERRORS} more errors)"
    return detail, clean


def _path(loc: list[Any]) -> str:
    out = ""
    for item in loc:
        out += f".{item}" if out else str(item)
    return out


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _short(value: Any) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= _MAX_VALUE_REPR else text[: _MAX_VALUE_REPR - 3] + "..."


def allowed_methods(app: Any, scope: Any) -> list[str]:
    """The methods ``app`` serves at ``scope``'s path, for a 405's ``Allow`` (sorted)."""
    from starlette.routing import Match

    matching = [r for r in app.router.routes if getattr(r, "methods", None)
                and r.matches({**scope, "method": "GET"})[0] is not Match.NONE]
    # A literal path (GET /instances/usage) is its own resource even where a parametric one
    # (DELETE /instances/{instance_id}) also matches it: list the literal routes' methods.
    literal = [r for r in matching if getattr(r, "path", None) == scope.get("path")]
    return sorted({m for r in (literal or matching) for m in r.methods})


def service_error_response(exc: ServiceError, metrics: ServiceMetrics, where: str) -> Response:
    """The response for a :class:`ServiceError` (also used by the fast path)."""
    if exc.status_code == 503:
        log.warning("%s: %s", log_safe(where), log_safe(exc.detail, 500))
    elif exc.status_code >= 500:
        metrics.internal_errors.inc()
        log.error("%s failed: %s", log_safe(where), log_safe(exc.detail, 500))
    else:
        metrics.rejected.labels(str(exc.status_code)).inc()
    retry_after = getattr(exc, "retry_after_s", None)
    return json_response({"detail": exc.detail}, exc.status_code,
                         None if retry_after is None else {"Retry-After": str(retry_after)})


def validation_error_response(exc: RequestValidationError, metrics: ServiceMetrics) -> Response:
    """The 422 for a schema error (also used by the fast path)."""
    detail, errors = format_validation_errors(exc.errors())
    metrics.rejected.labels("422").inc()
    return json_response({"detail": detail, "errors": errors}, 422)


def event_validation_error_response(exc: EventValidationError, metrics: ServiceMetrics) -> Response:
    """The 422 for a malformed event request (also used by the fast path)."""
    loc = ["body", *exc.loc]
    metrics.rejected.labels("422").inc()
    return json_response({"detail": f"{_path(loc)}: {exc.reason}",
                          "errors": [{"loc": loc, "msg": exc.reason, "type": "value_error"}]}, 422)


def unexpected_error_response(exc: BaseException, metrics: ServiceMetrics, where: str) -> Response:
    """A JSON 500 for an exception nobody expected (a bug): logged with its traceback, counted."""
    metrics.internal_errors.inc()
    log.error("unhandled error in %s", log_safe(where), exc_info=exc)
    return json_response({"detail": f"internal error ({type(exc).__name__}); this is a bug, please report it"}, 500)


def _peer(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "unknown"


def install_error_handlers(app: FastAPI, metrics: ServiceMetrics) -> None:
    """Register the handlers of the table in the module docstring on ``app``."""

    def reject(status: int, content: dict[str, Any]) -> Response:
        metrics.rejected.labels(str(status)).inc()
        return json_response(content, status)

    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        return validation_error_response(exc, metrics)

    async def on_event_validation(request: Request, exc: EventValidationError) -> Response:
        return event_validation_error_response(exc, metrics)

    async def on_service_error(request: Request, exc: ServiceError) -> Response:
        return service_error_response(exc, metrics, f"{request.method} {request.url.path}")

    async def on_http(request: Request, exc: HTTPException) -> Response:
        if isinstance(exc, ClientDisconnected):
            metrics.client_disconnects.inc()
            log.info("client %s disconnected during %s %s after %d body bytes", _peer(request),
                     request.method, log_safe(request.url.path), exc.received)
            return json_response({"detail": exc.detail}, 400)  # nobody is there to read it
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, (ValueError, RecursionError)):
            # FastAPI's body reader decodes JSON with json.loads and turns whatever is not a
            # JSONDecodeError (invalid UTF-8, recursion depth) into a bare 400; the contract
            # says a body that is not JSON is a 422 like any other schema error.
            why = ("nested too deeply" if isinstance(cause, RecursionError) else
                   # Python's int() refuses over 4,300 digits and suggests a setting of the
                   # server's interpreter; the client only needs to know the number is too big
                   "number out of range (an integer of more than 4300 digits)"
                   if "integer string conversion" in str(cause) else f"{type(cause).__name__}: {cause}")
            detail, errors = format_validation_errors([{"type": "json_invalid", "loc": ("body",),
                                                        "msg": "JSON decode error", "ctx": {"error": why[:200]}}])
            return reject(422, {"detail": detail, "errors": errors})
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            # Starlette names only the first route that matched the path; one path served by
            # several routes (GET and POST /instances) must list every method (RFC 9110 15.5.6).
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request.app, request.scope))}
        content = {"detail": exc.detail if isinstance(exc.detail, str) else str(exc.detail)}
        if exc.status_code >= 500:
            return json_response(content, exc.status_code, headers)
        metrics.rejected.labels(str(exc.status_code)).inc()
        return json_response(content, exc.status_code, headers)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return unexpected_error_response(exc, metrics, f"{request.method} {request.url.path}")

    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(EventValidationError, on_event_validation)  # type: ignore[arg-type]
    app.add_exception_handler(ServiceError, on_service_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)
