"""The Kafka event source: follow LMCache's cache-event topic, append to it, and share the
instance registry and the reaper role through it (``--event-transport kafka``).

Question answered: "how do N replicas that never talk to each other hold the same index,
the same registry, and agree on expiry?" They apply the same log, in the same order per
partition, through the same gate. Layout, rules and failure costs: ``docs/fleet.md``.

Consuming. Every replica consumes **every partition** by **manual assignment**
(``assign()``, no consumer-group membership on the data path): a replica joining, dying or
restarting never triggers a rebalance that would pause the others, and no broker-side
group state can hand a partition to "someone else". The group id is only the namespace of
committed offsets: ``<--kafka-group-id>-<replica id>``, so replicas never overwrite each
other's offsets. Start position per partition: the checkpoint's ``stream_position``
section; without one, the committed offsets; otherwise offset 0 (the earliest: a log
trimmed by retention answers out-of-range and ``auto.offset.reset=earliest`` applies).
Offsets are committed after apply (every second and on a clean stop), unlike LMCache.

Applying. The fetch thread consumes a run of up to 200 records and splits the token arrays
out of each (``wire.split_event_body``, no GIL held); the apply thread validates the run,
takes the directory lock, applies it in log order (consecutive event records through one
``KeyDirectory.apply_many``: the gate drops redelivered batches, and their new contents
enter the blend index in one insert) and advances the per-partition position inside the
same lock, so a checkpoint (which snapshots under that lock) always holds a position that
matches its state exactly. The split of run k+1 overlaps the apply of run k; the fetch
thread runs almost no Python, so the two barely contend for the GIL (measured: parsing
whole records there was slower than one thread doing everything). A record that
does not decode or validate is skipped, counted (``reason``) and logged with its partition
and offset, and the position moves past it: a poison record never stalls a partition.

Producing. ``POST /events`` and the registry routes append records with an idempotent
producer (``acks=all``) and answer once the broker acknowledged; this replica applies them
when it consumes them, like every other replica.

The reaper role. Every replica is a member of the consumer group ``<group>-reaper`` on the
one-partition topic ``<topic>-reaper`` (``--kafka-reaper-topic``); the member that owns
partition 0 holds the role. The broker moves it when the holder leaves (at once) or dies
(after ``--kafka-session-timeout-ms``). Only the holder publishes expiry fences
(``records.py``); every replica applies them.

``confluent_kafka`` is imported when this module is, and this module only in Kafka mode.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
import time
from typing import Any, Callable, Optional

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client import Counter, Gauge

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.logsafe import log_safe
from blendmatch.index.registry import InstanceRegistry
from blendmatch.index.wire import EventValidationError, parse_event_body, parse_event_request, split_event_body

from ..errors import LimitExceeded, ServiceUnavailable
from .control import apply_control
from .records import (CONTROL_HEADER, CONTROL_HEADER_VALUE, ControlRecordError, control_value, decode_control,
                      is_control, lmcache_record_value)

__all__ = ["KafkaSource", "SECTION"]

#: Largest record the producer sends (librdkafka's default ``message.max.bytes``; brokers
#: default to about the same). One LMCache batch is one record, so this bounds a batch
#: appended through ``POST /events``: about 500 entries of 256 tokens as JSON lists.
MAX_RECORD_BYTES = 1_000_000

log = logging.getLogger("blendmatch.service.kafka")

#: The checkpoint section that holds the log position.
SECTION = "stream_position"
_CONSUME_MAX = 200         # records per apply run (one directory-lock hold)
_RUNS_QUEUED = 2           # split runs waiting for the apply thread (memory: ~2 x 200 records)
_COMMIT_EVERY_S = 1.0
_METADATA_EVERY_S = 10.0
_SKIP_LOG_FIRST = 20       # skipped records logged one by one, then every 1000th


class KafkaSource:
    """One replica's side of the log (see the module docstring)."""

    def __init__(self, config: Any, *, directory: Callable[[], KeyDirectory], registry: InstanceRegistry,
                 metrics: Any, restored: Callable[[], bool], fatal: Callable[[], Optional[BaseException]],
                 note_ingested: Callable[[int], None] = lambda n: None) -> None:
        self.config = config
        self.topic = config.kafka_topic
        self.bootstrap = config.kafka_bootstrap_servers
        self.replica_id = config.replica_id or socket.gethostname()
        self.group_id = f"{config.kafka_group_id}-{self.replica_id}"
        self.reaper_group = f"{config.kafka_group_id}-reaper"
        self.reaper_topic = config.kafka_reaper_topic or f"{self.topic}-reaper"
        self._directory = directory
        self._registry = registry
        self._metrics = metrics
        self._restored = restored
        self._fatal = fatal
        self._note_ingested = note_ingested  # the service's gc.freeze policy (ServiceContext)
        self._next: dict[int, int] = {}          # partition -> next offset to apply
        self._restored_next: Optional[dict[int, int]] = None
        self._hb_pos: dict[str, tuple[int, int]] = {}  # instance -> its last register/heartbeat record
        self._lag: dict[int, int] = {}
        self._partitions: list[int] = []
        self._applied_cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._producer: Optional[Producer] = None
        self._consumer: Optional[Consumer] = None
        self.holds_reaper_role = False
        self.records_applied = 0
        self.entries_applied = 0
        self.records_skipped = 0
        self._committed_next: dict[int, int] = {}
        self.error: Optional[str] = None
        r = metrics.registry
        self.m_lag = Gauge("blendmatch_kafka_lag_records", "records in the partition not yet applied", ["partition"],
                           registry=r)
        self.m_position = Gauge("blendmatch_kafka_position", "next offset to apply", ["partition"], registry=r)
        self.m_records = Counter("blendmatch_kafka_records_applied", "records applied", ["kind"], registry=r)
        self.m_entries = Counter("blendmatch_kafka_entries_applied", "entries of applied cache-event batches",
                                 registry=r)
        self.m_skipped = Counter("blendmatch_kafka_records_skipped", "records skipped (undecodable or invalid)",
                                 ["reason"], registry=r)
        self.m_published = Counter("blendmatch_kafka_records_published", "records appended by this replica",
                                   ["kind"], registry=r)
        self.m_reaper = Gauge("blendmatch_kafka_reaper_role", "1 while this replica holds the reaper role",
                              registry=r)

    # ------------------------------------------------------------------ checkpoint section
    def snapshot(self) -> dict[str, Any]:
        """Called with the directory lock held (ingest paused): matches the state exactly."""
        return {"version": 1, "topic": self.topic, "next": {str(p): o for p, o in sorted(self._next.items())},
                "control": {iid: list(pos) for iid, pos in self._hb_pos.items()}}

    def restore(self, doc: dict[str, Any]) -> None:
        if doc.get("version") != 1:
            raise ValueError(f"unsupported stream_position version {doc.get('version')!r}")
        if doc.get("topic") != self.topic:
            log.warning("checkpoint position is for topic %r, not %r: ignored", doc.get("topic"), self.topic)
            return
        self._restored_next = {int(p): int(o) for p, o in doc["next"].items()}
        self._next = dict(self._restored_next)
        self._hb_pos = {str(i): (int(p), int(o)) for i, (p, o) in doc.get("control", {}).items()}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._producer = Producer({"bootstrap.servers": self.bootstrap, "client.id": f"blendmatch-{self.replica_id}",
                                   "enable.idempotence": True, "acks": "all", "linger.ms": 1,
                                   "message.timeout.ms": 30_000, "message.max.bytes": MAX_RECORD_BYTES})
        for target, name in ((self._consume_loop, "blendmatch-kafka"), (self._producer_loop, "blendmatch-kafka-producer"),
                             (self._reaper_loop, "blendmatch-kafka-reaper")):
            t = threading.Thread(target=self._guard(target), name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported through stats and readiness
                self.error = f"{type(exc).__name__}: {exc}"
                log.exception("kafka thread %s died", threading.current_thread().name)
        return run

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)
        self._threads = []
        if self._producer is not None:
            left = self._producer.flush(5.0)
            if left:
                log.warning("%d appended records were not acknowledged before the stop", left)

    # ------------------------------------------------------------------ consuming
    def _ensure_topics(self) -> None:
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        md = admin.list_topics(timeout=10)
        want = [NewTopic(self.reaper_topic, 1, 1)] if self.reaper_topic not in md.topics else []
        if self.topic not in md.topics:
            log.warning("topic %s does not exist: creating it with one partition", self.topic)
            want.append(NewTopic(self.topic, 1, 1))
        for name, fut in (admin.create_topics(want).items() if want else ()):
            try:
                fut.result(10)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise

    def _list_partitions(self, consumer: Consumer) -> list[int]:
        md = consumer.list_topics(timeout=10)  # all topics: naming one would auto-create it
        topic = md.topics.get(self.topic)
        if topic is None or topic.error is not None:
            return []
        return sorted(topic.partitions)

    def _start_offsets(self, consumer: Consumer, partitions: list[int]) -> dict[int, int]:
        """Checkpoint > committed offsets (of this replica's group) > 0 (earliest)."""
        out: dict[int, int] = {}
        missing = [p for p in partitions if p not in self._next]
        committed: dict[int, int] = {}
        if missing and self._restored_next is None:
            for tp in consumer.committed([TopicPartition(self.topic, p) for p in missing], timeout=10):
                if tp.error is None and tp.offset >= 0:
                    committed[tp.partition] = tp.offset
        for p in partitions:
            out[p] = self._next.get(p, committed.get(p, 0))
        if committed:
            log.info("resuming from committed offsets of %s: %s", self.group_id, committed)
        return out

    def _consume_loop(self) -> None:
        while not self._restored() and not self._stop.is_set():
            if self._fatal() is not None:
                return
            time.sleep(0.02)
        if self._stop.is_set():
            return
        self._ensure_topics()
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group_id,
                             "client.id": f"blendmatch-{self.replica_id}", "enable.auto.commit": False,
                             "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
                             "fetch.wait.max.ms": 50, "enable.partition.eof": False,
                             # librdkafka's default (1000 ms) pauses fetching for a second whenever
                             # its queue passes 64 MB (~1,400 of LMCache's 45 KB records): measured,
                             # a replica waited 1.5 s per 200k entries in consume() for it
                             "fetch.queue.backoff.ms": 5})
        self._consumer = consumer
        try:
            self._run(consumer)
        finally:
            self._commit(consumer, sync=True)
            consumer.close()

    def _assign(self, consumer: Consumer, partitions: list[int]) -> None:
        starts = self._start_offsets(consumer, partitions)
        with self._directory().ingest_lock:
            for p, o in starts.items():
                self._next.setdefault(p, o)
        consumer.assign([TopicPartition(self.topic, p, self._next[p]) for p in partitions])
        self._partitions = partitions
        log.info("replica %s follows %s partitions %s from %s", self.replica_id, self.topic, partitions,
                 {p: self._next[p] for p in partitions})

    def _run(self, consumer: Consumer) -> None:
        partitions: list[int] = []
        while not partitions and not self._stop.is_set():
            partitions = self._list_partitions(consumer)
            if not partitions:
                log.warning("topic %s has no partitions yet; retrying", self.topic)
                self._stop.wait(1.0)
        if self._stop.is_set():
            return
        self._assign(consumer, partitions)
        # Fetch and split here, validate and apply on a second thread (module docstring).
        runs: queue.Queue = queue.Queue(maxsize=_RUNS_QUEUED)
        applier = threading.Thread(target=self._guard(lambda: self._apply_loop(runs)),
                                   name="blendmatch-kafka-apply", daemon=True)
        applier.start()
        try:
            self._fetch_loop(consumer, runs, applier)
        finally:
            while applier.is_alive():  # after the runs already queued: they apply, then it stops
                try:
                    runs.put(None, timeout=0.1)
                    break
                except queue.Full:
                    pass
            applier.join(timeout=30)

    def _apply_loop(self, runs: queue.Queue) -> None:
        while True:
            split = runs.get()
            if split is None:
                return
            self._apply(self._decode(split))

    def _fetch_loop(self, consumer: Consumer, runs: queue.Queue, applier: threading.Thread) -> None:
        last_commit = last_md = time.monotonic()
        while not self._stop.is_set():
            msgs = consumer.consume(_CONSUME_MAX, 0.05)
            if msgs:
                split = self._split(msgs)
                while not self._stop.is_set():
                    if not applier.is_alive():
                        raise RuntimeError(f"the apply thread stopped: {self.error}")
                    try:
                        runs.put(split, timeout=0.1)
                        break
                    except queue.Full:
                        pass
            self._update_lag(consumer)
            now = time.monotonic()
            if now - last_commit >= _COMMIT_EVERY_S:
                self._commit(consumer, sync=False)
                last_commit = now
            if now - last_md >= _METADATA_EVERY_S:
                last_md = now
                fresh = self._list_partitions(consumer)
                if fresh and fresh != self._partitions:
                    log.info("topic %s now has partitions %s", self.topic, fresh)
                    self._assign(consumer, fresh)

    def _update_lag(self, consumer: Consumer) -> None:
        for p in self._partitions:
            try:
                _, high = consumer.get_watermark_offsets(TopicPartition(self.topic, p), cached=True)
            except KafkaException:
                continue
            if high is None or high < 0:  # not fetched yet: unknown (the live value is wrong on tansu)
                continue
            lag = max(0, high - self._next.get(p, 0))
            self._lag[p] = lag
            self.m_lag.labels(str(p)).set(lag)

    def _commit(self, consumer: Consumer, *, sync: bool) -> None:
        todo = [TopicPartition(self.topic, p, o) for p, o in dict(self._next).items()  # a copy: the apply thread writes
                if self._committed_next.get(p) != o]
        if not todo:
            return
        try:
            consumer.commit(offsets=todo, asynchronous=not sync)
            self._committed_next.update({tp.partition: tp.offset for tp in todo})
        except KafkaException as exc:
            log.warning("offset commit failed (the checkpoint stays the resume point): %s", exc)

    @staticmethod
    def _split(msgs: list) -> list[tuple[Any, str, Any]]:
        """The fetch thread's share of decoding: ``(message, kind, what)`` with kind
        ``fetch_error`` (the error), ``control`` or ``event`` (its token arrays, split out of
        the JSON without the GIL by ``wire.split_event_body``)."""
        out: list[tuple[Any, str, Any]] = []
        for m in msgs:
            err = m.error()
            if err is not None:
                out.append((m, "fetch_error", err))
            elif is_control(m.headers()):
                out.append((m, "control", None))
            else:
                out.append((m, "event", split_event_body(m.value() or b"")))
        return out

    @staticmethod
    def _decode(split: list[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
        """The rest of decoding, on the apply thread before it takes the lock: each event
        becomes its EventRequest, or ``skip`` with ``(reason, detail)``. The parser is
        ``POST /events``'s."""
        out: list[tuple[Any, str, Any]] = []
        for m, kind, what in split:
            if kind != "event":
                out.append((m, kind, what))
                continue
            try:
                out.append((m, "event", parse_event_body(m.value() or b"", arrays=what)))
            except EventValidationError as exc:  # nothing of the record applied
                out.append((m, "skip", ("invalid", str(exc))))
            except ValueError as exc:  # not JSON
                out.append((m, "skip", ("undecodable", str(exc))))
        return out

    def _apply(self, decoded: list[tuple[Any, str, Any]]) -> None:
        """Apply a decoded run in log order, under one directory-lock hold: consecutive event
        records go to ``KeyDirectory.apply_many`` together (their new contents enter the
        blend index in one insert), a control record applies between them in its place.
        Positions advance inside the same hold, so a checkpoint matches its state."""
        directory = self._directory()
        tally: list[Any] = [0, 0, 0, 0, 0, {}]  # applied, duplicates, stale, entries, event records, not indexable
        nbytes = 0
        t0 = time.perf_counter()
        run: list[tuple[int, int, Any]] = []
        with directory.ingest_lock:
            for m, kind, what in decoded:
                if kind == "fetch_error":
                    if what.code() != KafkaError._PARTITION_EOF:
                        log.warning("kafka fetch error on %s: %s", self.topic, what)
                    continue
                p, o = m.partition(), m.offset()
                if o < self._next.get(p, 0):
                    continue  # already applied (a rewind after a re-assignment)
                self._next[p] = o + 1
                nbytes += len(m.value() or b"")
                if kind == "event":
                    run.append((p, o, what))
                elif kind == "skip":  # changes no state: the run goes on
                    self._skip(p, o, *what)
                else:  # a control record applies in its place between event records
                    self._apply_run(directory, run, tally)
                    run = []
                    self._apply_control(directory, m, p, o)
            self._apply_run(directory, run, tally)
        ok, dup, stale, entries, n_events, not_indexable = tally
        self._note_ingested(nbytes)
        self.records_applied += n_events
        self.entries_applied += entries
        self.m_records.labels("events").inc(n_events)
        self.m_entries.inc(entries)
        self._metrics.observe_events(ok, dup, stale, time.perf_counter() - t0, entries, not_indexable)
        for p in self._partitions:
            self.m_position.labels(str(p)).set(self._next.get(p, 0))
        with self._applied_cv:
            self._applied_cv.notify_all()

    def _apply_run(self, directory: KeyDirectory, run: list[tuple[int, int, Any]], tally: list[Any]) -> None:
        if not run:
            return
        for (p, o, _), report in zip(run, directory.apply_many([parsed for _, _, parsed in run])):
            if isinstance(report, ValueError):
                self._skip(p, o, "invalid", str(report))
            elif isinstance(report, Exception):  # a poison record never stalls the partition
                log.error("record %s[%d]@%d failed to apply; skipped", self.topic, p, o, exc_info=report)
                self._skip(p, o, "apply_error", f"{type(report).__name__}: {report}")
            else:
                c = report.counts
                tally[0] += c.applied
                tally[1] += c.duplicates
                tally[2] += c.stale
                tally[3] += report.entries_applied
                tally[4] += 1
                for reason, n in report.not_indexable.items():
                    tally[5][reason] = tally[5].get(reason, 0) + n

    def _skip(self, p: int, o: int, reason: str, detail: str) -> None:
        self.records_skipped += 1
        self.m_skipped.labels(reason).inc()
        n = self.records_skipped
        if n <= _SKIP_LOG_FIRST or n % 1000 == 0:
            log.warning("skipped record %s[%d]@%d (%s; %d skipped so far): %s", self.topic, p, o, reason, n,
                        detail[:300])

    def _apply_control(self, directory: KeyDirectory, m: Any, p: int, o: int) -> None:
        """Apply one registry record (directory lock held) through the one
        ``control.apply_control``; this transport's own part is the log position of each
        instance's last register/heartbeat, which an expiry fence must name to apply."""
        try:
            doc = decode_control(m.value())
        except ControlRecordError as exc:
            self._skip(p, o, "control_invalid", str(exc))
            return
        op, iid = doc["op"], doc["instance_id"]
        if op != "expire" or self._hb_pos.get(iid) == tuple(doc["last"]):
            out = apply_control(doc, registry=self._registry, directory=directory,
                                instance_events=self._metrics.instance_events, at=float(doc["ts"]))
            if op in ("register", "heartbeat") and out.applied:
                self._hb_pos[iid] = (p, o)
            elif op == "deregister" or out.applied:
                self._hb_pos.pop(iid, None)
        self.m_records.labels("control").inc()

    # ------------------------------------------------------------------ producing
    def _producer_loop(self) -> None:
        producer = self._producer
        assert producer is not None
        try:
            producer.list_topics(timeout=5)  # warms the idempotent producer (PID), 0.5 s otherwise
        except KafkaException:
            pass
        while not self._stop.is_set():
            producer.poll(0.05)

    async def append(self, records: list[tuple[bytes, bytes, Optional[list]]], kind: str) -> list[tuple[int, int]]:
        """Append ``(key, value, headers)`` records; returns their ``(partition, offset)``
        once the broker acknowledged every one. Raises ServiceUnavailable otherwise."""
        producer = self._producer
        if producer is None or self._stop.is_set():
            raise ServiceUnavailable("the Kafka producer is not running")
        for i, (key, value, _headers) in enumerate(records):
            # Checked before anything is produced: a record the producer refuses half-way
            # through would leave the batches before it appended and the request failed.
            if len(key) + len(value) > MAX_RECORD_BYTES:
                raise LimitExceeded(f"batch {i} encodes to a {len(key) + len(value):,}-byte record; the log takes "
                                    f"at most {MAX_RECORD_BYTES:,} bytes per record (one record per batch): "
                                    "send fewer entries per batch (nothing was appended)")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = [loop.create_future() for _ in records]

        def callback(fut: asyncio.Future) -> Callable[[Any, Any], None]:
            def done(err: Any, msg: Any) -> None:
                result = (err, None) if err is not None else (None, (msg.partition(), msg.offset()))
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))
            return done

        try:
            for (key, value, headers), fut in zip(records, futures):
                producer.produce(self.topic, value=value, key=key, headers=headers, on_delivery=callback(fut))
        except (BufferError, KafkaException) as exc:
            raise ServiceUnavailable(f"could not append to {self.topic}: {exc}") from None
        results = await asyncio.gather(*futures)
        errors = [str(err) for err, _ in results if err is not None]
        self.m_published.labels(kind).inc(len(records) - len(errors))
        if errors:
            raise ServiceUnavailable(f"the broker did not acknowledge {len(errors)} of {len(records)} records "
                                     f"(the others were appended): {errors[0]}")
        return [pos for _, pos in results]

    @staticmethod
    def event_records(payload: Any) -> list[tuple[bytes, bytes, None]]:
        """Validate a ``POST /events`` body whole (raises EventValidationError -> 422, nothing
        appended) and encode one LMCache record per batch. CPU work: call off the loop."""
        parse_event_request(payload)
        return [(str(b["instance_id"]).encode(), lmcache_record_value(b), None) for b in payload["batches"]]

    async def publish_events(self, records: list[tuple[bytes, bytes, None]]) -> dict[str, Any]:
        """``POST /events`` in Kafka mode: append the records of :meth:`event_records`,
        answer after the broker acknowledged all of them."""
        positions = await self.append(records, "events")
        return {"published": len(positions), "topic": self.topic,
                "records": [{"partition": p, "offset": o} for p, o in positions]}

    async def publish_control(self, op: str, instance_id: str, *, wait_applied: float = 5.0,
                              **fields: Any) -> tuple[int, int]:
        """Append one control record; wait (up to ``wait_applied`` s) until this replica has
        applied it, so that a caller's next request here sees its effect."""
        value = control_value(op, instance_id, replica=self.replica_id, **fields)
        (pos,) = await self.append([(instance_id.encode(), value, [(CONTROL_HEADER, CONTROL_HEADER_VALUE)])],
                                   "control")
        if wait_applied > 0:
            await asyncio.get_running_loop().run_in_executor(None, self.wait_applied, pos[0], pos[1], wait_applied)
        return pos

    def wait_applied(self, partition: int, offset: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._applied_cv:
            while self._next.get(partition, 0) <= offset:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._applied_cv.wait(min(left, 0.1))
        return True

    # ------------------------------------------------------------------ reaper role
    def _reaper_loop(self) -> None:
        timeout_ms = int(self.config.kafka_session_timeout_ms)
        while not self._restored() and not self._stop.is_set():
            time.sleep(0.02)
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.reaper_group,
                             "client.id": f"blendmatch-reaper-{self.replica_id}", "group.protocol": "classic",
                             "session.timeout.ms": timeout_ms, "heartbeat.interval.ms": max(100, timeout_ms // 4),
                             "enable.auto.commit": False, "auto.offset.reset": "latest"})

        def on_assign(c: Any, parts: list) -> None:
            self._set_role(any(tp.partition == 0 for tp in parts))

        def on_revoke(c: Any, parts: list) -> None:
            self._set_role(False)

        while not self._stop.is_set():  # the topic may be created by the consumer thread
            md = consumer.list_topics(timeout=5)
            if self.reaper_topic in md.topics:
                break
            self._stop.wait(0.2)
        consumer.subscribe([self.reaper_topic], on_assign=on_assign, on_revoke=on_revoke, on_lost=on_revoke)
        try:
            while not self._stop.is_set():
                consumer.poll(0.1)
        finally:
            self._set_role(False)
            consumer.close()  # leaves the group: the role moves at once

    def _set_role(self, holds: bool) -> None:
        if holds != self.holds_reaper_role:
            log.info("replica %s %s the reaper role", self.replica_id, "takes" if holds else "gives up")
        self.holds_reaper_role = holds
        self.m_reaper.set(1 if holds else 0)

    async def reap_once(self) -> list[str]:
        """The reaper sweep in Kafka mode: only the role holder acts, and only by appending
        expiry fences (every replica, this one included, applies them from the log)."""
        if not self.holds_reaper_role:
            return []
        fenced = []
        for iid, _last in self._registry.stale(time.time()):
            pos = self._hb_pos.get(iid)
            if pos is None:
                continue
            await self.publish_control("expire", iid, wait_applied=0, last=list(pos), reaper=self.replica_id)
            fenced.append(iid)
        if fenced:
            log.warning("reaper %s: expiry fences appended for %s", self.replica_id, [log_safe(i) for i in fenced])
        return fenced

    # ------------------------------------------------------------------ reads
    def lag(self) -> Optional[int]:
        """Records not yet applied, summed over partitions; None while unknown."""
        if self.error is not None or not self._partitions:
            return None
        if any(p not in self._lag for p in self._partitions):
            return None
        return sum(self._lag[p] for p in self._partitions)

    def stats(self) -> dict[str, Any]:
        return {"transport": "kafka", "topic": self.topic, "replica_id": self.replica_id, "group_id": self.group_id,
                "position": {str(p): self._next.get(p, 0) for p in self._partitions},
                "lag": {str(p): self._lag.get(p) for p in self._partitions}, "records_applied": self.records_applied,
                "entries_applied": self.entries_applied, "records_skipped": self.records_skipped,
                "reaper_role": self.holds_reaper_role, "error": self.error}

