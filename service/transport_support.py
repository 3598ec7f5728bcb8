"""Is the part of uvicorn that the HTTP limits and the lookup lane use still there?

Question answered: "can ``blendmatch serve`` run its own HTTP protocol (``limits.py``) and
the lookup lane (``lane.py``) on the uvicorn and httptools installed here, or must it fall
back to plain uvicorn?" Both rest on uvicorn's httptools protocol, which is not a public API:
``limits.py`` subclasses ``HttpToolsProtocol`` and overrides a dozen of its methods, and the
lane reads the protocol's per-connection state, builds uvicorn's ``RequestResponseCycle``
itself and starts it with ``_start_asgi_task``. ``pyproject.toml`` pins uvicorn and httptools
to the range these were tested on (:func:`tested_range`; CI runs ``tests/test_lane.py`` and
``tests/test_http_limits.py`` at its floor and at its newest version), but an environment
can still hold another version (installed with ``--no-deps``, or pinned by something else).
uvicorn 0.44, for one, has no ``_start_asgi_task``: the lane's requests that fall back to
the app hung there.

:func:`transport_support` lists, by name, everything of uvicorn and httptools that the two
modules touch, and the call structure they rely on (uvicorn's ``on_headers_complete`` starts
a request through ``_start_asgi_task``), and says what is missing: empty when all is there.
``blendmatch serve`` calls it once at start; with anything missing it logs one WARNING that
names what is missing and serves with plain uvicorn (:func:`fallback_uvicorn_options`): the
same answers, slower, with the limits that uvicorn's public ``Config`` options can keep
(docs/operations.md, "HTTP server versions"). A name check cannot prove that uvicorn's
behaviour behind a name is unchanged: the pinned range and CI at both of its ends do that.

This module imports uvicorn and httptools only inside :func:`transport_support`, so that it
can say what is missing where importing ``limits.py`` would fail; for the same reason the
open-file limit that ``--max-connections`` needs is raised here
(:func:`raise_open_file_limit`), for either server.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

__all__ = ["RESERVED_FDS", "fallback_uvicorn_options", "raise_open_file_limit", "tested_range", "transport_support"]

log = logging.getLogger("blendmatch.service.limits")  # the connection limit's words, whichever server runs


#: What ``limits.py`` and ``lane.py`` use of httptools.
_HTTPTOOLS_NAMES = ("HttpRequestParser", "HttpParserError", "HttpParserUpgrade")
_PARSER_METHODS = ("feed_data", "get_method", "get_http_version", "should_keep_alive", "should_upgrade")
#: Methods of uvicorn's ``HttpToolsProtocol`` that ``limits.py`` overrides (and calls through
#: ``super()``) or calls, and that the lane calls.
_PROTOCOL_METHODS = ("connection_made", "connection_lost", "eof_received", "data_received", "send_400_response",
                     "on_message_begin", "on_url", "on_header", "on_headers_complete", "on_body",
                     "on_message_complete", "handle_websocket_upgrade", "on_response_complete", "resume_writing",
                     "timeout_keep_alive_handler", "shutdown", "_start_asgi_task", "_unset_keepalive_if_required",
                     "_should_upgrade", "_unsupported_upgrade_warning")
#: The protocol's per-connection and per-request state that they read or write (set by its
#: ``__init__`` and ``on_message_begin``).
_PROTOCOL_STATE = ("app", "loop", "logger", "access_logger", "access_log", "parser", "root_path",
                   "limit_concurrency", "timeout_keep_alive", "server_state", "transport", "flow", "client",
                   "pipeline", "scope", "headers", "url", "expect_100_continue", "cycle")
#: ``RequestResponseCycle``'s keyword arguments (the lane builds one: ``lane.fall_back``) and
#: the state of a cycle that the limits and the lane read or write.
_CYCLE_ARGUMENTS = ("scope", "transport", "flow", "logger", "access_logger", "access_log", "default_headers",
                    "message_event", "expect_100_continue", "keep_alive", "on_response")
_CYCLE_STATE = ("scope", "body", "more_body", "message_event", "response_started", "response_complete",
                "disconnected", "keep_alive", "on_response")
_FLOW_STATE = ("read_paused", "pause_reading", "resume_reading")
_SERVER_STATE = ("default_headers", "total_requests")
#: Names that uvicorn's own methods must still use (the call structure the overrides rely
#: on: a request reaches the app through ``_start_asgi_task``, which the limits' override
#: watches; uvicorn 0.44 started the task inline).
_CALLS = (("on_headers_complete", "_start_asgi_task"), ("on_headers_complete", "RequestResponseCycle"))


def transport_support() -> list[str]:
    """What of uvicorn and httptools that ``limits.py`` and ``lane.py`` use is missing here,
    each as a short name (``"HttpToolsProtocol._start_asgi_task"``); empty when all is there.
    Cheap (one protocol object built, no socket, no loop run): called once at start."""
    try:
        import httptools
        from uvicorn.config import Config
        from uvicorn.protocols.http import httptools_impl
        from uvicorn.protocols.http.flow_control import FlowControl
        from uvicorn.server import ServerState
    except ImportError as exc:
        return [f"import {exc.name or exc}"]
    missing = [f"httptools.{name}" for name in _HTTPTOOLS_NAMES if not hasattr(httptools, name)]
    parser_class = getattr(httptools, "HttpRequestParser", None)
    missing += [f"HttpRequestParser.{name}" for name in _PARSER_METHODS if not hasattr(parser_class, name)]
    protocol_class = getattr(httptools_impl, "HttpToolsProtocol", None)
    cycle_class = getattr(httptools_impl, "RequestResponseCycle", None)
    status_line = getattr(httptools_impl, "STATUS_LINE", None)
    if not isinstance(getattr(status_line, "get", lambda _: None)(200), bytes):
        missing.append("httptools_impl.STATUS_LINE[200]")
    if protocol_class is None or cycle_class is None:
        return missing + [f"httptools_impl.{name}" for name, value in (("HttpToolsProtocol", protocol_class),
                                                                        ("RequestResponseCycle", cycle_class))
                          if value is None]
    missing += [f"HttpToolsProtocol.{name}" for name in _PROTOCOL_METHODS if not callable(getattr(protocol_class,
                                                                                                   name, None))]
    for method, name in _CALLS:
        code = getattr(getattr(protocol_class, method, None), "__code__", None)
        if code is not None and name not in code.co_names:
            missing.append(f"HttpToolsProtocol.{method} calling {name}")
    try:
        config = Config(_no_app, http=protocol_class, ws="none", lifespan="off", log_config=None,
                        proxy_headers=False)
        state = ServerState()
        protocol = protocol_class(config=config, server_state=state, app_state={}, _loop=_NO_LOOP)
        protocol.on_message_begin()
        flow = FlowControl(_NO_TRANSPORT)  # type: ignore[arg-type]
        cycle = cycle_class(**{name: None for name in _CYCLE_ARGUMENTS}
                            | {"message_event": asyncio.Event(), "expect_100_continue": False, "keep_alive": True,
                               "default_headers": [], "access_log": False})
    except Exception as exc:  # noqa: BLE001 - whatever it is, the protocol cannot be used as limits.py does
        return missing + [f"uvicorn's protocol objects as limits.py builds them ({type(exc).__name__}: {exc})"]
    missing += [f"HttpToolsProtocol().{name}" for name in _PROTOCOL_STATE if not hasattr(protocol, name)]
    missing += [f"RequestResponseCycle().{name}" for name in _CYCLE_STATE if not hasattr(cycle, name)]
    missing += [f"FlowControl().{name}" for name in _FLOW_STATE if not hasattr(flow, name)]
    missing += [f"ServerState().{name}" for name in _SERVER_STATE if not hasattr(state, name)]
    return missing


def tested_range() -> str:
    """The uvicorn and httptools versions the limits and the lane are tested with, as the
    installed package's requirements say (``pyproject.toml``: the one place they are set)."""
    from importlib import metadata

    try:
        requires = metadata.requires("blendmatch") or []
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "pyproject.toml's uvicorn and httptools"
    pinned = [r for r in requires if re.match(r"(uvicorn|httptools)\b(?!-)", r.split(";")[0].strip())]
    return ", ".join(sorted(pinned)) or "pyproject.toml's uvicorn and httptools"


