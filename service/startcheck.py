"""How ``blendmatch`` refuses to start: one line on stderr, a non-zero exit, no traceback.

Every reason the service cannot start is a :class:`StartError` (or, for a bad command line,
argparse's error through :class:`OneLineArgumentParser`); ``cli.main`` catches it and
:func:`error_line` turns it into the one line ``blendmatch serve: error: <why>``. The exit
status is :data:`EXIT_USAGE` (2, as argparse) for a bad command line and
:data:`EXIT_START_FAILED` (1) for everything else (docs/operations.md, "Exit status").

The checks here run before the start-up work (engine selection, JIT compiling, a
checkpoint restore) and before the first log line, right after the usage checks (the
command line, the access file, the KV-events grant), so a mistake costs a second, not the
whole start-up, and none of them is reported after a "serving" line:

- :func:`bind_sockets` binds the listening socket(s) first and hands them to uvicorn
  (``Server.run(sockets=...)``): a port in use is the first thing found, and no other
  process can take the port between the check and the serving. The socket is bound but not
  listening until uvicorn serves (asyncio and uvloop call ``listen()`` on it then), so a
  client that connects during start-up is refused at once instead of waiting;
- :func:`check_tls_files` opens each ``--ssl-*`` file and loads them as uvicorn will;
- :func:`check_optional_modules` imports the optional dependency each asked-for feature
  needs and names the extra that brings it;
- :func:`check_engine` asks whether ``--engine gpu`` can have a GPU (CuPy, a device that
  answers a trial launch) before anything else is built.
"""

from __future__ import annotations

import argparse
import errno
import socket
import ssl
from typing import Any, NoReturn, Sequence

__all__ = ["EXIT_START_FAILED", "EXIT_USAGE", "OneLineArgumentParser", "StartError", "bind_addresses",
           "bind_sockets", "check_engine", "check_optional_modules", "check_tls_files", "engine_error", "error_line"]

#: Exit status of a start refused for any reason other than the command line.
EXIT_START_FAILED = 1
#: Exit status of a bad command line (argparse's own).
EXIT_USAGE = 2

#: The optional dependency behind each feature: (flag, config field, value that asks for it
#: or None for "any non-empty value", module to import, pip distribution, blendmatch extra).
_OPTIONAL: tuple[tuple[str, str, Any, str, str, str], ...] = (
    ("--event-transport kafka", "event_transport", "kafka", "confluent_kafka", "confluent-kafka", "kafka"),
    ("--kv-events-endpoint", "kv_events_endpoint", None, "zmq", "pyzmq", "kv-events"),
)


class StartError(Exception):
    """The service cannot start, for the reason in the message (one sentence, naming the
    flag and the value at fault). ``exit_code``: :data:`EXIT_START_FAILED` unless the
    command line itself is wrong."""

    def __init__(self, message: str, exit_code: int = EXIT_START_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def error_line(prog: str, message: str) -> str:
    """THE form of a start error: ``<prog>: error: <message>`` on one line (argparse's form;
    line breaks inside the message become spaces, so it stays one line)."""
    return f"{prog}: error: {' '.join(str(message).split())}"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage error is one line and a pointer to ``--help``, instead
    of the full usage block (60 lines for ``serve``) above the one line that matters.

    ``error`` is argparse's documented override point; it still exits with status 2 through
    ``exit``, so callers (and tests) see argparse's ``SystemExit`` as before. Subparsers
    inherit the class (``add_subparsers`` uses the parent's type)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, error_line(self.prog, f"{message} (see {self.prog} --help)") + "\n")


def bind_addresses(host: str, port: int, *, shared: bool = False) -> list[socket.socket]:
    """TCP sockets bound to ``host:port``, not yet listening (uvicorn's server calls
    ``listen()`` when it starts serving): one per address ``host`` resolves to, as asyncio's
    ``create_server`` binds them (``localhost``: ``::1`` and ``127.0.0.1``). ``SO_REUSEADDR``
    as uvicorn sets it (a restart is not refused by the last run's ``TIME_WAIT``
    connections); ``shared``: also ``SO_REUSEPORT``, for ``--workers`` children sharing one
    port. An IPv6 address that is the only one also accepts IPv4 (``IPV6_V6ONLY`` off).
    Raises ``OSError`` (``EADDRINUSE`` for a port that another socket listens on), having
    closed what it bound."""
    if shared and not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("--workers needs SO_REUSEPORT, which this platform lacks")
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    infos = [info for i, info in enumerate(infos) if info[4] not in [x[4] for x in infos[:i]]]
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _name, addr in infos:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if shared:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(len(infos) > 1))
            sock.bind(addr)
            sock.set_inheritable(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_sockets(host: str, ports: Sequence[tuple[int, bool]]) -> list[socket.socket]:
    """The bound sockets of every ``(port, shared)`` (port 0: one the system picks), or
    :class:`StartError` naming the address and why (what was bound is closed)."""
    sockets: list[socket.socket] = []
    try:
        for port, shared in ports:
            try:
                sockets.extend(bind_addresses(host, port, shared=shared))
            except OSError as exc:  # in use, another user's port, an address not on this host
                why = exc.strerror or str(exc)
                if exc.errno == errno.EADDRINUSE:
                    why += " (another process listens there: stop it or pick another --port)"
                raise StartError(f"cannot listen on {host}:{port}: {why}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def check_tls_files(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    """:class:`StartError` naming the flag and file unless each given file can be read and the
    certificate, key and CA bundle load as uvicorn will load them. A password-protected key
    is refused here (uvicorn would ask for the password on the terminal)."""
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs)):
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise StartError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if certfile is None:
        return
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile, keyfile, password=lambda: b"")
    except ssl.SSLError as exc:
        files = f"--ssl-certfile {certfile}" + (f" --ssl-keyfile {keyfile}" if keyfile else "")
        raise StartError(f"{files}: not a PEM certificate and its unencrypted private key "
                         f"({exc.reason or exc})") from None
    if ca_certs is not None:
        try:
            ctx.load_verify_locations(ca_certs)
        except ssl.SSLError as exc:
            raise StartError(f"--ssl-ca-certs {ca_certs}: not a PEM bundle of CA certificates "
                             f"({exc.reason or exc})") from None


def check_optional_modules(config: Any) -> None:
    """:class:`StartError` with the install hint when a feature ``config`` asks for needs an
    optional dependency that does not import."""
    import importlib

    for flag, field, value, module, dist, extra in _OPTIONAL:
        asked = getattr(config, field)
        if not (asked == value if value is not None else asked):
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise StartError(f"{flag} needs {dist}, which does not import ({exc}): "
                             f"pip install 'blendmatch[{extra}]'") from None


def check_engine(engine: str) -> None:
    """``--engine gpu`` without a usable GPU: :class:`StartError` with the reason (CuPy
    missing, with its install hint; no device; a trial launch that failed). Other engines
    need nothing checked here."""
    if engine != "gpu":
        return
    from blendmatch.gpu.cupy_engine import gpu_unavailable

    why = gpu_unavailable()
    if why is not None:
        raise StartError(engine_error(why))


def engine_error(exc: BaseException) -> str:
    """The start error for an engine that cannot be built (``--engine gpu`` only: ``auto``
    falls back to the CPU engine instead)."""
    return f"--engine gpu: no usable GPU: {exc} (--engine auto runs on the CPU instead)"
