"""The fast path: well-formed lookups and health checks answered without the framework stack.

Why: on the service's hot endpoint the event loop is the bottleneck (the engine runs on its
own thread and releases the GIL), and profiling a loaded server showed the FastAPI/Starlette
layers (exception middleware, exit stacks, route matching, request objects, dependency
solving) taking about two thirds of the loop's time per lookup. This ASGI middleware sits
outside them and answers exactly the requests it can answer *identically*:

- ``GET /healthz`` (HTTP mode; in Kafka mode the route asks the log source);
- ``POST /events`` with the same header rules: the route's own ``answer_events`` (the
  events thread decodes, validates and applies the raw body; nothing is decoded on the
  loop), its errors answered by the app's handler functions. The framework stack cost
  more loop time per request than a 50-entry batch's decoding does;
- ``POST /directory/blend-lookup``, ``POST /directory/blend-lookup/batch`` and ``POST
  /route/score`` whose body
  has a ``Content-Length`` within the limit, a JSON content type, and parses and validates
  with the very models the routes use (``model_validate_json``: pydantic-core parses and
  validates in one pass, about twice as fast as ``json.loads`` plus validation, and it is at
  least as strict, so anything it refuses goes to the route), calling the very functions the
  routes call (``routes_lookup.answer_lookup`` / ``answer_lookup_batch``,
  ``routes_route.answer_score``).

Everything else, and every request whose body does not parse or validate (bad JSON, a
schema error) or whose headers rule it out (no ``Content-Length``, or any header rule of
``http_rules.body_rejection``: a bad length, over the body limit, not JSON), is handed to
the normal app with its body replayed, so the canonical route (or the body-limit
middleware, with the very same rule) produces the canonical error. The header rules, the
healthz body and the body reading are ``http_rules.py``'s, shared with the app. Errors raised by the answer functions (a ``tokens_b64`` that does not
decode, the token limit, shutdown, an engine failure) are answered here with the very
functions the app's exception handlers use (``handlers.service_error_response`` /
``unexpected_error_response``), so the bytes are the same either way, and nothing runs
twice.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from blendmatch.index.tokens import split_b64_value, split_token_arrays
from blendmatch.index.wire import EventValidationError

from .context import ServiceContext
from .errors import ServiceError
from .handlers import (event_validation_error_response, service_error_response, unexpected_error_response,
                       validation_error_response)
from .access import instance_filter
from .http_rules import HEALTHZ_BODY, body_headers, body_rejection, read_body, replay, send_json
from .routes_events import answer_events
from .routes_lookup import answer_lookup, answer_lookup_batch
from .routes_route import answer_score
from .schemas import BlendBatchLookupRequest, BlendLookupRequest, BlendQuery, RouteScoreRequest

__all__ = ["FastPath", "parse_body"]

log = logging.getLogger(__name__)

_Answer = Callable[[ServiceContext, Any, Any], Awaitable[bytes]]
#: Bytes JSON forbids unescaped inside a string (RFC 8259, section 7).
_JSON_CONTROL = bytes(range(0x20))


class FastPath:
    """ASGI middleware; see the module docstring. ``limit`` is the body size limit."""

    def __init__(self, app: ASGIApp, context: ServiceContext, limit: int, json_paths: frozenset[str]) -> None:
        self.app = app
        self.context = context
        self.limit = limit
        self.json_paths = json_paths
        self._posts: dict[str, tuple[type[BaseModel], _Answer]] = {
            "/directory/blend-lookup": (BlendLookupRequest, answer_lookup),
            "/directory/blend-lookup/batch": (BlendBatchLookupRequest, answer_lookup_batch),
            "/route/score": (RouteScoreRequest, answer_score),  # one query, as a lookup
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == "/healthz" and self.context.source is None:  # Kafka mode: the route decides
            await send_json(send, 200, HEALTHZ_BODY)
            return
        route = self._posts.get(path) if method == "POST" else None
        if route is None and not (method == "POST" and path == "/events"):
            await self.app(scope, receive, send)
            return
        headers = body_headers(scope)
        if headers.length is None or body_rejection(scope, headers, self.limit, self.json_paths) is not None:
            await self.app(scope, receive, send)  # the app answers (or rejects) it, by the same rules
            return
        body, tail = await read_body(receive)
        if tail:  # the client went away mid-body: the app counts and logs it (middleware.py)
            await self.app(scope, replay(body, tail, receive), send)
            return
        if route is None:
            await self._events(scope, receive, send, body)
            return
        model, answer = route
        try:
            parsed, tokens = parse_body(model, body)
        except Exception:  # noqa: BLE001 - any failure: the route produces the canonical 4xx
            await self.app(scope, replay(body, tail, receive), send)
            return
        try:
            payload = await answer(self.context, parsed, tokens)
        except ServiceError as exc:  # 4xx (a token that does not decode, a limit) and 503
            if (exc.status_code == 422 and isinstance(tokens, (bytes, memoryview))
                    and len(bytes(tokens).translate(None, _JSON_CONTROL)) != len(tokens)):
                # a raw control character inside the string: the body is not JSON, which the
                # route says in its own words (checked only here, off the hot path)
                await self.app(scope, replay(body, tail, receive), send)
                return
            await service_error_response(exc, self.context.metrics, f"POST {path}")(scope, receive, send)
            return
        except Exception as exc:  # noqa: BLE001 - a bug or an engine failure: a JSON 500
            await unexpected_error_response(exc, self.context.metrics, f"POST {path}")(scope, receive, send)
            return
        await send_json(send, 200, payload)

    async def _events(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """``POST /events``: the route's own answer function (the events thread decodes,
        validates and applies), its errors answered by the app's own handler functions."""
        metrics = self.context.metrics
        try:
            payload = await answer_events(self.context, body, instance_filter(scope))
        except EventValidationError as exc:
            await event_validation_error_response(exc, metrics)(scope, receive, send)
            return
        except RequestValidationError as exc:
            await validation_error_response(exc, metrics)(scope, receive, send)
            return
        except ServiceError as exc:
            await service_error_response(exc, metrics, "POST /events")(scope, receive, send)
            return
        except Exception as exc:  # noqa: BLE001 - a bug: a JSON 500
            await unexpected_error_response(exc, metrics, "POST /events")(scope, receive, send)
            return
        await send_json(send, 200, payload)


