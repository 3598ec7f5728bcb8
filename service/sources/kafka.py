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
producer (``acks=all``) and answer once the broker acknowledged, within
``--kafka-produce-timeout`` (``producer.py``: a 503 past it, a broken producer replaced);
this replica applies them when it consumes them, like every other replica.

Bad days (``log_health.py``): broker errors are retried with backoff and counted, and
fetching resumes by itself after an outage; a log that lost records this replica applied
(a high watermark or a record below its position, a recreated or deleted topic, fewer
partitions) is never skipped silently: ``--on-log-reset`` fails (not ready, not live) or
rebuilds the state from the new log. A replica started without a checkpoint is ready only
once at the log's end as first seen.

The reaper role: ``reaper.py``. A missing topic (never created unless asked): ``topics.py``.
librdkafka's log: ``client_log.py``. A native crash of librdkafka (it can end the process
with SIGSEGV, no handler running): ``crash_watch.py`` leaves a line naming the topic.

``confluent_kafka`` is imported when this module is, and this module only in Kafka mode.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Callable, Optional

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import Counter, Gauge

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.logsafe import log_safe
from blendmatch.index.registry import InstanceRegistry

from ..errors import LimitExceeded, ServiceUnavailable, TooManyInstances
from .client_log import ClientLog, drain
from .crash_watch import Watch, start_watch
from .log_health import LogHealth, backoff, position_reset, topic_reset
from .producer import MAX_RECORD_BYTES, LogProducer
from .topics import TopicPresence
from .reaper import ReaperMembership
from .control import apply_control
from .instance_bound import RunTally, apply_within_bound
from .records import (CONTROL_HEADER, CONTROL_HEADER_VALUE, ControlRecordError, control_value, decode_control,
                      decode_run, split_run)

__all__ = ["KafkaSource", "SECTION"]

log = logging.getLogger("blendmatch.service.kafka")

#: The checkpoint section that holds the log position.
SECTION = "stream_position"
_CONSUME_MAX = 200         # records per apply run (one directory-lock hold)
_RUNS_QUEUED = 2           # split runs waiting for the apply thread (memory: ~2 x 200 records)
_COMMIT_EVERY_S = 1.0
_METADATA_EVERY_S = 10.0
_SKIP_LOG_FIRST = 20       # skipped records logged one by one, then every 1000th


class _LogReset(Exception):
    """The broker lost records this replica applied (``log_health.py``): the fetch loop
    stops; ``--on-log-reset`` decides what follows."""


