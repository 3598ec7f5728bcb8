"""The catch-all proxy to the upstream coordinator (only with ``--upstream-coordinator``).

Registered after every other route, so it sees only requests that no route of this app
matches by path and method: LMCache's control plane (``/quota*``, ``/cache/pins``,
``/cache/prefetches*``, ``/cache/delete``) and anything else unknown. They are relayed as
they came (``Upstream.proxy``) and the upstream's answer is returned: its status, body and
content type. Without an upstream this route is not mounted at all, so an unknown path is
the same 404 ``{"detail": "Not Found"}`` (and a wrong method the same 405) as ever.
Not in the OpenAPI schema: its contract is the upstream's.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from .context import Ctx
from .upstream import PROXY_METHODS

__all__ = ["router"]

router = APIRouter()


@router.api_route("/{path:path}", methods=list(PROXY_METHODS), include_in_schema=False)
async def proxy(request: Request, ctx: Ctx) -> Response:
    """Relay to the upstream coordinator (502 unreachable, 504 no answer in time)."""
    assert ctx.upstream is not None  # mounted only with an upstream
    body = await request.body()
    # the path as it came (still percent-encoded: a salt "a/b" travels as "a%2Fb", not as two segments)
    raw = request.scope.get("raw_path") or request.scope["path"].encode()
    return await ctx.upstream.proxy(request.method, raw.decode("latin-1"), request.scope.get("query_string", b""),
                                    body, request.headers)
