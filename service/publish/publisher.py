"""The admitted stream, republished as vLLM KV events: a ZMQ PUB socket plus a ROUTER replay.

Question answered: "how does a router that speaks vLLM's KV events (Dynamo, llm-d, SGLang's
gateway) learn what the fleet's LMCache tiers hold?" The directory's holder watch
(``index/holders.py``) hands :meth:`KVEventsPublisher.sink` the holder-set changes of every
batch boundary, under the directory lock. The sink turns them into messages (one per topic
touched: ``[topic, seq, EventBatch]``), numbers them, and puts them on a bounded queue; one
thread encodes (``wire.py``) and sends them. So:

- **deterministic**: a message's seq, topic, ts and events are a function of the applied
  stream alone (seq advances with it, ts is the batch's own ``ts``), so replicas that apply
  the same log publish byte-identical ``(topic, seq, payload)`` streams, and a restarted
  replica (seq in its checkpoint, section ``kv_events``) re-publishes from its checkpoint
  the very messages it had published (a subscriber drops seqs it has seen).
- **never blocks ingest**: the sink only numbers and queues; a full queue (in messages or
  in bytes) drops the message (its seq is spent: subscribers see a gap and may replay it
  from another replica) and counts it.
- **bounded in bytes** (docs/kv-events.md#bounds): the queue by ``max_queue_bytes`` (each
  message counted at the bound of its encoded size, :func:`plan_messages`, which is above
  the token rows and hashes it holds); a message by ``max_message_bytes`` (a bigger batch
  is split, each part its own seq); each PUB subscriber's queue by its high-water mark in
  messages, ``min(hwm, subscriber_bytes // max_message_bytes)``, so by
  ``subscriber_bytes``; the replay ring and the replay clients in ``replay.py``. Payloads
  go to libzmq zero-copy and tracked: the gauges say what libzmq still holds.
- **replay** (vLLM's protocol, ``replay.py``): a request is one frame, the 8-byte
  big-endian start seq; the answer is every buffered message with seq >= start as
  ``[identity, b"", topic, seq, payload]`` (``legacy_replay``: without the topic frame, as
  vLLM before #45177), then the end marker seq -1 with an empty payload, sent as the
  client's byte budget allows. Anything else is ignored and counted.
- **fences**: on each topic of a fenced instance, ``AllBlocksCleared`` when the fence
  leaves nothing on the topic (the usual case: only its L1 is there), else
  ``BlockRemoved`` of the fenced chunks (its private L2 copies outlive a restart).
- **a cleared directory** (a Kafka replica's resync after the log was reset):
  ``AllBlocksCleared`` on every topic that held blocks, in topic order, numbered like any
  message (the same seqs on every replica that applied the same stream), before anything
  of the rebuilt state.

Endpoints follow vLLM's ``KVEventsConfig``: the PUB endpoint binds when it contains ``*``,
``::``, ``ipc://`` or ``inproc://`` and connects otherwise; the replay endpoint binds.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Optional

from blendmatch.index.holders import HolderChanges, HolderWatch

from .replay import InFlight, ReplayRing, ReplayServer
from .snapshot import SnapshotPager, SnapshotServer, fork_pager
from .wire import EventEncoder, medium_of, seq_bytes, topic_of

__all__ = ["KVEventsSettings", "KVEventsPublisher", "EndpointNotAllowed", "is_bind_endpoint", "is_local_endpoint",
           "plan_messages", "BUFFERS"]

log = logging.getLogger(__name__)

#: Bytes of a message besides its events (the ``EventBatch`` array, ts, rank), bounded.
MESSAGE_OVERHEAD = 64
#: Bytes of one event besides its block hashes, token ids and medium (keys and fixed
#: fields: ``BlockStored`` writes about 130), bounded.
EVENT_OVERHEAD = 160
#: The ``buffer`` label values of ``blendmatch_kv_events_bytes``.
BUFFERS = ("queue", "replay_buffer", "subscribers", "replay_clients", "snapshot_clients")
#: The ROUTER's high-water mark per client, in messages: the byte budgets bind first; this
#: bounds what a refused client (answered at once, never tracked) can queue.
REPLAY_HWM = 1000
#: Live payloads of at least this many bytes go to libzmq zero-copy and tracked (counted in
#: the ``subscribers`` gauge); smaller ones are copied, untracked: a tracker (an Event and a
#: round trip through pyzmq's garbage thread) doubled the cost of publishing small messages.
#: They are bounded all the same by the high-water mark: at most ``pub_hwm`` x this per
#: subscriber (1 MiB at the defaults) is left out of the gauge.
TRACK_MIN_BYTES = 4096


class EndpointNotAllowed(ValueError):
    """An endpoint beyond loopback without the access file's grant."""


