"""The service's errors, drawn once, and how each reaches the wire.

Class tree::

    ServiceError                 base; never raised itself
    ├── RequestRejected          the caller's fault: a 4xx with a stable JSON body
    │   ├── InvalidRequest       422: a field is missing, mistyped or undecodable
    │   ├── Forbidden            403: the credential may not do this (e.g. act for that instance)
    │   ├── LimitExceeded        413: the body or the token count is over a configured limit
    │   └── TooManyInstances     429: one more distinct instance id than ``max_instances``
    ├── ServiceUnavailable       503: the batcher is not running (starting up / shutting down)
    └── BatchError               the batcher's own failures (never the caller's fault)
        └── BatchOutputMismatch  run_batch returned a different number of results than inputs

Every 4xx body is ``{"detail": "<one readable sentence naming the field>"}``; schema errors
add ``"errors": [{"loc", "msg", "type"}]`` for machines. An unexpected exception becomes a
JSON 500 (counted in ``blendmatch_http_internal_errors_total``); that is a bug, never a path
for bad input. Token errors are ``blendmatch.index.tokens.TokenDecodeError`` (one type for
every token rule, a ``ValueError``): routes turn it into :class:`InvalidRequest` (422), and
its ``TokenLimitExceeded`` subclass into :class:`LimitExceeded` (413).
"""

from __future__ import annotations

__all__ = [
    "ServiceError",
    "RequestRejected",
    "InvalidRequest",
    "LimitExceeded",
    "TooManyInstances",
    "Forbidden",
    "ServiceUnavailable",
    "BatchError",
    "BatchOutputMismatch",
]


class ServiceError(Exception):
    """Base of every error the service raises on purpose."""

    status_code: int = 500

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class RequestRejected(ServiceError):
    """The request is wrong; the caller can fix it. Maps to a 4xx."""

    status_code = 400


class InvalidRequest(RequestRejected):
    """A field is missing, of the wrong type or cannot be decoded (422)."""

    status_code = 422


class LimitExceeded(RequestRejected):
    """The body or the token count is over a configured limit (413)."""

    status_code = 413


class TooManyInstances(RequestRejected):
    """The request would add a distinct instance id past ``max_instances`` (429; nothing of
    it applied). Ids leave when their instance deregisters or expires."""

    status_code = 429


class Forbidden(RequestRejected):
    """The caller's credential does not allow this (403). Route-level checks (which role may
    call a route) happen in ``access.AccessControl``; this is for checks that need the body,
    such as a producer limited to some instance ids sending a batch for another."""

    status_code = 403


class ServiceUnavailable(ServiceError):
    """The service cannot answer now (batcher stopped or not started, kernels still
    compiling); retry later (503). ``retry_after_s``: sent as ``Retry-After`` when set."""

    status_code = 503

    def __init__(self, detail: str, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class BatchError(ServiceError):
    """A failure of the micro-batcher itself, delivered to every request of the batch."""

    status_code = 500


class BatchOutputMismatch(BatchError):
    """``run_batch`` returned a number of results different from the number of inputs."""
