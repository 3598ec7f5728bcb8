"""A response's head and body leave in one write (``service/counting_transport.py``, ``CountingTransport``;
issue 28: each send is a syscall made with the GIL held), and that write goes straight to
the socket without the GIL when the transport has nothing queued.

The wrapper is driven directly over a recording transport on a real event loop, and a real
server is asked over a real socket, so that both the rules and their effect on the wire are
checked: a head is held until the body's write, or until the end of the loop iteration, or
a ``close``; a write bypasses the transport only while nothing is queued there (what the
socket does not take is queued behind); nothing is reordered, lost or written twice.
"""

from __future__ import annotations

import asyncio
import socket
import time

from blendmatch.service import counting_transport as transport_mod
from blendmatch.service import limits as limits_mod


class _Raw:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0


class _Conn:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.accounted = 0

    def _bm_account_out(self) -> None:
        self.accounted += 1


class _Recording:
    """A real transport whose writes are also recorded (in ``into``)."""

    def __init__(self, real, into: list[bytes]) -> None:
        self._real = real
        self._into = into

    def write(self, data) -> None:
        self._into.append(bytes(data))
        self._real.write(data)

    def __getattr__(self, name):
        return getattr(self._real, name)


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


def test_head_and_body_are_one_write_and_a_lone_head_leaves_at_the_end_of_the_iteration() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        raw, conn = _Raw(), _Conn(loop)
        t = transport_mod.CountingTransport(raw, conn)  # type: ignore[arg-type]
        t.write(HEAD)
        assert raw.writes == []  # held for the body
        t.write(b"{}")
        assert raw.writes == [HEAD + b"{}"] and conn.accounted == 1
        t.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # a head with no body behind it
        assert raw.writes == [HEAD + b"{}"]
        await asyncio.sleep(0)  # the iteration ends: it leaves
        assert raw.writes[-1] == b"HTTP/1.1 100 Continue\r\n\r\n" and len(raw.writes) == 2
        big = b"HTTP/1.1 " + b"x" * 5000  # not a head: never held
        t.write(big)
        assert raw.writes[-1] == big
        t.write(b"a body chunk")  # not a head: written at once
        assert raw.writes[-1] == b"a body chunk"
        t.write(HEAD)
        t.close()  # a held head is written before the close
        assert raw.writes[-1] == HEAD and raw.closed
        await asyncio.sleep(0)
        assert raw.writes.count(HEAD) == 1  # not twice

        raw2 = _Raw()
        t2 = transport_mod.CountingTransport(raw2, _Conn(loop))  # type: ignore[arg-type]
        t2.write(HEAD)
        raw2.closed = True  # the peer left: nothing is written into a closing transport
        await asyncio.sleep(0)
        t2.write(b"{}")
        assert raw2.writes == []

    asyncio.run(main())


def test_uvicorn_answers_with_one_write_per_response(monkeypatch) -> None:
    """The real protocol under uvicorn, over a real socket: one send per keep-alive response,
    head and body together, straight to the socket (nothing is queued in the transport)."""
    from test_http_limits import Served, read_response  # noqa: PLC0415

    writes: list[bytes] = []
    direct: list[bytes] = []
    real_made = limits_mod._LimitedProtocol.connection_made

    def connection_made(self, transport):
        return real_made(self, _Recording(transport, writes))

    real_send = transport_mod._send

    def send(fd, data):
        direct.append(bytes(data))
        return real_send(fd, data)

    monkeypatch.setattr(limits_mod._LimitedProtocol, "connection_made", connection_made)
    monkeypatch.setattr(transport_mod, "_send", send)
    with Served() as srv:
        with srv.connect() as s:
            for k in range(5):
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                status, _, body = read_response(s)
                assert status == 200 and body
                assert writes == [] and len(direct) == k + 1
                assert direct[-1].startswith(b"HTTP/1.1 200") and direct[-1].endswith(body)


def test_a_write_bypasses_the_transport_only_while_nothing_is_queued(monkeypatch) -> None:
    """On a real event loop (uvloop when installed, as the server runs) and a real socket
    whose peer does not read: a write into an empty transport goes straight to the socket;
    what the socket does not take, and every write after it while anything is queued, go
    through the transport; once the peer has read everything, writes go straight again.
    The peer receives every byte once, in the order written."""
    try:
        import uvloop  # noqa: PLC0415
        new_loop = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - the server's default loop then
        new_loop = asyncio.new_event_loop
    direct: list[int] = []
    real_send = transport_mod._send

    def send(fd, data):
        direct.append(-1)  # tried; the count it sent replaces it
        direct[-1] = real_send(fd, data)
        return direct[-1]

    monkeypatch.setattr(transport_mod, "_send", send)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        made: asyncio.Future = loop.create_future()
        queued: list[bytes] = []

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                made.set_result(transport_mod.CountingTransport(_Recording(transport, queued), _Conn(loop)))

        server = await loop.create_server(Proto, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        peer = socket.create_connection(("127.0.0.1", port))
        peer.setblocking(False)
        t = await made
        assert t._fd >= 0
        sent: list[bytes] = []

        def write(data: bytes) -> None:
            sent.append(data)
            t.write(data)

        write(b"first,")
        assert direct == [6] and queued == []  # straight to the socket
        big = bytes(range(256)) * (64 << 10)  # 16 MiB: more than the socket buffers take
        write(big)
        assert 0 < direct[-1] < len(big) and queued == [big[direct[-1]:]]  # the rest is queued
        n_direct = len(direct)
        got = bytearray()
        while len(got) < min(1 << 20, direct[-1]):  # the peer takes some of what the socket
            try:  # took; the loop does not run meanwhile, so the transport's queue stays
                got += peer.recv(1 << 16)
            except BlockingIOError:
                time.sleep(0.001)
        assert t.get_write_buffer_size() > 0
        for k in range(200):  # small writes behind the queue: through the transport, in order,
            write(b"<%d>" % k)  # although the socket has room for them now
        assert len(direct) == n_direct and len(queued) == 201
        want = b"".join(sent)
        while len(got) < len(want):
            try:
                chunk = peer.recv(1 << 20)
            except BlockingIOError:
                await asyncio.sleep(0.001)
                continue
            assert chunk
            got += chunk
        for _ in range(1000):  # the transport learns that its queue drained
            if not t.get_write_buffer_size():
                break
            await asyncio.sleep(0.001)
        assert bytes(got) == want  # every byte once, in order
        write(b"last")
        assert direct[-1] == 4 and len(queued) == 201  # nothing queued: straight again
        await asyncio.sleep(0.01)
        assert peer.recv(100) == b"last"
        peer.close()
        server.close()

    loop = new_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_tls_and_socketless_transports_write_through_the_transport(monkeypatch) -> None:
    class Info:
        def __init__(self, **extra):
            self.extra = extra

        def get_extra_info(self, name, default=None):
            return self.extra.get(name, default)

    a, b = socket.socketpair()
    try:
        assert transport_mod._plain_socket_fd(Info(socket=a)) == a.fileno()
        assert transport_mod._plain_socket_fd(Info(socket=a, sslcontext=object())) == -1
        assert transport_mod._plain_socket_fd(Info(socket=a, ssl_object=object())) == -1
        assert transport_mod._plain_socket_fd(Info()) == -1
        assert transport_mod._plain_socket_fd(object()) == -1
        monkeypatch.setattr(transport_mod.os, "name", "nt")  # a socket is no fd for os.write there
        assert transport_mod._plain_socket_fd(Info(socket=a)) == -1
    finally:
        a.close()
        b.close()
