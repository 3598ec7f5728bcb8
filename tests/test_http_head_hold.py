"""A response's head and body leave in one write (``service/limits.py``, ``_CountingTransport``;
issue 28: each send is a syscall made with the GIL held).

The wrapper is driven directly over a recording transport on a real event loop, and a real
server is asked over a real socket, so that both the rule and its effect on the wire are
checked: a head is held until the body's write, or until the end of the loop iteration, or
a ``close``; nothing is reordered, lost or written twice.
"""

from __future__ import annotations

import asyncio

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


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


def test_head_and_body_are_one_write_and_a_lone_head_leaves_at_the_end_of_the_iteration() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        raw, conn = _Raw(), _Conn(loop)
        t = limits_mod._CountingTransport(raw, conn)  # type: ignore[arg-type]
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
        t2 = limits_mod._CountingTransport(raw2, _Conn(loop))  # type: ignore[arg-type]
        t2.write(HEAD)
        raw2.closed = True  # the peer left: nothing is written into a closing transport
        await asyncio.sleep(0)
        t2.write(b"{}")
        assert raw2.writes == []

    asyncio.run(main())


def test_uvicorn_answers_with_one_write_per_response(monkeypatch) -> None:
    """The real protocol under uvicorn, over a real socket: the connection's raw transport
    (recorded) gets one write per keep-alive response, head and body together."""
    from test_http_limits import Served, read_response  # noqa: PLC0415

    writes: list[bytes] = []

    class Recording:
        def __init__(self, real):
            self._real = real

        def write(self, data):
            writes.append(bytes(data))
            self._real.write(data)

        def __getattr__(self, name):
            return getattr(self._real, name)

    real_made = limits_mod._LimitedProtocol.connection_made

    def connection_made(self, transport):
        return real_made(self, Recording(transport))

    monkeypatch.setattr(limits_mod._LimitedProtocol, "connection_made", connection_made)
    with Served() as srv:
        with srv.connect() as s:
            for k in range(5):
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                status, _, body = read_response(s)
                assert status == 200 and body
                assert len(writes) == k + 1 and writes[-1].startswith(b"HTTP/1.1 200") and writes[-1].endswith(body)
