"""A reference router-side follower: bootstrap from a snapshot, then the live stream, no gap.

Question answered: "what does a router write to hold exactly the fleet's cache state, joining
late, across gaps and publisher restarts?" This module is the protocol of
docs/kv-events.md#snapshots in about a hundred lines, meant to be copied (it needs pyzmq,
the ``kv-events`` extra, and nothing else of blendmatch). It does not decode payloads:
``on_batch(topic, seq, payload)`` gets each vLLM ``KVEventBatch`` to apply (with vLLM's own
``msgspec`` decoder, say), and ``on_reset()`` says "drop everything you hold" before a
(re-)bootstrap. The rules:

1. **subscribe first**, then ask the replay socket for a snapshot (start seq
   :data:`SNAPSHOT_SEQ`): pages ``[b"", topic, seq N, payload]`` and an end frame
   ``[b"", b"", END_SEQ, N]``; N is the first live seq to apply. An empty end payload is a
   refusal (too many snapshots at once): wait, retry.
2. **follow live**: drop seqs below the next one wanted (already in the snapshot, or
   re-published by a replica after its restart); apply the next one; on a gap, ask for a
   replay from the next one wanted. If the replay does not start exactly there (the ring no
   longer holds it), **re-bootstrap** (``on_reset``, then 1.).
3. **reconnects** are libzmq's (both sockets reconnect to a restarted publisher by
   themselves); a publisher restarted from its checkpoint goes on with the seqs it had
   (re-published ones are dropped by 2.), one restarted empty starts again at seq 0, which a
   follower sees as seqs far below what it wants with no end: after ``stale_s`` seconds of
   only such messages it re-bootstraps (a new stream that reaches the old position sooner
   looks like the old one going on: restart publishers from their checkpoint).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

__all__ = ["KVEventsFollower", "SNAPSHOT_SEQ", "SnapshotRefused"]

#: The replay request's start seq that asks for a snapshot (``replay.py``).
SNAPSHOT_SEQ = (1 << 64) - 2
_END = (-1).to_bytes(8, "big", signed=True)


class SnapshotRefused(RuntimeError):
    """The publisher refused the snapshot (or has none): retry later."""


class KVEventsFollower:
    """``KVEventsFollower(endpoint, replay_endpoint).run(on_batch, on_reset)``; or drive it
    by hand: :meth:`bootstrap`, then :meth:`poll` in a loop. ``next_seq``: the next live
    seq wanted. ``timeout_s`` bounds any one wait for the replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str, *, ctx: Any = None, timeout_s: float = 30.0,
                 stale_s: float = 10.0, curve: Optional[dict[str, bytes]] = None) -> None:
        import zmq

        self._zmq = zmq
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.replay_endpoint = replay_endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.stale_s = stale_s
        self._curve = curve or {}
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.req = self._new_req()
        self.next_seq = -1  # none yet: bootstrap first
        self.bootstraps = 0
        self.replays = 0
        self._stale_since: Optional[float] = None

    def _socket(self, kind: int) -> Any:
        sock = self.ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        for name, value in self._curve.items():  # e.g. curve_serverkey / curve_publickey / curve_secretkey
            setattr(sock, name, value)
        return sock

    def _new_req(self) -> Any:
        req = self._socket(self._zmq.DEALER)
        req.connect(self.replay_endpoint)
        return req

    def close(self) -> None:
        self.sub.close(0)
        self.req.close(0)
        if self._own_ctx:
            self.ctx.term()

    # ------------------------------------------------------------------ the replay socket
    def _recv(self) -> list[bytes]:
        if not self.req.poll(self.timeout_ms):
            # the publisher went away mid-answer: a fresh DEALER, so no stale answer follows
            self.req.close(0)
            self.req = self._new_req()
            raise TimeoutError(f"no answer from {self.replay_endpoint} in {self.timeout_ms} ms")
        return self.req.recv_multipart()

    def bootstrap(self, on_batch: Callable[[bytes, int, bytes], None],
                  on_reset: Callable[[], None] = lambda: None) -> int:
        """Ask for a snapshot and apply it (``on_reset`` first); the first live seq to apply."""
        on_reset()
        self.req.send_multipart([b"", SNAPSHOT_SEQ.to_bytes(8, "big")])
        while True:
            frames = self._recv()
            topic, seq_b, payload = frames[-3:]
            if seq_b == _END:
                if not payload:
                    raise SnapshotRefused(f"{self.replay_endpoint} refused the snapshot")
                self.next_seq = int.from_bytes(payload, "big")
                self.bootstraps += 1
                return self.next_seq
            on_batch(topic, int.from_bytes(seq_b, "big"), payload)

    def _replay(self, on_batch: Callable[[bytes, int, bytes], None]) -> bool:
        """Replay from ``next_seq``; False when the ring no longer holds it (re-bootstrap)."""
        self.replays += 1
        self.req.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        ok = True
        while True:
            topic, seq_b, payload = self._recv()[-3:]
            if seq_b == _END:
                return ok
            seq = int.from_bytes(seq_b, "big")
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                ok = False  # drain the rest of the answer, then re-bootstrap
                continue
            if ok:
                on_batch(topic, seq, payload)
                self.next_seq = seq + 1

    # ------------------------------------------------------------------ following
    def poll(self, on_batch: Callable[[bytes, int, bytes], None], on_reset: Callable[[], None] = lambda: None,
             timeout_ms: int = 100) -> int:
        """Apply what the live stream brought within ``timeout_ms``; how many messages."""
        if self.next_seq < 0:
            self.bootstrap(on_batch, on_reset)
        n = 0
        while self.sub.poll(timeout_ms if n == 0 else 0):
            topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            n += 1
            if seq < self.next_seq:  # in the snapshot, or re-published after a restart
                if self._stale_since is None:
                    self._stale_since = time.monotonic()
                elif time.monotonic() - self._stale_since > self.stale_s:
                    self._stale_since = None  # a publisher restarted empty: start over
                    self.bootstrap(on_batch, on_reset)
                continue
            self._stale_since = None
            if seq > self.next_seq and not self._replay(on_batch):
                self.bootstrap(on_batch, on_reset)
            if seq == self.next_seq:
                on_batch(topic, seq, payload)
                self.next_seq = seq + 1
            # seq < next_seq here: the replay or the snapshot already covered it
        return n

    def catch_up(self, on_batch: Callable[[bytes, int, bytes], None], until_next: int,
                 on_reset: Callable[[], None] = lambda: None, timeout_s: float = 30.0) -> None:
        """Follow until ``next_seq >= until_next`` (asking for a replay when the live stream is
        quiet: a subscription is not live at once); raises ``TimeoutError`` past ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while self.next_seq < until_next:
            if time.monotonic() > end:
                raise TimeoutError(f"next seq {self.next_seq} < {until_next} after {timeout_s} s")
            if not self.poll(on_batch, on_reset, 100) and self.next_seq < until_next and not self._replay(on_batch):
                self.bootstrap(on_batch, on_reset)

    def run(self, on_batch: Callable[[bytes, int, bytes], None], on_reset: Callable[[], None] = lambda: None,
            should_stop: Callable[[], bool] = lambda: False) -> None:
        """Bootstrap, then follow until ``should_stop()``; a refused snapshot or a timeout is
        retried after a second (the sockets reconnect by themselves)."""
        while not should_stop():
            try:
                self.poll(on_batch, on_reset)
            except (SnapshotRefused, TimeoutError):
                self.next_seq = -1
                time.sleep(1.0)