@dataclass(frozen=True)
class KVEventsSettings:
    """What ``--kv-events-*`` configure (vLLM's ``KVEventsConfig`` names)."""

    endpoint: str
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    encoding: str = "map"
    int_hashes: bool = False
    legacy_replay: bool = False
    max_queue: int = 100_000
    #: from the access file's ``[kv_events]`` table (``service/access.py``)
    expose: bool = False
    curve_secret_key_file: Optional[str] = None
    curve_clients_dir: Optional[str] = None
    #: byte bounds (``ServiceConfig``'s ``kv_events_*_bytes``, ``kv_events_max_replays``)
    buffer_bytes: int = 64 << 20
    max_queue_bytes: int = 64 << 20
    max_message_bytes: int = 256 << 10
    subscriber_bytes: int = 64 << 20
    replay_client_bytes: int = 16 << 20
    replay_bytes: int = 64 << 20
    max_replays: int = 8
    #: snapshots (``snapshot.py``): a page's bounds, and how many at once
    snapshot_page_blocks: int = 1024
    snapshot_page_bytes: int = 1 << 20
    max_snapshots: int = 2

    @property
    def pub_hwm(self) -> int:
        """The PUB socket's high-water mark in messages: ``hwm`` (0: none) and at most
        ``subscriber_bytes // max_message_bytes``, so a subscriber's queue stays within
        ``subscriber_bytes``."""
        by_bytes = max(1, self.subscriber_bytes // self.max_message_bytes)
        return min(self.hwm, by_bytes) if self.hwm else by_bytes


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def is_local_endpoint(endpoint: str) -> bool:
    """Whether an endpoint stays on this host's loopback (or is ipc/inproc)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    if ";" in host:  # tcp://src;dst: the destination decides
        host = host.split(";", 1)[1]
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: beyond loopback


class KVEventsPublisher:
    """See the module docstring. ``registry``: a prometheus ``CollectorRegistry`` for the
    metrics (None: counters only in :meth:`stats`)."""

    def __init__(self, settings: KVEventsSettings, registry: Any = None) -> None:
        for ep in filter(None, (settings.endpoint, settings.replay_endpoint)):
            if not is_local_endpoint(ep) and not settings.expose:
                raise EndpointNotAllowed(
                    f"KV-events endpoint {ep} is beyond loopback: every tenant's token ids flow on it, so it needs "
                    f"an explicit grant: an access file (--access-file) with `[kv_events]` `expose = true` "
                    f"(docs/security.md)")
        if settings.buffer_steps < 1 or settings.hwm < 0 or settings.max_queue < 1:
            raise ValueError("kv-events buffer steps and queue size must be >= 1, hwm >= 0")
        sizes = {name: getattr(settings, name) for name in ("buffer_bytes", "max_queue_bytes", "subscriber_bytes",
                                                            "replay_client_bytes", "replay_bytes", "max_replays",
                                                            "snapshot_page_blocks", "snapshot_page_bytes",
                                                            "max_snapshots")}
        if min(sizes.values()) < 1 or settings.max_message_bytes < 4096:
            raise ValueError(f"kv-events byte bounds and max_replays must be >= 1 and max_message_bytes >= 4096, "
                             f"got {sizes}, max_message_bytes {settings.max_message_bytes}")
        self.settings = settings
        self.encoder = EventEncoder(settings.encoding, settings.int_hashes)
        self.watch = HolderWatch(self.sink)
        self._next_seq = 0
        self._counts: dict[str, dict[str, int]] = {}  # topic -> medium -> chunks published there
        self._queue: queue.Queue = queue.Queue(maxsize=settings.max_queue)
        self._queued_bytes = 0  # the queue's items, at plan_messages' bound; under _queued_lock
        self._queued_lock = threading.Lock()
        self._buffer = ReplayRing(settings.buffer_steps, settings.buffer_bytes)
        self._live = InFlight()  # payloads the PUB socket still holds for some subscriber
        self._replays: Optional[ReplayServer] = None
        self._directory: Any = None  # snapshots read it (attach_directory)
        self._thread: Optional[threading.Thread] = None
        self._running = False
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._auth: Any = None
        self.bound_endpoint: Optional[str] = None
        self.bound_replay_endpoint: Optional[str] = None
        self.counters = {"batches": 0, "dropped": 0, "tokenless": 0, "send_errors": 0, "replay_requests": 0,
                         "replay_bad_requests": 0, "replay_refused": 0, "snapshot_requests": 0,
                         "snapshot_refused": 0, "snapshot_failed": 0}
        self.events = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self._metrics = _Metrics(registry, self) if registry is not None else None

    # ------------------------------------------------------------------ the sink (directory lock held)
    def sink(self, changes: HolderChanges) -> None:
        """Number and queue the messages of one batch boundary (never blocks)."""
        msgs: dict[str, list[tuple]] = {}
        counts = self._counts
        if changes.cleared:
            for topic in sorted(t for t, held in counts.items() if any(held.values())):
                msgs[topic] = [("clear",)]
            counts.clear()
        if changes.tokenless:
            self.counters["tokenless"] += changes.tokenless
            if self._metrics:
                self._metrics.tokenless.inc(changes.tokenless)
        if changes.fenced is not None and changes.fence_removed:
            by_topic: dict[str, dict[str, list[bytes]]] = {}
            for spot, hashes in changes.fence_removed.items():
                by_topic.setdefault(topic_of(spot), {}).setdefault(medium_of(spot), []).extend(hashes)
            for topic, by_medium in by_topic.items():
                held = counts.setdefault(topic, {})
                if sum(held.values()) == sum(map(len, by_medium.values())):
                    msgs.setdefault(topic, []).append(("clear",))
                    held.clear()
                    continue
                for medium, hashes in by_medium.items():
                    msgs.setdefault(topic, []).append(("removed", hashes, medium))
                    held[medium] -= len(hashes)
        for spot, hashes in changes.removed.items():
            topic, medium = topic_of(spot), medium_of(spot)
            msgs.setdefault(topic, []).append(("removed", hashes, medium))
            held = counts.setdefault(topic, {})
            held[medium] = held.get(medium, 0) - len(hashes)
        for spot, chunks in changes.stored.items():
            topic, medium = topic_of(spot), medium_of(spot)
            msgs.setdefault(topic, []).append(("stored", chunks.hashes, chunks.tokens, medium))
            held = counts.setdefault(topic, {})
            held[medium] = held.get(medium, 0) + len(chunks.hashes)
        if not msgs:
            return
        item = []
        cost = 0
        cap = self.settings.max_message_bytes
        for topic, specs in msgs.items():
            for part, nbytes in plan_messages(specs, cap):
                item.append((topic.encode(), self._next_seq, changes.ts, part, nbytes))
                self._next_seq += 1
                cost += nbytes
        try:
            with self._queued_lock:
                # an empty queue takes any batch (one batch over the bound goes alone)
                if self._queued_bytes and self._queued_bytes + cost > self.settings.max_queue_bytes:
                    raise queue.Full
                self._queue.put_nowait(item)
                self._queued_bytes += cost
        except queue.Full:
            self.counters["dropped"] += len(item)
            if self._metrics:
                self._metrics.dropped.inc(len(item))
            if self.counters["dropped"] == len(item) or self.counters["dropped"] % 10_000 < len(item):
                log.warning("kv-events queue full: dropped %d messages so far (seq %d..%d this time)",
                            self.counters["dropped"], item[0][1], item[-1][1])

    # ------------------------------------------------------------------ checkpoint section
    def snapshot(self) -> dict[str, Any]:
        """The ``kv_events`` checkpoint section (called with the directory lock held)."""
        return {"version": 1, "next_seq": self._next_seq, "last_ts": self.watch.last_ts,
                "counts": {t: dict(m) for t, m in self._counts.items() if any(m.values())}}

    def restore(self, doc: dict[str, Any]) -> None:
        if doc.get("version") != 1:
            raise ValueError(f"unsupported kv_events section version {doc.get('version')!r}")
        self._next_seq = int(doc["next_seq"])
        self.watch.last_ts = float(doc["last_ts"])
        self._counts = {str(t): {str(m): int(n) for m, n in ms.items()} for t, ms in doc["counts"].items()}
        log.info("kv-events: restored seq %d from the checkpoint", self._next_seq)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def attach_directory(self, directory: Any) -> None:
        """Set the holder watch on ``directory`` and let snapshots read it (``snapshot.py``)."""
        self._directory = directory
        directory.set_holder_watch(self.watch)

    def _fork_snapshot(self) -> Optional[SnapshotPager]:
        d = self._directory
        if d is None:
            return None
        s = self.settings
        return fork_pager(d, self.encoder, lambda: self._next_seq, lambda: self.watch.last_ts,
                          page_blocks=s.snapshot_page_blocks, page_bytes=s.snapshot_page_bytes)

    def _count_snapshot(self, outcome: str) -> None:
        self.counters["snapshot_requests"] += 1
        if outcome != "ok":
            self.counters[f"snapshot_{outcome}"] += 1
        if self._metrics:
            self._metrics.snapshots.labels(outcome).inc()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Create the sockets (errors raise here, before anything is served) and the thread."""
        import zmq

        s = self.settings
        self.encoder.warm_up()
        self._ctx = zmq.Context()
        try:
            curve = self._curve_keys(zmq)
            pub = self._pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, s.pub_hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self._secure(pub, curve)
            if is_bind_endpoint(s.endpoint):
                pub.bind(s.endpoint)
                self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(s.endpoint)
                self.bound_endpoint = s.endpoint
            if s.replay_endpoint:
                rep = self._replay = self._ctx.socket(zmq.ROUTER)
                rep.setsockopt(zmq.SNDHWM, REPLAY_HWM)  # the byte budgets bind first (replay.py)
                rep.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a client that left fails the send: its cursor goes
                rep.setsockopt(zmq.LINGER, 0)
                self._secure(rep, curve)
                rep.bind(s.replay_endpoint)
                self.bound_replay_endpoint = rep.getsockopt_string(zmq.LAST_ENDPOINT)
                self._replays = ReplayServer(rep, self._buffer, legacy=s.legacy_replay,
                                             client_bytes=s.replay_client_bytes, total_bytes=s.replay_bytes,
                                             max_clients=s.max_replays, count=self._count_replay)
                self._replays.snapshots = SnapshotServer(self._fork_snapshot, max_snapshots=s.max_snapshots,
                                                         count=self._count_snapshot)
        except Exception:
            self._close()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="blendmatch-kv-events", daemon=True)
        self._thread.start()
        log.info("kv-events: publishing on %s (%s encoding%s), replay %s, from seq %d", self.bound_endpoint,
                 s.encoding, ", int hashes" if s.int_hashes else "", self.bound_replay_endpoint or "off",
                 self._next_seq)

    def _curve_keys(self, zmq: Any) -> Optional[tuple[bytes, bytes]]:
        s = self.settings
        if not s.curve_secret_key_file:
            return None
        import zmq.auth

        public, secret = zmq.auth.load_certificate(s.curve_secret_key_file)
        if not secret:
            raise ValueError(f"{s.curve_secret_key_file} holds no secret key (a zmq certificate's .key_secret file)")
        if s.curve_clients_dir:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=s.curve_clients_dir)
        return public, secret

    @staticmethod
    def _secure(sock: Any, curve: Optional[tuple[bytes, bytes]]) -> None:
        if curve is not None:
            sock.curve_secretkey = curve[1]
            sock.curve_publickey = curve[0]
            sock.curve_server = True

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout``), then close the sockets."""
        if self._thread is not None:
            self._running = False
            self._thread.join(timeout)
            self._thread = None
        self._close()

    def _close(self) -> None:
        if self._replays is not None and self._replays.snapshots is not None:
            self._replays.snapshots.close()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = self._replays = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        import zmq

        get = self._queue.get
        while self._running or not self._queue.empty():
            busy = False
            if self._replays is not None:
                try:
                    busy = self._replays.serve()
                except Exception:  # noqa: BLE001 - the thread must outlive any one request
                    self.counters["send_errors"] += 1
                    log.exception("kv-events: a replay could not be served")
            if len(self._live):
                # libzmq frees a departed subscriber's queue when the socket processes its
                # commands, which it does only when called: ask it for its events
                self._pub.getsockopt(zmq.EVENTS)
                self._live.reap()
            snaps = self._replays.snapshots if self._replays is not None else None
            try:  # a snapshot under way waits on its writer's pipe: look again soon
                item = get(block=not busy, timeout=0.001 if snaps is not None and snaps.active else 0.02)
            except queue.Empty:
                continue
            try:
                self._send(item)
            except Exception:  # noqa: BLE001 - the thread must outlive any one message
                self.counters["send_errors"] += 1
                log.exception("kv-events: a message could not be sent")
            finally:
                with self._queued_lock:
                    self._queued_bytes -= sum(message[4] for message in item)
                self._queue.task_done()

    def _send(self, item: list[tuple]) -> None:
        import zmq

        enc = self.encoder
        pub = self._pub
        for topic, seq, ts, specs, _ in item:
            events: list[bytes] = []
            count = 0
            for spec in specs:
                kind = spec[0]
                if kind == "stored":
                    n, blob = enc.stored_concat(spec[1], spec[2], spec[3])
                    self.events["BlockStored"] += n
                    count += n
                    events.append(blob)
                elif kind == "removed":
                    events.append(enc.removed(spec[1], spec[2]))
                    self.events["BlockRemoved"] += 1
                    count += 1
                else:
                    events.append(enc.cleared())
                    self.events["AllBlocksCleared"] += 1
                    count += 1
            payload = enc.batch(ts, events, count=count)
            sb = seq_bytes(seq)
            self._buffer.append(topic, seq, payload)
            if len(payload) >= TRACK_MIN_BYTES:
                frame = zmq.Frame(payload, copy=False, track=True)  # not copied; tracked: the gauge
                pub.send_multipart((topic, sb, frame), flags=zmq.NOBLOCK)
                self._live.add(frame.tracker, len(payload) + len(topic) + 8)
            else:  # copied by pyzmq, untracked (a tracker costs more than such a message)
                pub.send_multipart((topic, sb, payload), flags=zmq.NOBLOCK)
            self.counters["batches"] += 1
            if self._metrics:
                self._metrics.observe(specs, seq)

    def _count_replay(self, outcome: str) -> None:
        self.counters["replay_requests"] += 1
        if outcome == "bad":
            self.counters["replay_bad_requests"] += 1
        elif outcome == "refused":
            self.counters["replay_refused"] += 1
        if self._metrics:
            self._metrics.replays.labels(outcome).inc()

    # ------------------------------------------------------------------ reads
    def held_bytes(self) -> dict[str, int]:
        """Bytes held per buffer (:data:`BUFFERS`): the queue at its messages' encoded-size
        bound, the replay ring, and what libzmq still holds of the payloads handed to it for
        PUB subscribers and replay clients (shared between subscribers: counted once)."""
        replays = self._replays
        return {"queue": self._queued_bytes, "replay_buffer": self._buffer.bytes, "subscribers": self._live.bytes,
                "replay_clients": replays.bytes if replays is not None else 0,
                "snapshot_clients": replays.snapshots.bytes if replays is not None and replays.snapshots else 0}

    def stats(self) -> dict[str, Any]:
        replays = self._replays
        snaps = replays.snapshots if replays is not None else None
        return {"endpoint": self.bound_endpoint, "replay_endpoint": self.bound_replay_endpoint,
                "encoding": self.settings.encoding, "int_hashes": self.settings.int_hashes,
                "next_seq": self._next_seq, "queued": self._queue.qsize(), "buffered": len(self._buffer),
                "buffer_evicted": self._buffer.evicted, "pub_hwm": self.settings.pub_hwm,
                "replay_clients": replays.clients if replays is not None else 0,
                "snapshots": snaps.active if snaps is not None else 0,
                "snapshot_pause_s": snaps.last_pause_s if snaps is not None else 0.0,
                "replayed": replays.replayed if replays is not None else 0,
                **self.counters, "bytes": self.held_bytes(), "events": dict(self.events)}

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Until every queued message was sent (tests, benchmarks); False on timeout."""
        import time

        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True