def fallback_uvicorn_options(config: Any) -> dict[str, Any]:
    """uvicorn's public ``Config`` options that keep what they can of the HTTP limits
    without ``limits.py`` (``config``: a ``ServiceConfig``): uvicorn's pure-Python h11
    protocol, whose ``h11_max_incomplete_event_size`` bounds a request's head in bytes
    (``--max-header-bytes``; answered 400 instead of 431), and ``limit_concurrency``
    (``--max-connections``: a plain-text 503 past it, counting connections or requests in
    progress). No header or body timeouts, no bound on bytes in flight: uvicorn offers none."""
    return {"http": "h11", "h11_max_incomplete_event_size": int(config.max_header_bytes),
            "limit_concurrency": int(config.max_connections)}


#: File descriptors kept for everything that is not a client connection (listening sockets,
#: the checkpoint writer, Kafka, log files) when sizing the open-file limit.
RESERVED_FDS = 128


def raise_open_file_limit(max_connections: int) -> None:
    """Raise the soft open-file limit so that ``max_connections`` connections fit (up to the
    hard limit); warn when they cannot. Without it a process with the usual soft limit of
    1,024 fails ``accept()`` before the connection limit could answer a clear 503."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("the open-file limit (%d) is below --max-connections %d + %d: connections past about %d fail "
                    "at accept() instead of getting a 503; raise `ulimit -n` or lower --max-connections", soft,
                    max_connections, RESERVED_FDS, soft - RESERVED_FDS)


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    """The app of the probe's ``Config``: never called."""


class _NoTransport:
    """The probe's flow control transport: nothing is ever read or written."""

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


_NO_TRANSPORT = _NoTransport()
#: The probe protocol's loop (stored, never used: nothing is scheduled).
_NO_LOOP: Any = object()