def parse_body(model: type[BaseModel], body: bytes, *, failures_elsewhere: bool = False) -> tuple[Any, Any]:
    """``(validated model, tokens)``. A body with ``token_ids`` arrays has them taken out of
    the text as uint32 first (``split_token_arrays``: no Python int per id, ~4x faster than
    parsing the list), the rest is validated by the route's own model with each array
    replaced by ``[]`` (so the model accepts and rejects what it would have: every id was a
    plain integer in range, which the model accepts, and nothing else changed); the arrays
    go back to the queries that had them, in document order. Where that mapping could be
    ambiguous (a ``token_ids`` key nested in an unknown field, a key given twice), the body
    is validated as sent. A single lookup that opens with ``tokens_b64`` has its string
    taken out the same way (``split_b64_value``); its bytes go to the lookup thread's
    decoder. Raises what validation raises. ``failures_elsewhere``: the caller answers only
    successes and hands every failure to the app (the lookup lane): the string's ASCII test
    is left to the decoder (``split_b64_value``'s ``require_ascii``)."""
    if issubclass(model, BlendQuery):  # one query: a lookup or a routing score
        taken = split_b64_value(body, require_ascii=not failures_elsewhere)
        if taken is not None:
            value, text = taken
            return model.model_validate_json(text), value
    arrays = split_token_arrays(body, placeholder="empty")
    if arrays is not None:
        parsed = model.model_validate_json(arrays.text)
        if isinstance(parsed, BlendQuery):
            if len(arrays) == 1 and parsed.token_ids is not None:
                return parsed, arrays.row(0)
        else:
            queries = parsed.queries
            with_ids = [i for i, q in enumerate(queries) if q.token_ids is not None]
            if len(with_ids) == len(arrays):
                tokens: list[Any] = [None] * len(queries)
                for k, i in enumerate(with_ids):
                    tokens[i] = arrays.row(k)
                return parsed, tokens
    return model.model_validate_json(body), None  # pydantic-core's parser: ~2x json.loads + validate