class _Metrics:
    def __init__(self, registry: Any, pub: KVEventsPublisher) -> None:
        from prometheus_client import Counter, Gauge

        r = registry
        self.batches = Counter("blendmatch_kv_events_batches", "KV-event messages published (one EventBatch each)",
                               registry=r)
        self.events = Counter("blendmatch_kv_events_events", "KV events published, by type", ["type"], registry=r)
        self.dropped = Counter("blendmatch_kv_events_dropped", "messages dropped because the publish queue was "
                                                               "full (their seqs are gaps)", registry=r)
        self.tokenless = Counter("blendmatch_kv_events_tokenless", "first placements of chunks without tokens, "
                                                                   "not published", registry=r)
        self.replays = Counter("blendmatch_kv_events_replay_requests", "replay requests, by outcome (ok, bad: "
                                                                       "ignored, refused: answered with the end "
                                                                       "marker alone)", ["outcome"], registry=r)
        held = Gauge("blendmatch_kv_events_bytes", "bytes held per KV-events buffer (queue, replay_buffer, "
                     "subscribers, replay_clients)", ["buffer"], registry=r)
        for name in BUFFERS:
            held.labels(name).set_function(lambda name=name: pub.held_bytes()[name])
        Gauge("blendmatch_kv_events_replay_clients", "clients with a replay under way or not yet taken",
              registry=r).set_function(lambda: pub._replays.clients if pub._replays is not None else 0)
        self.snapshots = Counter("blendmatch_kv_events_snapshot_requests", "snapshot requests, by outcome (ok, "
                                 "refused: over --kv-events-max-snapshots, answered with the end marker alone; "
                                 "failed: the snapshot writer failed)", ["outcome"], registry=r)
        Gauge("blendmatch_kv_events_snapshot_clients", "snapshots under way", registry=r).set_function(
            lambda: pub._replays.snapshots.active if pub._replays is not None and pub._replays.snapshots else 0)
        self.seq = Gauge("blendmatch_kv_events_last_seq", "seq of the last message published", registry=r)

    def observe(self, specs: list[tuple], seq: int) -> None:
        self.batches.inc()
        for spec in specs:
            if spec[0] == "stored":
                self.events.labels("BlockStored").inc(len(spec[1]))
            elif spec[0] == "removed":
                self.events.labels("BlockRemoved").inc()
            else:
                self.events.labels("AllBlocksCleared").inc()
        self.seq.set(seq)


