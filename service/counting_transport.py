"""A connection's transport as the HTTP limits see it (``limits.py``): every write counted
toward the bytes in flight, a response head held for its body, the send made without the GIL.

Why a module of its own: it is the write side of a connection, apart from the limits'
reading and timers; ``limits.py`` wraps each accepted connection's transport in one, and the
lookup lane (``lane.py``) writes its answers through it (``write_whole``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

__all__ = ["CountingTransport"]


class CountingTransport:
    """The connection's transport, with every write accounted (bytes not yet taken by the
    client count toward ``max_bytes_in_flight``), and a response head held back until the
    body's write: uvicorn writes the head and the body of a response separately,
    each a send syscall made with the GIL held (a fifth of the GIL time of a lookup under
    load, measured with py-spy ``--gil``); joined, they are one. A held head is written at
    the next write, at ``close``, or at the end of the event loop's current iteration,
    whichever comes first, so nothing waits longer than that.

    And the one send itself is made without the GIL when the transport has nothing queued
    (the norm: a response of a few hundred bytes into an empty socket buffer): straight to
    the socket with ``os.write``, which releases the GIL around the syscall, where uvloop's
    ``transport.write`` keeps it (its loopback send, the kernel's TCP work for both ends,
    was ~18% of the event loop's GIL time under wrk's lookups, while the lookup thread
    waited for the GIL). What the socket does not take, and every write while something is
    queued, goes to the transport as before, so the bytes keep their order (uvloop sends a
    write at once when nothing is queued, so an empty buffer means nothing is pending).
    Not for TLS connections (their bytes must pass the transport's encryption). Everything
    else is the transport's."""

    __slots__ = ("_transport", "_conn", "_held", "_fd")

    def __init__(self, transport: asyncio.Transport, conn: Any) -> None:
        self._transport = transport
        self._conn = conn
        self._held: bytes | None = None
        self._fd = _plain_socket_fd(transport)

    def write(self, data: Any) -> None:
        transport = self._transport
        if transport.is_closing():  # the peer is gone: uvloop would raise into the app
            self._held = None
            return
        held = self._held
        if held is not None:
            self._held = None
            data = held + data
        elif len(data) <= _HEAD_HOLD_MAX and data[:9] == b"HTTP/1.1 ":  # a response head: its body follows
            self._held = bytes(data)
            self._conn.loop.call_soon(self._release)
            return
        self._put(transport, data)

    def write_whole(self, data: bytes) -> None:
        """A whole response (head and body) at once: nothing to hold back."""
        transport = self._transport
        if transport.is_closing():
            return
        if self._held is not None:  # cannot happen between whole responses; kept in order if it does
            data = self._held + data
            self._held = None
        self._put(transport, data)

    def _put(self, transport: asyncio.Transport, data: Any) -> None:
        if self._fd >= 0 and data and not transport.get_write_buffer_size():
            try:
                sent = _send(self._fd, data)
            except OSError:  # full (EAGAIN), interrupted, or the peer is gone: the transport's
                sent = 0  # write says which, in its own way
            if sent < len(data):
                transport.write(data[sent:])
        else:
            transport.write(data)
        self._conn._bm_account_out()

    def _release(self) -> None:
        """End of the loop iteration that held a head: write it if no body came."""
        if self._held is not None:
            self.write(b"")

    def close(self) -> None:
        self._release()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


#: The direct send of :class:`CountingTransport` (a name of its own so tests can watch it).
_send = os.write


def _plain_socket_fd(transport: Any) -> int:
    """The file descriptor of a plain TCP transport's socket, or -1 (TLS, no socket, a
    transport that does not say, or not POSIX, where a socket is no file descriptor for
    ``os.write``): then every write goes through the transport."""
    get = getattr(transport, "get_extra_info", None)
    if os.name != "posix" or get is None or get("sslcontext") is not None or get("ssl_object") is not None:
        return -1
    sock = get("socket")
    try:
        return -1 if sock is None else int(sock.fileno())
    except (OSError, ValueError, TypeError):
        return -1


#: A write this short that starts a response is held for the body (a head; uvicorn's are ~100 bytes).
_HEAD_HOLD_MAX = 4096
