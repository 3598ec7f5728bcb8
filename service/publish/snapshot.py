"""Snapshots on the replay socket: the whole holder set at one stream position S, paged.

Question answered: "how does a router that joins late (or restarts) hold exactly the fleet's
state without replaying from seq 0, which the replay ring no longer holds?"

**Request** (docs/kv-events.md#snapshots): on the replay ROUTER, the ordinary one-frame
request whose 8-byte seq is :data:`SNAPSHOT_SEQ` (``2**64 - 2``: all ones minus one; seq
``-1`` is the end marker). **Answer**: pages ``[identity, b"", topic, seq S, payload]``, each
payload an ordinary ``KVEventBatch`` of ``BlockStored`` events exactly as the live stream
writes them (tokens, ``block_size``, ``medium``, ``parent_block_hash`` None, the publisher's
encoding and hash form), then the end frame ``[identity, b"", b"", END_SEQ, S (8 bytes)]``.
A consumer applies the pages to an empty index, then follows the live stream from S + 1
(replaying S + 1.. as usual if it missed any). A refusal (more than ``max_snapshots`` at
once, or a publisher without snapshots) is the end marker with an *empty* payload, as a
refused replay: the consumer retries later.

**Consistent at S, ingest going on**: the publisher's thread takes the directory's lock
(the holder watch's sink runs under it, so ``S = next_seq - 1`` is exactly the state's
position), forks (as checkpoints do: ``index/checkpoint.py``), and lets go: the pause is the
fork (page tables), not the snapshot. The child reads the directory as it was at S, writes
the pages into a pipe and exits; the parent's thread drains the pipe page by page only as the
client's byte budget allows, so what this process holds per snapshot is one page plus the
pipe (64 KiB) plus the pages libzmq holds for the client (within ``client_bytes``).

**Memory at 1M chunks**: the parent, one page (``page_bytes``) + the pipe + the budget
(about 18 MiB with the defaults, whatever the size of the state). The
child: copy-on-write pages the parent rewrites meanwhile (ingest's writes during the
snapshot), plus the sorted list of ``(topic, medium, hash, row)`` it builds (about 150 bytes
an entry, an estimate: ~150 MB at 1M chunks on one spot each) and one page's token rows at a time.

**The same bytes on every replica at the same S**: the pages are a function of the holder
set alone: topics sorted, within a topic mediums sorted, within a medium hashes sorted;
pages cut at ``page_blocks`` blocks or ``page_bytes`` encoded bytes, whichever first (a page
never mixes topics); ``ts`` of every page is the stream time at S (``HolderWatch.last_ts``,
itself a function of the stream).
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

from blendmatch.index.checkpoint import enter_forked_child
from blendmatch.index.holders import HolderWatch, Spot

from .replay import FRAME_OVERHEAD, SNAPSHOT_SEQ, InFlight
from .wire import END_SEQ, EventEncoder, medium_of, seq_bytes, topic_of

__all__ = ["SNAPSHOT_SEQ", "SnapshotPager", "SnapshotServer", "holder_entries", "snapshot_pages"]

log = logging.getLogger("blendmatch.service.publish")

#: A record in the child's pipe: kind (``P`` page, ``E`` end, ``X`` error), topic and
#: payload lengths.
_REC = struct.Struct(">cII")


def holder_entries(directory: Any) -> tuple[list[tuple[str, str, bytes, int]], list[Any]]:
    """The holder set as sorted ``(topic, medium, chunk hash, k)`` and the token rows
    (``rows[k]``): every spot of every binding whose chunk has tokens
    (``index/holders.py``'s definition, through ``HolderWatch.spots_of``), read from
    ``KeyDirectory.export_state``. Call with the directory's lock held or in a forked copy
    (the rows are the directory's own: encode them before the next write)."""
    state = directory.export_state()
    spots_of = HolderWatch(lambda changes: None).spots_of
    names: dict[Spot, tuple[str, str]] = {}
    rows = state["tokens"]
    out: list[tuple[str, str, bytes, int]] = []
    for k, (h, members, tokens) in enumerate(zip(state["hashes"], state["members"], rows)):
        if tokens is None:
            continue
        for spot in spots_of(members):
            name = names.get(spot)
            if name is None:
                name = names[spot] = (topic_of(spot), medium_of(spot))
            out.append((name[0], name[1], h, k))
    out.sort()
    return out, rows


def snapshot_pages(directory: Any, encoder: EventEncoder, ts: float, *, page_blocks: int,
                   page_bytes: int) -> Iterator[tuple[bytes, bytes]]:
    """``(topic, payload)`` pages of the holder set (see the module docstring for the order)."""
    entries, all_rows = holder_entries(directory)
    i, n = 0, len(entries)
    while i < n:
        topic, medium = entries[i][0], entries[i][1]
        j = i
        while j < n and j - i < page_blocks and entries[j][0] == topic and entries[j][1] == medium:
            j += 1
        hashes = [e[2] for e in entries[i:j]]
        rows = [all_rows[e[3]] for e in entries[i:j]]
        # cut by encoded size: a row costs at most 5 bytes a token + its hash + fixed fields
        per = [5 * len(r) + len(h) + 200 for h, r in zip(hashes, rows)]
        k, size = 0, 64
        while k < len(per) and (k == 0 or size + per[k] <= page_bytes):
            size += per[k]
            k += 1
        hashes, rows = hashes[:k], rows[:k]
        same = all(len(r) == len(rows[0]) for r in rows)
        tokens: Any = np.stack(rows).astype(np.uint32, copy=False) if same else \
            [np.asarray(r, dtype=np.uint32) for r in rows]
        count, blob = encoder.stored_concat(hashes, tokens, medium)
        yield topic.encode(), encoder.batch(ts, [blob], count=count)
        i += k


def _child(directory: Any, encoder: EventEncoder, ts: float, wfd: int, page_blocks: int, page_bytes: int,
           parent: int) -> None:
    code = 1
    try:
        enter_forked_child(parent)  # the checkpoint writer's start: signals, dies with the parent, no GC
        # every other descriptor goes: the parent's sockets (a client's TCP connection, the
        # listening ports) must close when the parent closes them, not when this child exits
        os.closerange(3, wfd)
        os.closerange(wfd + 1, _max_fd())
        for topic, payload in snapshot_pages(directory, encoder, ts, page_blocks=page_blocks, page_bytes=page_bytes):
            _write_all(wfd, _REC.pack(b"P", len(topic), len(payload)) + topic + payload)
        _write_all(wfd, _REC.pack(b"E", 0, 0))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        msg = f"{type(exc).__name__}: {exc}".encode()[:4000]
        try:
            _write_all(wfd, _REC.pack(b"X", 0, len(msg)) + msg)
        except OSError:
            pass
    finally:
        os._exit(code)


#: The pipe's size: a page at once where Linux allows (``/proc/sys/fs/pipe-max-size``,
#: 1 MiB by default), so the publisher's thread reads a page in one call.
PIPE_BYTES = 1 << 20


def _widen(fd: int, page_bytes: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(PIPE_BYTES, page_bytes + 65536))
    except (ImportError, AttributeError, OSError):
        pass  # the default 64 KiB: slower, as correct


def _max_fd() -> int:
    try:
        return min(os.sysconf("SC_OPEN_MAX"), 1 << 20)
    except (ValueError, OSError):
        return 65536


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class SnapshotPager:
    """One snapshot under way: the child's pid and the pipe's read end (non-blocking), read
    one record at a time into at most one page."""

    def __init__(self, pid: int, rfd: int, seq: int) -> None:
        self.pid, self.rfd, self.seq = pid, rfd, seq
        self._buf = bytearray()
        self.done = False
        self.pause_s = 0.0  # how long ingest waited for the fork

    def next_record(self) -> Optional[tuple[bytes, bytes, bytes]]:
        """``(kind, topic, payload)`` when a whole record arrived, else None (nothing yet)."""
        while True:
            if len(self._buf) >= _REC.size:
                kind, tl, pl = _REC.unpack_from(self._buf)
                need = _REC.size + tl + pl
                if len(self._buf) >= need:
                    rec = bytes(self._buf[_REC.size:need])
                    del self._buf[:need]
                    return kind, rec[:tl], rec[tl:]
                want = need - len(self._buf)
            else:
                want = _REC.size - len(self._buf)
            try:
                got = os.read(self.rfd, max(want, 1 << 16) if want < (1 << 16) else want)
            except BlockingIOError:
                return None
            if not got:
                return b"X", b"", b"the snapshot writer died"
            self._buf += got

    def close(self) -> None:
        if self.rfd >= 0:
            os.close(self.rfd)
            self.rfd = -1
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


@dataclass
class _Snap:
    ident: bytes
    pager: SnapshotPager
    sent: InFlight = field(default_factory=InFlight)
    pending: Optional[tuple[bytes, bytes, bytes]] = None


class SnapshotServer:
    """Snapshots for the replay socket's :class:`~.replay.ReplayServer` (which calls
    :meth:`request` and :meth:`serve`). ``start(ident)`` forks a pager consistent at some
    S (the publisher's, under the directory lock); ``count(outcome)`` counts requests
    (``ok``, ``refused``, ``failed``)."""

    def __init__(self, start: Callable[[], Optional[SnapshotPager]], *, max_snapshots: int,
                 count: Callable[[str], None]) -> None:
        self._start = start
        self.max_snapshots = max_snapshots
        self._count = count
        self._snaps: dict[bytes, _Snap] = {}
        self._gone = InFlight()
        self.bytes = 0
        self.pages = 0
        self.last_pause_s = 0.0  # ingest's wait for the last snapshot's fork

    @property
    def active(self) -> int:
        return len(self._snaps)

    def request(self, zmq: Any, sock: Any, ident: bytes) -> None:
        if ident in self._snaps or len(self._snaps) >= self.max_snapshots:
            self._count("refused")
            self._send_now(zmq, sock, ident, b"")
            return
        try:
            pager = self._start()
        except Exception:  # noqa: BLE001 - a failed fork refuses this one request
            self._count("failed")
            self._send_now(zmq, sock, ident, b"")
            raise
        if pager is None:  # no directory attached: nothing to snapshot
            self._count("refused")
            self._send_now(zmq, sock, ident, b"")
            return
        self._count("ok")
        self.last_pause_s = pager.pause_s
        self._snaps[ident] = _Snap(ident, pager)

    @staticmethod
    def _send_now(zmq: Any, sock: Any, ident: bytes, payload: bytes) -> None:
        try:
            sock.send_multipart((ident, b"", b"", END_SEQ, payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def serve(self, zmq: Any, sock: Any, fits: Callable[[InFlight, int], bool], budget: int) -> int:
        """Send pages as budgets allow, at most ``budget`` bytes; what is left of it.
        ``fits(client_inflight, need)`` is the replay server's budget rule."""
        freed = self._gone.reap()
        for snap in self._snaps.values():
            freed += snap.sent.reap()
        self.bytes -= freed
        for ident in list(self._snaps):
            snap = self._snaps[ident]
            while budget > 0 and not snap.pager.done:
                rec = snap.pending or snap.pager.next_record()
                if rec is None:
                    break
                kind, topic, payload = rec
                snap.pending = rec
                if kind == b"P":
                    need = len(payload) + len(topic) + FRAME_OVERHEAD
                    frame = zmq.Frame(payload, copy=False, track=True)
                    parts = (ident, b"", topic, seq_bytes(snap.pager.seq), frame)
                else:  # the end (or the writer failed: the end marker, empty, as a refusal)
                    need = FRAME_OVERHEAD
                    if kind == b"X":
                        self._count("failed")
                        log.warning("kv-events: a snapshot writer failed (%s): answered with the empty end marker",
                                    payload.decode(errors="replace"))
                    frame = zmq.Frame(seq_bytes(snap.pager.seq) if kind == b"E" else b"", copy=False, track=True)
                    parts = (ident, b"", b"", END_SEQ, frame)
                if not fits(snap.sent, need):
                    break
                try:
                    sock.send_multipart(parts, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EHOSTUNREACH:
                        raise
                    snap.pager.done = True  # it left
                    break
                snap.pending = None
                snap.sent.add(frame.tracker, need)
                self.bytes += need
                budget -= need
                if kind == b"P":
                    self.pages += 1
                else:
                    snap.pager.done = True
            if snap.pager.done:
                snap.pager.close()
                self._gone.take(snap.sent)
                del self._snaps[ident]
        return budget

    def close(self) -> None:
        for snap in self._snaps.values():
            snap.pager.close()
        self._snaps.clear()


def fork_pager(directory: Any, encoder: EventEncoder, seq_now: Callable[[], int], ts_now: Callable[[], float], *,
               page_blocks: int, page_bytes: int) -> SnapshotPager:
    """Fork a child that writes the holder set's pages, consistent at S = ``seq_now() - 1``
    (read under the directory's lock, as the fork); the pager carries N = S + 1."""
    t0 = time.perf_counter()
    with directory.ingest_lock:
        seq = seq_now()  # N = S + 1: the first live seq the consumer applies after the pages
        ts = ts_now()
        rfd, wfd = os.pipe()
        _widen(wfd, page_bytes)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(rfd)
            _child(directory, encoder, ts, wfd, page_blocks, page_bytes, parent)
    pause = time.perf_counter() - t0  # ingest waited this long (the lock, then the fork)
    os.close(wfd)
    os.set_blocking(rfd, False)
    pager = SnapshotPager(pid, rfd, seq)
    pager.pause_s = pause
    return pager
