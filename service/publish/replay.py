"""The replay ring and the ROUTER that answers replay requests, both bounded in bytes.

Question answered: "how many bytes can replay clients make this process hold, and what
do they get past that?" vLLM's protocol (``vllm/distributed/kv_events.py``): a request is
``[identity, b"", start seq (8 bytes big-endian)]``; the answer is every buffered message
with seq >= start as ``[identity, b"", topic, seq, payload]`` (legacy: without the topic)
and then the end marker ``[identity, b"", b"", END_SEQ, b""]``. vLLM answers a request
whole at once; so did we, and pyzmq copies frames under 64 KB even with ``copy=False``, so
every request copied the whole ring into that client's queue (twenty DEALERs that never
read held 9 GB, and kept it).

Here a request is a *cursor*, not a copy:

- **zero copy, tracked**: each payload goes out as ``zmq.Frame(payload, copy=False,
  track=True)``: libzmq's queue references the ring's own bytes, and the frame's tracker
  says when libzmq let go of it (taken by the peer, or dropped with its connection).
  :class:`InFlight` sums the bytes not yet let go: that is what replay clients hold.
- **budgets**: a client gets its next message only while its bytes in flight stay within
  ``client_bytes`` and everyone's within ``total_bytes`` (a message larger than a budget
  goes alone, when nothing else is in flight). A client that never reads stops advancing;
  it costs at most its budget.
- **a bound on clients**: at most ``max_clients`` identities replay at once; a request from
  one more is answered at once with the end marker and no message (vLLM's protocol has no
  refusal: to a vLLM subscriber this is "nothing to replay": it retries on its next gap),
  counted as ``refused``. One client's requests are answered in order; at most
  :data:`MAX_PENDING` wait behind the one being answered, the ones past it are answered
  with the end marker alone, in order (refused).
- **leaving returns the memory**: ``ROUTER_MANDATORY`` makes a send to an identity that
  left fail (``EHOSTUNREACH``) instead of vanishing: the cursor is dropped; libzmq dropped
  the queued frames with the connection, and their trackers finish.
- **slices**: one pass sends at most :data:`SLICE_BYTES`, so the live stream (the same
  thread) is served between slices, whatever the replays.

Bad requests are counted by kind and logged at most once per :data:`LOG_INTERVAL_S` per
kind (``service/ratelog.py``, as the HTTP refusals).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from ..ratelog import RateLimitedLog
from .wire import END_SEQ, seq_bytes

#: A replay request with this start seq asks for a snapshot (``snapshot.py``): ``2**64 - 2``.
SNAPSHOT_SEQ = (1 << 64) - 2

__all__ = ["InFlight", "ReplayRing", "ReplayServer", "FRAME_OVERHEAD", "LOG_INTERVAL_S", "MAX_PENDING",
           "SLICE_BYTES"]

log = logging.getLogger("blendmatch.service.publish")

#: Bytes counted per message besides its payload (identity, topic and seq frames, libzmq's
#: message headers): a flood of tiny messages is bounded too.
FRAME_OVERHEAD = 256
#: Requests of one client waiting behind the one being answered; more are refused.
MAX_PENDING = 4
#: Bytes one pass of the publisher's thread sends to replay clients before it serves the
#: live queue again.
SLICE_BYTES = 1 << 20
#: At most one WARNING per kind of bad request per this many seconds.
LOG_INTERVAL_S = 10.0
_REFUSED = -1


class ReplayRing:
    """The last messages published, ``(topic, seq, payload)`` in seq order, at most
    ``max_steps`` of them and ``max_bytes`` bytes (payload + topic + :data:`FRAME_OVERHEAD`
    each): the oldest go first. The newest message is always kept, whatever its size."""

    def __init__(self, max_steps: int, max_bytes: int) -> None:
        self.max_steps = max_steps
        self.max_bytes = max_bytes
        self._items: deque[tuple[bytes, int, bytes]] = deque()
        self.bytes = 0
        self.evicted = 0

    @staticmethod
    def cost(topic: bytes, payload: bytes) -> int:
        return len(payload) + len(topic) + FRAME_OVERHEAD

    def append(self, topic: bytes, seq: int, payload: bytes) -> None:
        items = self._items
        items.append((topic, seq, payload))
        self.bytes += self.cost(topic, payload)
        while len(items) > 1 and (len(items) > self.max_steps or self.bytes > self.max_bytes):
            t, _, p = items.popleft()
            self.bytes -= self.cost(t, p)
            self.evicted += 1

    def at_or_after(self, seq: int) -> Optional[tuple[bytes, int, bytes]]:
        """The first message with seq >= ``seq`` (None: none)."""
        items = self._items
        k = bisect.bisect_left(items, seq, key=lambda item: item[1])  # type: ignore[arg-type]
        return items[k] if k < len(items) else None

    def __iter__(self) -> Iterator[tuple[bytes, int, bytes]]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class InFlight:
    """Bytes handed to libzmq (zero-copy, tracked) that it has not let go of yet.

    Frames are mostly let go of in send order (a ROUTER's pipe is FIFO), so :meth:`reap`
    pops finished ones from the front; a PUB socket lets go of the *newer* messages first
    when a stalled subscriber keeps the older ones, so every :data:`SCAN_S` the whole list
    is scanned too (at most a few thousand trackers: the high-water marks bound them)."""

    SCAN_S = 0.05

    def __init__(self) -> None:
        self._sent: deque[tuple[Any, int]] = deque()
        self.bytes = 0
        self._scanned = 0.0

    def add(self, tracker: Any, nbytes: int) -> None:
        self._sent.append((tracker, nbytes))
        self.bytes += nbytes

    def reap(self) -> int:
        """Forget what libzmq let go of; the bytes freed."""
        sent, freed = self._sent, 0
        while sent and sent[0][0].done:
            freed += sent.popleft()[1]
        if sent and len(sent) > 1:
            now = time.monotonic()
            if now - self._scanned >= self.SCAN_S:
                self._scanned = now
                kept = deque(e for e in sent if not e[0].done)
                freed += sum(n for _, n in sent) - sum(n for _, n in kept)
                self._sent = kept
        self.bytes -= freed
        return freed

    def take(self, other: "InFlight") -> None:
        """Adopt ``other``'s frames (a client that left: they finish when libzmq drops them)."""
        self._sent.extend(other._sent)
        self.bytes += other.bytes
        other._sent.clear()
        other.bytes = 0

    def __len__(self) -> int:
        return len(self._sent)


@dataclass
class _Client:
    ident: bytes
    #: ``[start seq, 1]`` per request, or ``[_REFUSED, n]`` for n refused ones, in order
    requests: deque = field(default_factory=deque)
    cursor: Optional[int] = None
    sent: InFlight = field(default_factory=InFlight)


class ReplayServer:
    """Answers replay requests on a bound ROUTER ``sock`` (with ``ROUTER_MANDATORY`` set)
    from ``ring``; see the module docstring. ``count(outcome)`` is called per request
    (``ok``, ``bad``, ``refused``). Call :meth:`serve` from the one thread that owns the
    socket."""

    def __init__(self, sock: Any, ring: ReplayRing, *, legacy: bool, client_bytes: int, total_bytes: int,
                 max_clients: int, count: Callable[[str], None]) -> None:
        self.sock = sock
        self.ring = ring
        self.legacy = legacy
        self.client_bytes = client_bytes
        self.total_bytes = total_bytes
        self.max_clients = max_clients
        self._count = count
        self._clients: dict[bytes, _Client] = {}
        self._gone = InFlight()  # frames of clients that left, until libzmq drops them
        self.bytes = 0  # bytes in flight to every client (and to those that left)
        self.replayed = 0
        self.send_errors = 0
        self._log = RateLimitedLog(log, LOG_INTERVAL_S)
        #: answers :data:`~.snapshot.SNAPSHOT_SEQ` requests (``snapshot.py``); None: they
        #: are ordinary requests (nothing is that new: the end marker alone)
        self.snapshots: Any = None

    @property
    def clients(self) -> int:
        return len(self._clients)

    # ------------------------------------------------------------------ one pass
    def serve(self) -> bool:
        """Read requests, forget what libzmq let go of, send one slice; whether anything
        was sent (the caller polls again at once then)."""
        import zmq

        self._receive(zmq)
        freed = self._gone.reap()
        for client in self._clients.values():
            freed += client.sent.reap()
        self.bytes -= freed
        budget = SLICE_BYTES
        if self.snapshots is not None:
            budget = self.snapshots.serve(zmq, self.sock, self._fits_snapshot, budget)
        for ident in list(self._clients):
            client = self._clients[ident]
            budget = self._advance(zmq, client, budget)
            if not client.requests and not len(client.sent):
                del self._clients[ident]  # answered and taken: its slot is free
            if budget <= 0:
                break
        return budget < SLICE_BYTES

    def _receive(self, zmq: Any) -> None:
        sock = self.sock
        for _ in range(64):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                self._count("bad")
                self._log.warn("frames", "kv-events: ignored a bad replay request (%d frames, sizes %s; a request is "
                               "[identity, b'', 8-byte seq])", len(frames), [len(f) for f in frames[:4]])
                continue
            if len(frames[2]) != 8:
                self._count("bad")
                self._log.warn("seq", "kv-events: ignored a bad replay request (a %d-byte seq; it takes 8)",
                               len(frames[2]))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            if start == SNAPSHOT_SEQ and self.snapshots is not None:
                self.snapshots.request(zmq, sock, ident)
                continue
            client = self._clients.get(ident)
            if client is None:
                if len(self._clients) >= self.max_clients:
                    self._refuse_now(zmq, ident)
                    continue
                client = self._clients[ident] = _Client(ident)
            reqs = client.requests
            if len(reqs) <= MAX_PENDING:
                reqs.append([start, 1])
                self._count("ok")
            else:  # answered by the end marker alone, after the ones before it
                if reqs[-1][0] == _REFUSED:
                    reqs[-1][1] += 1
                else:
                    reqs.append([_REFUSED, 1])
                self._count("refused")

    def _refuse_now(self, zmq: Any, ident: bytes) -> None:
        self._count("refused")
        self._log.warn("refused", "kv-events: refused a replay from a client over --kv-events-max-replays (%d "
                       "replaying): answered with the end marker alone", self.max_clients)
        try:
            self.sock.send_multipart(self._marker(ident), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # its queue is full or it left: nothing is owed
            pass

    def _marker(self, ident: bytes) -> tuple:
        return (ident, b"", END_SEQ, b"") if self.legacy else (ident, b"", b"", END_SEQ, b"")

    # ------------------------------------------------------------------ sending
    def _fits_snapshot(self, sent: InFlight, need: int) -> bool:
        """The replay budgets for a snapshot client (its own ``client_bytes``; the total
        counts replays and snapshots together)."""
        total = self.bytes + self.snapshots.bytes
        if sent.bytes and sent.bytes + need > self.client_bytes:
            return False
        return not total or total + need <= self.total_bytes

    def _fits(self, client: _Client, need: int) -> bool:
        if client.sent.bytes and client.sent.bytes + need > self.client_bytes:
            return False
        total = self.bytes + (self.snapshots.bytes if self.snapshots is not None else 0)
        return not total or total + need <= self.total_bytes

    def _advance(self, zmq: Any, client: _Client, budget: int) -> int:
        """Send ``client`` what its budgets allow, at most ``budget`` bytes; what is left."""
        while client.requests and budget > 0:
            head = client.requests[0]
            if head[0] == _REFUSED:
                item = None
            else:
                if client.cursor is None:
                    client.cursor = head[0]
                item = self.ring.at_or_after(client.cursor)
            if item is None:  # the end marker
                if not self._fits(client, FRAME_OVERHEAD):
                    return budget
                parts = self._marker(client.ident)
                marker = zmq.Frame(parts[-2], copy=False, track=True)
                if not self._send(zmq, client, (*parts[:-2], marker, parts[-1]), marker, FRAME_OVERHEAD):
                    return budget
                budget -= FRAME_OVERHEAD
                head[1] -= 1
                if head[1] <= 0:
                    client.requests.popleft()
                client.cursor = None
                continue
            topic, seq, payload = item
            need = len(payload) + FRAME_OVERHEAD
            if not self._fits(client, need):
                return budget
            frame = zmq.Frame(payload, copy=False, track=True)  # libzmq references the ring's bytes
            sb = seq_bytes(seq)
            parts = (client.ident, b"", sb, frame) if self.legacy else (client.ident, b"", topic, sb, frame)
            if not self._send(zmq, client, parts, frame, need):
                return budget
            self.replayed += 1
            client.cursor = seq + 1
            budget -= need
        return budget

    def _send(self, zmq: Any, client: _Client, parts: tuple, tracked: Any, need: int) -> bool:
        try:
            self.sock.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.Again:  # its queue is at the socket's high-water mark: later
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # it left: nothing more is owed; what it had queued is being dropped by libzmq
            self.send_errors += 1
            self._gone.take(client.sent)
            client.requests.clear()
            client.cursor = None
            return False
        client.sent.add(tracked.tracker, need)
        self.bytes += need
        return True