class KafkaSource:
    """One replica's side of the log (see the module docstring)."""

    def __init__(self, config: Any, *, directory: KeyDirectory, registry: InstanceRegistry,
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
        self._high: dict[int, int] = {}          # partition -> high watermark last seen (cached: see _update_lag)
        self._cold = False                       # started without a checkpoint, log end not seen yet
        self._topic_id: Optional[str] = None     # the topic's id when first seen (or checkpointed)
        self._topic_ids = True                   # False: the broker does not say (describe_topics unsupported)
        self._rewound: Optional[tuple[int, int, int]] = None  # (partition, offset, position): a record below it
        self._partitions: list[int] = []
        self._applied_cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._consumer: Optional[Consumer] = None
        self.records_applied = 0
        self.entries_applied = 0
        self.records_skipped = 0
        self._committed_next: dict[int, int] = {}
        self._fatal_client_error: Optional[str] = None
        self.error: Optional[str] = None
        #: librdkafka's log, through Python logging, rate-limited (client_log.py): every client's ``logger``.
        self.client_log = ClientLog()
        self._watch: Optional[Watch] = None
        r = metrics.registry
        #: Outages, log resets, the cold start's catch-up: readiness and liveness (log_health.py).
        self.health = LogHealth(r, getattr(config, "on_log_reset", "fail"))
        #: Does the topic exist; created only with --kafka-create-topic (topics.py).
        self.topics = TopicPresence(self.topic, self.reaper_topic, self.bootstrap,
                                    bool(getattr(config, "kafka_create_topic", False)), self.health, self._admin_client)
        #: Appends (producer.py): bounded answer time, replaced when it breaks.
        self.producer = LogProducer(self.bootstrap, f"blendmatch-{self.replica_id}",
                                    float(getattr(config, "kafka_produce_timeout", 5.0)), r, logger=self.client_log)
        self.m_lag = Gauge("blendmatch_kafka_lag_records", "records in the partition not yet applied", ["partition"],
                           registry=r)
        self.m_position = Gauge("blendmatch_kafka_position", "next offset to apply", ["partition"], registry=r)
        self.m_records = Counter("blendmatch_kafka_records_applied", "records applied", ["kind"], registry=r)
        self.m_entries = Counter("blendmatch_kafka_entries_applied", "entries of applied cache-event batches",
                                 registry=r)
        self.m_skipped = Counter("blendmatch_kafka_records_skipped", "records skipped (undecodable, invalid, or past "
                                 "--max-instances: reason instance_bound)",
                                 ["reason"], registry=r)
        self.m_published = Counter("blendmatch_kafka_records_published", "records appended by this replica",
                                   ["kind"], registry=r)
        self.m_append_failures = Counter("blendmatch_kafka_append_failures",
                                         "appends answered 503 (broker unreachable or no acknowledgement in time)",
                                         ["kind"], registry=r)
        self.reaper = ReaperMembership(self.bootstrap, self.reaper_group, self.reaper_topic, self.replica_id,
                                       int(config.kafka_session_timeout_ms), r, logger=self.client_log)

    # ------------------------------------------------------------------ checkpoint section
    def snapshot(self) -> dict[str, Any]:
        """Called with the directory lock held (ingest paused): matches the state exactly."""
        return {"version": 1, "topic": self.topic, "next": {str(p): o for p, o in sorted(self._next.items())},
                "control": {iid: list(pos) for iid, pos in self._hb_pos.items()}, "topic_id": self._topic_id}

    def restore(self, doc: dict[str, Any]) -> None:
        if doc.get("version") != 1:
            raise ValueError(f"unsupported stream_position version {doc.get('version')!r}")
        if doc.get("topic") != self.topic:
            log.warning("checkpoint position is for topic %r, not %r: ignored", doc.get("topic"), self.topic)
            return
        self._restored_next = {int(p): int(o) for p, o in doc["next"].items()}
        self._next = dict(self._restored_next)
        self._hb_pos = {str(i): (int(p), int(o)) for i, (p, o) in doc.get("control", {}).items()}
        self._topic_id = doc.get("topic_id")  # absent in older checkpoints: learnt at start

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._watch = start_watch(os.getpid(), self.replica_id, self.topic, self.bootstrap)
        self._threads.append(self.producer.start(self._guard))
        for target, name in ((self._consume_loop, "blendmatch-kafka"),
                             (lambda: self.reaper.run(self._stop, self._reaper_eligible, self._retry),
                              "blendmatch-kafka-reaper")):
            t = threading.Thread(target=self._guard(target), name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _reaper_eligible(self) -> bool:
        """Whether this replica may hold the reaper role (``reaper.py``): restored, following
        a topic that exists, and nothing against its readiness from the log (not catching
        up, no log reset, no dead thread). A replica of a missing or misspelled topic never
        holds it: its registry is not the fleet's."""
        return self._restored() and self.topics.seen and not self.not_ready_reasons()

    def _admin_client(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.bootstrap, "logger": self.client_log})

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported through stats, readiness and liveness
                self.error = f"{type(exc).__name__}: {exc}"
                self.health.dead = f"thread {threading.current_thread().name} died: {self.error}"
                log.exception("kafka thread %s died: /healthz now fails so that the process is restarted",
                              threading.current_thread().name)
        return run

    def _retry(self, op: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` until it succeeds, retrying transient broker errors with backoff (counted
        and reported by ``self.health``); a fatal one raises (the thread dies: /healthz
        fails). None when the source stops meanwhile."""
        failures = 0
        while not self._stop.is_set():
            try:
                got = fn()
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.fatal():
                    raise
                failures += 1
                self.health.broker_error(op, exc)
                self._stop.wait(backoff(failures))
                continue
            self.health.broker_ok()
            return got
        return None

    def _on_client_error(self, err: KafkaError) -> None:
        """librdkafka's error callback (on the thread that polls): outages are counted here
        as soon as the client sees them; a fatal error is remembered for the fetch loop."""
        if err.fatal():
            self._fatal_client_error = str(err)
        elif err.code() == KafkaError._ALL_BROKERS_DOWN:  # one connection's _TRANSPORT error is routine
            self.health.broker_error("connection", err)

    def health_problem(self) -> Optional[str]:
        """Why ``/healthz`` must fail (restart the process), or None."""
        if not self._stop.is_set():
            for t in self._threads:  # (a consumer that stopped on a log reset says so itself)
                if not t.is_alive() and self.health.dead is None and self.health.reset is None:
                    self.health.dead = f"thread {t.name} stopped: {self.error or 'no error recorded'}"
        return self.health.not_live()

    def not_ready_reasons(self) -> list[str]:
        return self.health.reasons(dict(self._next))

    def warnings(self) -> list[str]:
        return self.health.warnings()

    def stop(self) -> None:
        self._stop.set()
        self.producer.stop()  # its own stop: its thread, then what it still holds is flushed
        for t in self._threads:
            t.join(timeout=15)
        self._threads = []
        if self._watch is not None:  # last: a crash while the clients close is still reported
            self._watch.stop()

    # ------------------------------------------------------------------ consuming
    def _list_partitions(self, consumer: Consumer) -> Optional[list[int]]:
        """The topic's partitions; [] while the broker reports an error for it; None when
        the topic does not exist."""
        md = consumer.list_topics(timeout=10)  # all topics: naming one would auto-create it
        topic = md.topics.get(self.topic)
        if topic is None:
            return None
        return [] if topic.error is not None else sorted(topic.partitions)

    def _start_offsets(self, consumer: Consumer, partitions: list[int]) -> dict[int, int]:
        """Checkpoint > committed offsets (of this replica's group) > 0 (earliest)."""
        out: dict[int, int] = {}
        missing = [p for p in partitions if p not in self._next]
        committed: dict[int, int] = {}
        if missing and self._restored_next is None:
            got = self._retry("committed offsets", lambda: consumer.committed(
                [TopicPartition(self.topic, p) for p in missing], timeout=10))
            for tp in got or ():
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
        self._cold = self._restored_next is None
        while not self._stop.is_set():
            try:
                self._follow()
                return
            except _LogReset as exc:
                if self.health.on_reset == "fail":
                    log.error("event log reset (%s): no longer following %s (--on-log-reset fail); /readyz and "
                              "/healthz answer 503 until an operator acts (docs/fleet.md)", exc, self.topic)
                    return
                self._resync(str(exc))

    def _resync(self, reason: str) -> None:
        """``--on-log-reset resync``: forget everything the old log built (index, gate,
        registry, positions) and follow the new log from its start; ready again once at its
        end (the catch-up rule of a cold start)."""
        directory = self._directory
        with directory.ingest_lock:
            directory.clear()
            self._registry.restore({"version": 1, "instances": []})
            self._hb_pos.clear()
            self._next.clear()
            self._lag.clear()
            self._high.clear()
            self._committed_next.clear()
            self._restored_next = {}  # positions known (none): start at the earliest, not at committed offsets
            self._topic_id = None
            self._rewound = None
            self._partitions = []
            self._cold = True
        log.error("event log reset (%s): state cleared, rebuilding from the start of %s (--on-log-reset resync)",
                  reason, self.topic)

    def _follow(self) -> None:
        """One consumer from the current positions until the stop (returns) or a log reset
        (raises :class:`_LogReset`, after the records already fetched were applied)."""
        self._retry("create topics", self.topics.ensure)
        if self._stop.is_set() or not self.topics.wait(self._stop, self._retry):
            return
        self._retry("create topics", self.topics.ensure)  # the reaper topic, if the topic appeared meanwhile
        if self._stop.is_set():
            return
        self._admin = self._admin_client()
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group_id, "error_cb": self._on_client_error,
                             "logger": self.client_log,
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
        """Follow ``partitions``: all of them at the start, then only those added (a partition
        already followed is never re-assigned, so no record below a position is ever
        fetched again: one that is means the log was rewound)."""
        new = [p for p in partitions if p not in self._partitions]
        starts = self._start_offsets(consumer, new)
        with self._directory.ingest_lock:
            for p, o in starts.items():
                self._next.setdefault(p, o)
        tps = [TopicPartition(self.topic, p, self._next[p]) for p in new]
        if self._partitions:
            consumer.incremental_assign(tps)
        else:
            consumer.assign(tps)
        self._partitions = partitions
        log.info("replica %s follows %s partitions %s from %s", self.replica_id, self.topic, partitions,
                 {p: self._next[p] for p in partitions})

    def _run(self, consumer: Consumer) -> None:
        partitions: list[int] = []
        while not partitions and not self._stop.is_set():
            partitions = self._retry("metadata", lambda: self._list_partitions(consumer)) or []
            if not partitions and not self._stop.is_set():
                log.warning("topic %s has no partitions yet; retrying", self.topic)
                self._stop.wait(1.0)
        if self._stop.is_set():
            return
        self._retry("metadata", lambda: self._check_topic(partitions))  # a recreated topic, before any fetch
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
            self._apply(decode_run(split))

    def _fetch_loop(self, consumer: Consumer, runs: queue.Queue, applier: threading.Thread) -> None:
        last_commit = last_md = time.monotonic()
        failures = 0
        while not self._stop.is_set():
            msgs = consumer.consume(_CONSUME_MAX, 0.05)
            if msgs:
                split = split_run(msgs)
                while not self._stop.is_set():
                    if not applier.is_alive():
                        raise RuntimeError(f"the apply thread stopped: {self.error}")
                    try:
                        runs.put(split, timeout=0.1)
                        break
                    except queue.Full:
                        pass
            self._update_lag(consumer)
            self._check_positions()
            now = time.monotonic()
            if now - last_commit >= _COMMIT_EVERY_S:
                self._commit(consumer, sync=False)
                last_commit = now
            if self._fatal_client_error is not None:
                raise RuntimeError(f"fatal Kafka client error: {self._fatal_client_error}")
            if msgs:
                self.health.broker_ok()
            if now - last_md >= _METADATA_EVERY_S:
                last_md = now
                try:
                    fresh = self._list_partitions(consumer)
                    self._check_topic(fresh)
                except KafkaException as exc:  # an outage: fetching resumes by itself once it is over
                    failures += 1
                    self.health.broker_error("metadata", exc)
                    last_md = now - _METADATA_EVERY_S + backoff(failures)  # retry sooner than the period
                    continue
                failures = 0
                self.health.broker_ok()
                if fresh and fresh != self._partitions:
                    log.info("topic %s now has partitions %s", self.topic, fresh)
                    self._assign(consumer, fresh)

    def _reset(self, kind: str, reason: str) -> None:
        """A log reset: counted, remembered for the probes, and the fetch loop stops."""
        self.health.log_reset(kind, reason)
        raise _LogReset(reason)

    def _check_positions(self) -> None:
        """Fetch thread, every round: a high watermark below a position, or a record below
        one (log_health.py)."""
        found = position_reset(self._partitions, self._next, self._high, self._rewound)
        if found is not None:
            self._reset(*found)

    def _check_topic(self, partitions: Optional[list[int]]) -> None:
        """Fetch thread, with each metadata refresh: the topic deleted, recreated (its id
        changed) or with fewer partitions. Raises KafkaException on a broker error."""
        found = topic_reset(self.topic, partitions, self._partitions)
        if found is not None:
            self.topics.seen = partitions is not None  # appends refused while it is gone
            self._reset(*found)
        if not partitions or not self._topic_ids:
            return
        try:
            desc = self._admin.describe_topics(TopicCollection([self.topic]))[self.topic].result(10)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() in (KafkaError._UNSUPPORTED_FEATURE,
                                                              KafkaError.UNSUPPORTED_VERSION):
                self._topic_ids = False
                log.info("the broker does not report topic ids: a recreated topic is detected only when it is "
                         "shorter than this replica's position")
                return
            raise
        finally:
            drain(self._admin)
        tid = str(desc.topic_id) if desc.topic_id is not None else None
        found = topic_reset(self.topic, partitions, self._partitions, tid, self._topic_id)
        if found is not None:
            self._reset(*found)
        self._topic_id = self._topic_id or tid

    def _update_lag(self, consumer: Consumer) -> None:
        for p in self._partitions:
            try:
                _, high = consumer.get_watermark_offsets(TopicPartition(self.topic, p), cached=True)
            except KafkaException:
                continue
            if high is None or high < 0:  # not fetched yet: unknown (the live value is wrong on tansu)
                continue
            self._high[p] = high
            lag = max(0, high - self._next.get(p, 0))
            self._lag[p] = lag
            self.m_lag.labels(str(p)).set(lag)
        if self._cold and all(p in self._high for p in self._partitions):
            # no checkpoint: ready only at the log's end as first seen (log_health.py), not
            # within --max-ready-lag of it
            self._cold = False
            self.health.catch_up = {p: self._high[p] for p in self._partitions}
        self.health.progress(self._next)

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

    def _apply(self, decoded: list[tuple[Any, str, Any]]) -> None:
        """Apply a decoded run in log order, under one directory-lock hold: consecutive event
        records go to ``KeyDirectory.apply_many`` together (their new contents enter the
        blend index in one insert), a control record applies between them in its place.
        Positions advance inside the same hold, so a checkpoint matches its state."""
        directory = self._directory
        tally = RunTally()
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
                if o < self._next.get(p, 0):  # never re-fetched (_assign): the log was rewound under us
                    if self._rewound is None:
                        self._rewound = (p, o, self._next[p])
                    continue
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
        self._note_ingested(nbytes)
        self.records_applied += tally.requests
        self.entries_applied += tally.entries
        self.m_records.labels("events").inc(tally.requests)
        self.m_entries.inc(tally.entries)
        self._metrics.observe_events(tally.applied, tally.duplicates, tally.stale, time.perf_counter() - t0,
                                     tally.entries, tally.not_indexable)
        for p in self._partitions:
            self.m_position.labels(str(p)).set(self._next.get(p, 0))
        with self._applied_cv:
            self._applied_cv.notify_all()

    def _apply_run(self, directory: KeyDirectory, run: list[tuple[int, int, Any]], tally: RunTally) -> None:
        if not run:
            return
        reports = apply_within_bound(directory, [parsed for _, _, parsed in run], self.config.max_instances,
                                     "applied by any replica")
        for (p, o, _), report in zip(run, reports):
            if isinstance(report, TooManyInstances):  # every replica refuses it alike (the same log, the same state)
                self._skip(p, o, "instance_bound", str(report))
            elif isinstance(report, ValueError):
                self._skip(p, o, "invalid", str(report))
            elif isinstance(report, Exception):  # a poison record never stalls the partition
                log.error("record %s[%d]@%d failed to apply; skipped", self.topic, p, o, exc_info=report)
                self._skip(p, o, "apply_error", f"{type(report).__name__}: {report}")
            else:
                tally.add(report)

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
                                instance_events=self._metrics.instance_events, at=float(doc["ts"]),
                                max_instances=self.config.max_instances)
            if op in ("register", "heartbeat") and out.applied:
                self._hb_pos[iid] = (p, o)
            elif op == "deregister" or out.applied:
                self._hb_pos.pop(iid, None)
        self.m_records.labels("control").inc()

    # ------------------------------------------------------------------ producing
    async def append(self, records: list[tuple[bytes, bytes, Optional[list]]], kind: str) -> list[tuple[int, int]]:
        """Append ``(key, value, headers)`` records; returns their ``(partition, offset)``
        once the broker acknowledged every one. Raises ServiceUnavailable otherwise."""
        if not self.producer.running or self._stop.is_set():
            raise ServiceUnavailable("the Kafka producer is not running")
        refused = None if self.topics.seen else await asyncio.get_running_loop().run_in_executor(
            None, self.topics.append_refusal, self.producer.timeout_s)
        if refused is not None:
            self.m_append_failures.labels(kind).inc()
            raise ServiceUnavailable(refused)
        for i, (key, value, _headers) in enumerate(records):
            # Checked before anything is produced: a record the producer refuses half-way
            # through would leave the batches before it appended and the request failed.
            if len(key) + len(value) > MAX_RECORD_BYTES:
                raise LimitExceeded(f"batch {i} encodes to a {len(key) + len(value):,}-byte record; the log takes "
                                    f"at most {MAX_RECORD_BYTES:,} bytes per record (one record per batch): "
                                    "send fewer entries per batch (nothing was appended)")
        try:
            positions = await self.producer.append(self.topic, records)
        except ServiceUnavailable:
            self.m_append_failures.labels(kind).inc()
            raise
        self.m_published.labels(kind).inc(len(positions))
        return positions

    async def publish_events(self, records: list[tuple[bytes, bytes, None]]) -> dict[str, Any]:
        """``POST /events`` in Kafka mode: append the records of ``records.event_records``,
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
    async def reap_once(self) -> list[str]:
        """The reaper sweep in Kafka mode: only the role holder acts, and only by appending
        expiry fences (every replica, this one included, applies them from the log)."""
        if not self.reaper.holds or not self._reaper_eligible():  # (it is leaving the group)
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
                "reaper_role": self.reaper.holds, "error": self.error,
                "broker_unreachable_s": self.health.unreachable_s(), "reconnects": self.health.reconnects,
                "log_resets": self.health.resets, "log_reset": self.health.reset, "topic_id": self._topic_id}