def plan_messages(specs: list[tuple], cap: int) -> list[tuple[list[tuple], int]]:
    """One topic's event specs of one batch boundary cut into messages of at most ``cap``
    encoded bytes, in order: ``[(specs, bound of the encoded size), ...]``. A spec is cut
    between chunks (a ``stored`` or ``removed`` part per message); a single chunk larger
    than ``cap`` goes alone. The bound per chunk: its hash + 9, 5 bytes per token (msgpack's
    widest uint32), :data:`EVENT_OVERHEAD` and the medium, per event; so it also bounds the
    memory a queued message holds (4 bytes per token, the hashes, Python's headers)."""
    out: list[tuple[list[tuple], int]] = []
    cur: list[tuple] = []
    size = MESSAGE_OVERHEAD
    for spec in specs:
        kind = spec[0]
        if kind not in ("stored", "removed"):
            if cur and size + EVENT_OVERHEAD > cap:
                out.append((cur, size))
                cur, size = [], MESSAGE_OVERHEAD
            cur.append(spec)
            size += EVENT_OVERHEAD
            continue
        hashes = spec[1]
        n = len(hashes)
        per = max(map(len, hashes), default=0) + 9
        if kind == "stored":
            tokens = spec[2]
            per += 5 * (tokens.shape[1] if getattr(tokens, "ndim", 0) == 2 else max(map(len, tokens), default=0))
        fixed = EVENT_OVERHEAD + len(spec[-1]) + 8
        if size + fixed + n * per <= cap:  # the usual case: whole
            cur.append(spec)
            size += fixed + n * per
            continue
        i = 0
        while i < n:
            k = (cap - size - fixed) // per
            if k <= 0 and cur:
                out.append((cur, size))
                cur, size = [], MESSAGE_OVERHEAD
                continue
            j = min(n, i + max(1, k))
            part = ("stored", hashes[i:j], spec[2][i:j], spec[3]) if kind == "stored" else \
                ("removed", hashes[i:j], spec[2])
            cur.append(part)
            size += fixed + (j - i) * per
            i = j
    if cur:
        out.append((cur, size))
    return out
