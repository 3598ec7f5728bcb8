"""Prometheus metrics: one private ``CollectorRegistry`` per app, every name ``blendmatch_``.

Why a private registry: two apps in one process (tests, an embedded server) must not share
or double-register series. ``GET /metrics`` renders this registry only.

Two kinds of series:

- *event-driven* (histograms and counters), updated where the work happens: the batcher's
  observer (batch size in queries and tokens, queue wait, batch run time, dropped requests),
  the lookup runner on the executor thread (engine and verification time, windows probed,
  survivors, matches, verification rejections by reason), the routes (lookup latency,
  events applied / duplicate / stale, rejected requests by status, internal errors);
- *scrape-time* gauges read from the directory and the index by a custom collector
  (contents, chunks, claims, keys, placements, memory, queue depth, engine in use and
  failovers). Those reads take the directory / index locks briefly; both keep counts
  incrementally, so a scrape costs O(1), not a walk.

Histogram buckets: latency buckets span 100 us .. 10 s (a lookup is ~1 ms); batch-size
buckets are powers of two up to 4096 queries and 2^24 tokens. Histograms are
``fast_histogram.FastHistogram`` (the same series; an observation is a list append, folded
at scrape time): prometheus-client's cost ~1.5 us of GIL per observation, several per lookup.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from blendmatch.index.key_directory import NOT_INDEXABLE_REASONS

from .batcher import BatchRecord
from .fast_histogram import FastHistogram

__all__ = ["ServiceMetrics", "CONTENT_TYPE"]

#: The Prometheus text exposition format served by ``GET /metrics``.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 10.0)
_QUERY_BUCKETS = tuple(float(1 << i) for i in range(13))  # 1 .. 4096
_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(8, 25, 2))  # 256 .. 16M


class _ScrapeCollector(Collector):
    """Gauges read at scrape time from ``gauge_values()`` (a dict; missing keys are skipped)."""

    def __init__(self, gauge_values: Callable[[], Mapping[str, Any]]) -> None:
        self._gauge_values = gauge_values

    def collect(self) -> Iterable[Any]:
        try:
            snap = self._gauge_values()
        except Exception:  # noqa: BLE001 - a scrape must not fail because a read did
            return
        gauges = {
            "index_contents": ("distinct chunk contents in the blend index", "num_contents"),
            "index_chunks": ("chunk hashes (occupants) in the blend index", "num_chunks"),
            "index_claims": ("namespace claims in the blend index", "num_claims"),
            "index_namespaces": ("namespaces holding at least one claim", "num_namespaces"),
            "index_memory_bytes": ("resident bytes of the blend index (tokens included)", "memory_bytes"),
            "index_table_slots": ("slots in the slot array", "table_size"),
            "directory_keys": ("keys with at least one placement", "num_keys"),
            "directory_placements": ("placements across all keys", "num_placements"),
            "directory_bindings": ("chunk-hash token bindings", "num_bindings"),
            "lookup_queue_depth": ("lookups waiting for a batch", "queue_depth"),
            "events_queue_depth": ("event requests waiting for the event thread", "events_queue_depth"),
            "instances_registered": ("MP server instances in the registry", "instances_registered"),
            "ready": ("1 while GET /readyz answers ready (restored, event log lag within bounds)", "ready"),
        }
        for name, (doc, key) in gauges.items():
            value = snap.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g = GaugeMetricFamily(f"blendmatch_{name}", doc)
                g.add_metric([], float(value))
                yield g
        failovers = snap.get("engine_failovers")
        if isinstance(failovers, int):
            c = CounterMetricFamily("blendmatch_engine_failovers", "GPU -> CPU engine failovers")
            c.add_metric([], float(failovers))
            yield c
        engine = snap.get("engine")
        if isinstance(engine, str):
            info = InfoMetricFamily("blendmatch_engine", "the probe engine in use and why it was chosen")
            info.add_metric([], {"name": engine, "reason": str(snap.get("engine_reason", ""))})
            yield info


class ServiceMetrics:
    """All series of one app. Thread-safe (prometheus-client's counters are, and so is FastHistogram)."""

    def __init__(self, gauge_values: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lookup_latency = FastHistogram(
            "blendmatch_lookup_latency_seconds", "lookup request time, body parsed to response built",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        # children resolved once: ``labels()`` takes a lock and a dict lookup per call (hot path)
        self.lookup_latency_single = self.lookup_latency.labels("single")
        self.lookup_latency_batch = self.lookup_latency.labels("batch")
        self.batch_queries = FastHistogram(
            "blendmatch_batch_queries", "queries per engine batch", buckets=_QUERY_BUCKETS, registry=r)
        self.batch_tokens = FastHistogram(
            "blendmatch_batch_tokens", "tokens per engine batch", buckets=_TOKEN_BUCKETS, registry=r)
        self.queue_wait = FastHistogram(
            "blendmatch_queue_wait_seconds", "time a lookup waited for its batch to start",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_seconds = FastHistogram(
            "blendmatch_batch_seconds", "time one batch ran on the executor thread",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.engine_seconds = FastHistogram(
            "blendmatch_engine_seconds", "engine probe time per batch", buckets=_LATENCY_BUCKETS, registry=r)
        self.verify_seconds = FastHistogram(
            "blendmatch_verify_seconds", "host verification time per batch", buckets=_LATENCY_BUCKETS, registry=r)
        self.batches = Counter("blendmatch_batches", "engine batches run", ["outcome"], registry=r)
        self.busy_seconds = Counter(
            "blendmatch_batcher_busy_seconds", "seconds the lookup executor spent running batches", registry=r)
        self.lookups = Counter("blendmatch_lookups", "lookup queries answered", registry=r)
        self.lookup_tokens = Counter("blendmatch_lookup_tokens", "tokens in lookup queries", registry=r)
        self.dropped = Counter(
            "blendmatch_lookups_dropped", "lookups dropped because their caller cancelled", registry=r)
        self.windows = Counter("blendmatch_windows_probed", "windows the engine probed", registry=r)
        self.survivors = Counter("blendmatch_survivors", "windows that survived the slot probe", registry=r)
        self.matches = Counter("blendmatch_matches", "matches returned", registry=r)
        self.rejections = Counter(
            "blendmatch_verify_rejections", "survivors that produced no match", ["reason"], registry=r)
        self.events = Counter(
            "blendmatch_event_batches", "cache-event batches by outcome", ["result"], registry=r)
        self.event_seconds = FastHistogram(
            "blendmatch_event_apply_seconds", "time to apply one POST /events body",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.event_entries = Counter(
            "blendmatch_event_entries_applied", "entries of applied cache-event batches", registry=r)
        self.not_indexable = Counter(
            "blendmatch_event_entries_not_indexable",
            "applied STORE entries that fed nothing to the blend index, by reason", ["reason"], registry=r)
        self.instance_events = Counter(
            "blendmatch_instance_events", "instance registry events (registered, re_registered, heartbeat, "
            "unknown_heartbeat, deregistered, expired, refused_bound)", ["event"], registry=r)
        self.rejected = Counter(
            "blendmatch_http_rejected", "requests answered with a 4xx", ["status"], registry=r)
        self.client_disconnects = Counter(
            "blendmatch_client_disconnects", "requests whose client went away before the body was complete",
            registry=r)
        self.internal_errors = Counter(
            "blendmatch_http_internal_errors", "requests answered with a 500 (a bug)", registry=r)
        self.placements_omitted = Counter(
            "blendmatch_placements_omitted", "usable copies of matched chunks left out of include_placements "
            "answers: cap (--max-placements-per-match), bytes (--max-placement-answer-bytes)", ["reason"], registry=r)
        self.placements_omitted_cap = self.placements_omitted.labels("cap")
        self.placements_omitted_bytes = self.placements_omitted.labels("bytes")
        self.placement_truncations = Counter(
            "blendmatch_placement_answers_truncated", "requests whose include_placements answers reached "
            "--max-placement-answer-bytes", registry=r)
        # the children of the per-body counters, looked up once: ``labels()`` costs ~2 us on
        # the event loop, three or four times per POST /events
        self._events_by = {label: self.events.labels(label) for label in ("applied", "duplicate", "stale")}
        self._batches_by = {label: self.batches.labels(label) for label in ("ok", "failed")}
        self._not_indexable_by = {label: self.not_indexable.labels(label) for label in NOT_INDEXABLE_REASONS}
        for label in ("registered", "re_registered", "heartbeat", "unknown_heartbeat", "deregistered", "expired",
                      "refused_bound"):
            self.instance_events.labels(label)
        self._rejections_by = {label: self.rejections.labels(label) for label in ("dict_miss", "namespace", "tokens")}
        if gauge_values is not None:
            self.registry.register(_ScrapeCollector(gauge_values))

    # ------------------------------------------------------------------ observers
    def observe_batch(self, record: BatchRecord) -> None:
        """The batcher's observer (runs on the event loop, once per batch)."""
        if record.dropped:
            self.dropped.inc(record.dropped)
        if not record.queries:
            return
        self.batch_queries.observe(record.queries)
        self.batch_tokens.observe(record.tokens)
        for w in record.queue_waits:
            self.queue_wait.observe(w)
        self.batch_seconds.observe(record.run_s)
        self.busy_seconds.inc(record.run_s)
        self._batches_by["failed" if record.failed else "ok"].inc()

    def observe_match(self, stats: Any) -> None:
        """Record a ``MatchStats`` (runs on the lookup thread, once per batch; an increment
        by 0 is skipped: each takes the counter's lock)."""
        for counter, n in ((self.lookups, stats.queries), (self.lookup_tokens, stats.tokens),
                           (self.windows, stats.windows), (self.survivors, stats.survivors),
                           (self.matches, stats.matches)):
            if n:
                counter.inc(n)
        self.engine_seconds.observe(stats.engine_s)
        self.verify_seconds.observe(stats.verify_s)
        by = self._rejections_by
        for label, n in (("dict_miss", getattr(stats, "dict_misses", 0)), ("namespace", getattr(stats, "ns_filtered", 0)),
                         ("tokens", getattr(stats, "token_rejections", 0))):
            if n:
                by[label].inc(n)

    def observe_events(self, applied: int, duplicates: int, stale: int, seconds: float, entries: int = 0,
                       not_indexable: Mapping[str, int] | None = None) -> None:
        if entries:
            self.event_entries.inc(entries)
        for reason, n in (not_indexable or {}).items():
            child = self._not_indexable_by.get(reason)
            (child if child is not None else self.not_indexable.labels(reason)).inc(n)
        by = self._events_by
        for label, n in (("applied", applied), ("duplicate", duplicates), ("stale", stale)):
            if n:  # an increment by 0 changes nothing but takes the child's lock
                by[label].inc(n)
        self.event_seconds.observe(seconds)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
