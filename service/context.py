"""The typed context every route receives: configuration, directory, batcher, executors, metrics.

One :class:`ServiceContext` per app, built by ``create_app`` and handed to routes through the
:data:`Ctx` dependency (the only code that reads ``app.state``). Routes stay thin: they
validate, call one context method, and shape the answer.

Threads (why three):

- the event loop: HTTP parsing, request validation and responses only; it never decodes
  ``tokens_b64``, hashes, probes or takes the directory's lock;
- ``blendmatch-lookup`` (one thread, owned by the batcher): every engine batch, including
  the base64 decoding of its queries (one ``nogil`` kernel call per batch) and the JSON
  encoding of its answers. One thread, so the engine is used from one place and batches
  form naturally while it is busy. Its numba thread count is ``engine_threads``;
- ``blendmatch-events`` (one thread): JSON decoding, validation and application of cache
  events, and fencing, in arrival order. A separate thread, so a burst of events cannot
  queue behind lookups nor lookups behind events; they contend only for the GIL (the probe
  runs in numba with the GIL released) and briefly for the index lock (a lookup takes it
  only to verify survivors, never the directory's lock);
- ``blendmatch-blocks`` (one thread, ``index/storage.py``): maps the index's next token
  block ahead of need, so the events thread does not pay the kernel's page mapping;
- reads that take the directory lock (stats, key listing, key lookup, a metrics scrape) go
  to the loop's default executor, so a long event apply never stalls the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Sequence, TypeVar

import numpy as np
from fastapi import Depends, Request

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.registry import InstanceRegistry
from blendmatch.index.token_hasher import TokenHasher, vllm_none_hash_seed
from blendmatch.index.tokens import (TokenDecodeError, TokenLimitExceeded, b64_token_count, check_token_count,
                                     decode_b64_many, decode_query_tokens, is_b64_source)

from .answers import EMPTY_MATCHES, encode_matches
from .batcher import BatchPipeline, MicroBatcher
from .config import ServiceConfig
from .durability import CheckpointRequired, Durability
from .errors import LimitExceeded, ServiceUnavailable
from .event_source import EventSource, build_event_source
from .events_thread import EventsThread, GroupFn
from .heap import AfterIngest
from .metrics import ServiceMetrics
from .reuse_metrics import ReuseMetrics
from .upstream import Upstream

__all__ = ["ServiceContext", "LookupQuery", "Ctx", "get_context", "build_directory"]

log = logging.getLogger("blendmatch.service")

#: One lookup as the batcher carries it: (uint32 tokens, or a ``tokens_b64`` string, or that
#: string's ASCII bytes as the fast path takes them out of the body, which the lookup thread
#: decodes with the rest of its batch; namespace), optionally followed by a finisher: a
#: callable ``(matches, tokens) -> bytes`` answering in place of ``encode_matches``
#: (``routing.py``: placements, the routing score).
LookupQuery = tuple[Any, ...]

T = TypeVar("T")



class DeferredQuery:
    """A lookup whose body the lookup thread parses (the lookup lane, ``lane.py``): the
    event loop queues the raw body, and ``resolve()``, called on the lookup thread with its
    batch, returns the :data:`LookupQuery` or raises why the body cannot be answered that
    way (the lane then hands the request to the app, which answers it). ``tokens``: a bound
    on the tokens the body can carry (``lane._most_tokens``), the batcher's cost; the
    request's own limit (``check_tokens``, 413) is checked by ``resolve()``."""

    __slots__ = ("resolve", "tokens")

    def __init__(self, resolve: Callable[[], LookupQuery], tokens: int) -> None:
        self.resolve = resolve
        self.tokens = tokens


def query_tokens(query: LookupQuery) -> int:
    """Tokens in a query (for a ``tokens_b64`` string: from its length, exact when valid;
    for a :class:`DeferredQuery`, its bound)."""
    source = query[0]
    if is_b64_source(source):
        return b64_token_count(source)
    if type(source) is DeferredQuery:
        return source.tokens
    return int(source.shape[0])


def _init_lookup_thread(threads: int) -> None:
    """Runs once on the lookup thread: numba's thread count is per calling thread."""
    try:
        import numba

        numba.set_num_threads(max(1, min(threads, int(getattr(numba.config, "NUMBA_NUM_THREADS", threads)))))
    except Exception:  # noqa: BLE001 - a tuning knob; never a reason not to serve
        log.warning("could not set the CPU engine's thread count to %d", threads, exc_info=True)


def _decode_errors(queries: list[LookupQuery]) -> list[TokenDecodeError | None]:
    """Per query: None, or why its ``tokens_b64`` does not decode (used when blend lookup is
    disabled, so that bad input is still a 422)."""
    strings = [(i, q[0]) for i, q in enumerate(queries) if is_b64_source(q[0])]
    errors: list[TokenDecodeError | None] = [None] * len(queries)
    for (i, _), got in zip(strings, decode_b64_many([v for _, v in strings], ascii_bytes=True), strict=True):
        if isinstance(got, TokenDecodeError):
            errors[i] = got
    return errors


def _check_decodes(queries: list[LookupQuery]) -> None:
    for err in _decode_errors(queries):
        if err is not None:
            raise err


def build_directory(config: ServiceConfig) -> KeyDirectory:
    """A fresh directory configured as ``config`` says (engine selection happens here)."""
    directory = KeyDirectory()
    if config.enable_blend_lookup:
        directory.enable_blend_lookup(chunk_size=config.chunk_size, probe_stride=config.blend_probe_stride,
                                      engine=config.engine)
    return directory


@dataclass(eq=False)
class _LookupBatch:
    """A lookup batch between :meth:`ServiceContext._start_lookups` and ``_finish_lookups``:
    the queries, their answers so far, the decoded tokens, the queries that decoded, and the
    engine batch in flight (``pending``) or its result (``done``)."""

    queries: list[Any]
    out: list[bytes | BaseException]
    flat: tuple[np.ndarray, np.ndarray] | None
    ready: Sequence[int]
    pending: Any
    done: Any


class ServiceContext:
    """Everything a route needs; see the module docstring. Start/stop via the app lifespan."""

    def __init__(self, config: ServiceConfig, directory: KeyDirectory | None = None) -> None:
        self.config = config
        self.directory = directory if directory is not None else build_directory(config)
        self.metrics = ServiceMetrics(gauge_values=self.gauge_values)
        #: The fleet's token hasher (``--hash-algorithm``; vLLM's functions seed NONE_HASH
        #: from ``PYTHONHASHSEED`` as vLLM does): the token form of ``/directory/lookup``.
        self.token_hasher = TokenHasher(config.hash_algorithm, config.chunk_size,
                                        none_hash_seed=vllm_none_hash_seed(os.environ))
        #: Reuse metrics: prefix and non-prefix tokens per lookup, by model.
        self.reuse = ReuseMetrics(self.metrics.registry, self.directory, self.token_hasher)
        self.lookups: MicroBatcher[LookupQuery, bytes | BaseException] = MicroBatcher(
            self._run_lookups,
            pipeline=BatchPipeline(self._lookups_pipelined, self._start_lookups, self._finish_lookups),
            cost=query_tokens,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_wait_s=config.max_batch_wait_s,
            observer=self.metrics.observe_batch,
            thread_initializer=lambda: _init_lookup_thread(config.effective_engine_threads),
            name="lookup",
        )
        # In Kafka mode the heartbeat times are the log records' (wall clock) timestamps, so
        # every replica's registry holds the same values (service/sources/kafka.py).
        self.registry = (InstanceRegistry(config.instance_timeout, clock=time.time)
                         if config.event_transport == "kafka" else InstanceRegistry(config.instance_timeout))
        self._reaper: asyncio.Task[None] | None = None
        self._events_thread: EventsThread | None = None
        #: Lookups open (``check_serving``): once compiled, and with
        #: ``refuse_lookups_until_ready`` once ready.
        self._serving = False
        #: The Kafka event source (``--event-transport kafka``), or None for HTTP push. Built
        #: before ``durability``, which reads its lag; it reads ``durability.restored`` (and
        #: ``fatal``) only once its threads run, after ``start``.
        self.source: Any = None
        if config.event_transport == "kafka":
            from .sources import build_kafka_source

            self.source = build_kafka_source(config, directory=self.directory, registry=self.registry,
                                             metrics=self.metrics, restored=lambda: self.durability.restored,
                                             fatal=lambda: self.fatal, note_ingested=self.note_ingested)
        self.durability = Durability(config.checkpoint_path, config.checkpoint_interval,
                                     require=config.require_checkpoint, max_ready_lag=config.max_ready_lag,
                                     directory=self.directory, registry=self.metrics.registry,
                                     lag=None if self.source is None else self.source.lag,
                                     log_reasons=None if self.source is None else self.source.not_ready_reasons,
                                     log_warnings=None if self.source is None else self.source.warnings)
        # The registry (heartbeat times, metadata) answers /instances and decides expiry: it
        # goes into the checkpoint as its own section (declared capacities travel with the
        # directory section).
        self.durability.register_section("registry", self.registry.snapshot, self.registry.restore)
        if self.source is not None:
            self.durability.register_section("stream_position", self.source.snapshot, self.source.restore)
        #: Where ``POST /events`` and the registry calls go (``event_source.py``): the routes'
        #: one seam, whatever the transport.
        self.events: EventSource = build_event_source(self, self.source)
        #: The vLLM KV-events publisher (``--kv-events-endpoint``), or None.
        self.kv_events: Any = None
        if config.kv_events_endpoint:
            from .publish.setup import build_publisher

            self.kv_events = build_publisher(config, registry=self.metrics.registry)
            self.kv_events.attach_directory(self.directory)  # the holder watch, and snapshots
            self.durability.register_section("kv_events", self.kv_events.snapshot, self.kv_events.restore)
        #: Why the server must not go on (a required checkpoint missing, an incompatible
        #: one): set by the restore; the CLI exits non-zero through a listener
        #: (:meth:`add_fatal_listener`).
        self.fatal: BaseException | None = None
        self._fatal_listeners: list[Callable[[BaseException], None]] = []
        self._restore_task: asyncio.Future | None = None
        #: The LMCache coordinator this one runs in front of (``--upstream-coordinator``), or
        #: None. Forwards and proxied calls go through it; lookups never do.
        self.upstream: Upstream | None = None
        if config.upstream_coordinator:
            self.upstream = Upstream(config.upstream_coordinator, timeout_s=config.upstream_timeout,
                                     connect_timeout_s=config.upstream_connect_timeout,
                                     queue_size=config.upstream_queue_size,
                                     queue_bytes=config.upstream_queue_bytes, registry=self.metrics.registry,
                                     registration_of=self.registration_of)
        self._after_ingest = AfterIngest(config.gc_freeze_ingest_bytes, config.release_free_heap,
                                         self._on_events_thread)
        self.started_at = time.time()
        #: When ``start`` compiles the kernels (``warmup.py``): ``"wait"`` (in ``start``, so an
        #: in-process app is compiled when its lifespan has started), ``"background"``
        #: (``blendmatch serve``: the port opens first; ``/readyz`` says ``compiling``, lookups
        #: and event posts answer 503 until done) or ``"off"`` (the warm-up's own scratch app).
        self.compile_mode = "wait"
        self._compile_task: asyncio.Future | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def blend_enabled(self) -> bool:
        return self.directory.blend_index is not None

    def engine_info(self) -> dict[str, str]:
        index = self.directory.blend_index
        if index is None:
            return {"name": "none", "reason": "blend lookup disabled (--disable-blend-lookup)"}
        return {"name": index.engine.name, "reason": index.engine.reason}

    async def start(self) -> None:
        try:  # the checkpoint path is checked and locked before anything else (durability.py)
            self.durability.prepare()
        except CheckpointRequired as exc:
            self.fatal = exc
            log.critical("%s", exc)
            raise
        self._events_thread = EventsThread()
        if self.kv_events is not None:  # its sockets first: a bad endpoint stops the start-up here
            self.kv_events.start()
        await self.lookups.start()
        if self.compile_mode == "background":
            self.durability.compiling = True
            self._compile_task = asyncio.ensure_future(self._compile())
        elif self.compile_mode == "wait":
            await self._compile()
        self._start_restore()
        if self.upstream is not None:
            await self.upstream.start()
        if self.source is not None:  # its threads wait for the restore (the position comes with it)
            self.source.start()
        if self.config.health_check_interval > 0:
            self._reaper = asyncio.create_task(self._reap_forever(), name="blendmatch-reaper")
        eng = self.engine_info()
        if self.compile_mode == "off":  # the warm-up's scratch app: the log is the real server's
            return
        log.info("blendmatch serving: engine %s (%s); chunk_size %d, probe_stride %d, max_batch_tokens %d, "
                 "max_batch_wait_ms %g, max_request_tokens %d, engine_threads %d", eng["name"], eng["reason"],
                 self.config.chunk_size, self.config.blend_probe_stride, self.config.max_batch_tokens,
                 self.config.max_batch_wait_ms, self.config.max_request_tokens, self.config.effective_engine_threads)

    async def _compile(self) -> None:
        """Compile (or load from the compile cache) every kernel the service runs
        (``warmup.compile_everything``, once per process, on a daemon thread with its own
        loop: a stop during a cold compile does not wait for it), then run the real index's
        own warm-up on the lookup thread (page-in). A failure there is a bug: fatal, as a
        failed restore is."""
        import threading

        from blendmatch.compile_cache import current as compile_cache

        from .warmup import compile_everything

        loop = asyncio.get_running_loop()
        index = self.directory.blend_index
        t0 = time.perf_counter()
        done: asyncio.Future = loop.create_future()

        def compile_all() -> None:
            outcome: BaseException | None = None
            try:
                compile_everything(self.config, filter_mode=None if index is None else index.filter)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop
                outcome = exc

            def settle() -> None:
                if done.done():
                    return
                if outcome is None:
                    done.set_result(None)
                else:
                    done.set_exception(outcome)

            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(settle)

        try:
            threading.Thread(target=compile_all, name="blendmatch-compile", daemon=True).start()
            await done
            if index is not None:
                await loop.run_in_executor(self.lookups.executor, index.warm_up)
        except Exception as exc:  # noqa: BLE001 - the server cannot promise its answers' latency
            self.fatal = exc
            log.critical("compiling the kernels failed", exc_info=exc)
            for listener in list(self._fatal_listeners):
                listener(exc)
            if self.compile_mode == "wait":
                raise
            return
        finally:
            self.durability.compiling = False
        if self.compile_mode == "background":
            log.info("compiled in %.1f s; compile cache: %s", time.perf_counter() - t0, compile_cache().describe())

    def check_compiled(self) -> None:
        """503 (:class:`ServiceUnavailable`, ``Retry-After: 1``) while the start-up compiles
        the kernels (``compile_mode`` "background"): the request would wait for it."""
        if self.durability.compiling:
            raise ServiceUnavailable("not ready yet (compiling): this server compiles its kernels after start "
                                     "(blendmatch warmup ahead makes that about a second); retry", retry_after_s=1)

    def _start_restore(self) -> None:
        """Restore on the events thread, first in its queue: event requests that arrive
        meanwhile wait behind it and then meet the restored gate (``durability.py``)."""
        assert self._events_thread is not None
        task = asyncio.wrap_future(self._events_thread.submit(self.durability.restore_at_start))

        def done(fut: asyncio.Future) -> None:
            exc = fut.exception() if not fut.cancelled() else None
            if exc is None:
                self.durability.start_periodic()
                return
            self.fatal = exc
            if isinstance(exc, CheckpointRequired):
                log.critical("%s", exc)
            else:
                log.critical("checkpoint restore failed", exc_info=exc)
            for listener in list(self._fatal_listeners):
                listener(exc)

        task.add_done_callback(done)
        self._restore_task = task

    def add_fatal_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Call ``listener(exc)`` when the service cannot go on (the CLI stops its server, which
        exists only after the app is built); at once if that already happened, so a listener
        added late never misses it."""
        self._fatal_listeners.append(listener)
        if self.fatal is not None:
            listener(self.fatal)

    async def wait_restored(self) -> None:
        """Until the start-up restore finished (raises what it raised)."""
        if self._restore_task is not None:
            await asyncio.shield(self._restore_task)

    async def stop(self) -> None:
        """Graceful: lookups still queued fail only if uvicorn gave up waiting for them;
        every event request already handed to the events thread is applied; then the final
        checkpoint is written (when checkpoints are on and the restore had finished)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        if self.source is not None:  # before the final checkpoint: its position is final
            await asyncio.get_running_loop().run_in_executor(None, self.source.stop)
        await self.lookups.stop()
        if self._events_thread is not None:
            events, self._events_thread = self._events_thread, None  # no new event tasks
            await asyncio.get_running_loop().run_in_executor(None, events.shutdown, True)
        if self.upstream is not None:  # after the events thread: every applied request has been queued
            await self.upstream.stop()
        if self.kv_events is not None:  # after the events thread: every applied change is queued
            await asyncio.get_running_loop().run_in_executor(None, self.kv_events.stop)
        self.durability.stop_periodic()
        if self.durability.enabled and self.durability.restored and self.fatal is None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.durability.checkpoint_now, "final")
            except Exception as exc:  # noqa: BLE001 - the previous one stands; the exit status says so
                dur = self.durability
                dur.final_error = f"{type(exc).__name__}: {exc}"
                last = ("no checkpoint written by this process" if dur.last_at is None else
                        f"the last one written at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(dur.last_at))}")
                log.error("final checkpoint to %s failed (%s): a restart restores %s, and what was applied after it "
                          "is lost; exiting non-zero", dur.path, dur.final_error, last)
        self.durability.release()

    # ------------------------------------------------------------------ lookups
    def check_tokens(self, n: int) -> None:
        """413 when one request carries more than ``max_request_tokens`` tokens."""
        try:
            check_token_count(n, self.config.max_request_tokens)
        except TokenLimitExceeded as exc:
            raise LimitExceeded(f"{exc.reason} (--max-request-tokens)") from None

    def check_serving(self) -> None:
        """503 (:class:`ServiceUnavailable`) while the start-up compiles the kernels
        (:meth:`check_compiled`); with ``refuse_lookups_until_ready`` also until readiness
        first holds, so that no lookup is answered from a partly restored or
        partly caught-up index where nothing routes by ``/readyz``. Once ready it stays open
        (the index never goes back; a later lag is a freshness question, as on any replica),
        so the hot path then pays one attribute read."""
        if self._serving:
            return
        self.check_compiled()
        if not self.config.refuse_lookups_until_ready:
            self._serving = True
            return
        ready, reasons = self.durability.readiness()
        if ready and self.fatal is None:
            self._serving = True
            log.info("ready: answering lookups")
            return
        why = "; ".join(reasons) if reasons else f"fatal: {self.fatal}"
        raise ServiceUnavailable(f"not ready yet ({why}): this server answers lookups once it has caught up; retry")

    async def lookup(self, query: LookupQuery) -> bytes:
        """One query through the batcher -> its ``{"matches": ...}`` JSON bytes.

        Raises :class:`TokenDecodeError` when its ``tokens_b64`` does not decode.
        """
        got = self.lookup_nowait(query)
        result = got if isinstance(got, bytes) else await got
        if isinstance(result, BaseException):  # the batcher raises per-query failures itself
            raise result
        return result

    def lookup_nowait(self, query: LookupQuery) -> "bytes | asyncio.Future[bytes | BaseException]":
        """:meth:`lookup` without a coroutine (the lookup lane, ``lane.py``): the answer at
        once (blend lookup disabled), or the batcher's future of the JSON bytes or of the
        query's own exception. Raises what :meth:`lookup` raises before it waits."""
        self.check_serving()
        if not self.blend_enabled:
            if type(query[0]) is DeferredQuery:
                query = query[0].resolve()
            _check_decodes([query])
            return EMPTY_MATCHES
        return self.lookups.submit_nowait(query)

    async def lookup_many(self, queries: list[LookupQuery]) -> list[bytes | BaseException]:
        """Several queries through the batcher; each item is its JSON bytes or its exception."""
        self.check_serving()
        if not self.blend_enabled:
            return [EMPTY_MATCHES if err is None else err for err in _decode_errors(queries)]
        return await self.lookups.submit_many(queries, return_exceptions=True)

    def _run_lookups(self, queries: list[LookupQuery]) -> list[bytes | BaseException]:
        """The batcher's ``run_batch`` (lookup thread): resolve each :class:`DeferredQuery`
        (the lane's bodies, parsed here), decode every ``tokens_b64`` of the batch in one
        GIL-free kernel call, run one engine batch over the queries that decoded, and encode
        each answer. A query that does not resolve gets its exception, one that does not
        decode its ``TokenDecodeError``."""
        return self._finish_lookups(self._start_lookups(queries, pipelined=False))

    def _lookups_pipelined(self) -> bool:
        """Whether the batcher pipelines lookups: only on a device engine that overlaps
        batches (``BlendIndex.pipelined``); the CPU engine keeps one call per batch."""
        index = self.directory.blend_index
        return index is not None and index.pipelined

    def _start_lookups(self, queries: list[LookupQuery], pipelined: bool = True) -> "_LookupBatch":
        """The first half of :meth:`_run_lookups` (lookup thread): resolve, decode and submit
        the engine batch. ``pipelined``: decode into the engine's pinned staging area
        (``BlendIndex.lend_tokens``) and return while the device works; otherwise the
        engine batch runs here."""
        index = self.directory.blend_index
        out: list[bytes | BaseException] = [EMPTY_MATCHES] * len(queries)
        if index is None:  # cannot happen: lookups short-circuit when disabled
            return _LookupBatch(queries, out, None, (), None, None)
        live: Sequence[int] = range(len(queries))
        if any(type(q[0]) is DeferredQuery for q in queries):
            queries, taken = list(queries), []
            for i, q in enumerate(queries):
                if type(q[0]) is DeferredQuery:
                    try:
                        queries[i] = q[0].resolve()
                    except Exception as exc:  # noqa: BLE001 - that query's answer: the lane hands it to the app
                        out[i] = exc
                        continue
                taken.append(i)
            live = taken
        tokens, offsets, errors = decode_query_tokens([queries[i][0] for i in live],
                                                      out=index.lend_tokens if pipelined else None)
        ready = []
        for i, err in zip(live, errors, strict=True):
            if err is None:
                ready.append(i)
            else:
                out[i] = err
        namespaces = [queries[i][1] for i in ready]
        if pipelined:
            return _LookupBatch(queries, out, (tokens, offsets), ready, index.match_flat_async(tokens, offsets,
                                                                                                namespaces), None)
        return _LookupBatch(queries, out, (tokens, offsets), ready, None, index.match_flat(tokens, offsets, namespaces))

    def _finish_lookups(self, batch: "_LookupBatch") -> list[bytes | BaseException]:
        """The second half of :meth:`_run_lookups` (lookup thread): wait for the engine batch,
        encode each answer (or run its finisher), observe reuse."""
        queries, out = batch.queries, batch.out
        if batch.flat is None:
            return out
        tokens, offsets = batch.flat
        results, stats = batch.done if batch.done is not None else batch.pending.result()
        self.metrics.observe_match(stats)
        observed = []
        for k, (i, matches) in enumerate(zip(batch.ready, results, strict=True)):
            query = queries[i]
            if len(query) == 2 or query[2].lookup:
                observed.append((query[1], tokens[offsets[k]:offsets[k + 1]], matches))
            if len(query) == 2:
                out[i] = encode_matches(matches)
                continue
            try:  # a finisher (service/routing.py: placements, the routing score)
                out[i] = query[2](matches, tokens[offsets[k]:offsets[k + 1]])  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001 - that query's failure, not the batch's
                out[i] = exc
        self.reuse.observe(observed)
        return out

    # ------------------------------------------------------------------ events and reads
    async def run_event_task(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a directory mutation on the events thread (arrival order)."""
        return await self._events_or_unavailable().run(fn, *args)

    async def run_event_group(self, group: GroupFn, args: tuple[Any, ...], size: int,
                              prepare: Callable[..., Any] | None = None) -> Any:
        """Run a task on the events thread in arrival order, in one ``group`` call with the
        tasks of the same ``group`` queued right behind it, after its ``prepare`` step ran
        on the prepare thread (``events_thread.py``)."""
        return await self._events_or_unavailable().run_grouped(group, args, size, prepare)

    def _events_or_unavailable(self) -> EventsThread:
        events = self._events_thread
        if events is None:
            raise ServiceUnavailable("the service is not started (or is shutting down)")
        return events

    # ------------------------------------------------------------------ registry
    def registration_of(self, instance_id: str) -> dict[str, Any] | None:
        """The ``POST /instances`` body that registers ``instance_id`` as it is registered
        here, or None (re-registration upstream after a forwarded heartbeat's 404)."""
        for row in self.registry.list():
            if row["instance_id"] == instance_id:
                return {k: row[k] for k in ("instance_id", "ip", "http_port", "metadata", "p2p_advertised_url",
                                            "mq_port")}
        return None

    def forward(self, kind: str, method: str, path: str, body: bytes | None = None, *, instance_id: str = "") -> None:
        """Queue a call that was applied here for the upstream coordinator, if there is one
        (never waits; ``upstream.py``)."""
        if self.upstream is not None:
            self.upstream.forward(kind, method, path, body, instance_id=instance_id)

    async def reap_once(self) -> list[str]:
        """One reaper sweep: expire instances silent for more than ``instance_timeout`` and,
        on the events thread (in order with event batches), fence their private L1
        placements and drop their event cursors (their declared capacity is kept, as in
        LMCache; ``DELETE /instances/{id}`` forgets it). Logged and counted. In Kafka mode
        only the replica holding the reaper role acts, by appending expiry fences that every
        replica applies (``sources/kafka.py``)."""
        return await self.events.reap_once()

    async def _reap_forever(self) -> None:
        """The reaper task (started in the lifespan when ``health_check_interval > 0``). A
        failed sweep is logged and retried on the next tick; it never ends the task."""
        interval = self.config.health_check_interval
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next sweep retries
                log.exception("registry sweep failed; retrying in %g s", interval)

    def note_ingested(self, nbytes: int) -> None:
        """Count event-body bytes: past ``config.gc_freeze_ingest_bytes``, ``gc.freeze()`` and
        (``config.release_free_heap``) the free heap back to the OS on the events thread
        (``heap.AfterIngest``: the rule and why)."""
        self._after_ingest.note(nbytes)

    def _on_events_thread(self, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` on the events thread, between two runs and with no lock held; its
        answer is not awaited, and a stopping service skips it."""
        events = self._events_thread
        if events is None:
            return
        try:
            events.submit(fn)
        except RuntimeError:  # shut down meanwhile
            pass

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a read that takes the directory lock off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def gauge_values(self) -> dict[str, Any]:
        """Flat counts for the scrape-time gauges (takes the directory lock briefly)."""
        stats = self.directory.stats()
        blend = stats.get("blend_index") or {}
        snap: dict[str, Any] = {
            "num_keys": stats.get("keys"),
            "num_placements": stats.get("placements"),
            "num_bindings": stats.get("token_bindings"),
            "queue_depth": self.lookups.queue_depth,
            "events_queue_depth": 0 if self._events_thread is None else self._events_thread.pending,
            "instances_registered": len(self.registry),
        }
        for key in ("num_contents", "num_chunks", "num_claims", "num_namespaces", "memory_bytes", "table_size",
                    "engine_failovers"):
            if key in blend:
                snap[key] = blend[key]
        eng = self.engine_info()
        snap["engine"], snap["engine_reason"] = eng["name"], eng["reason"]
        snap["ready"] = int(self.durability.readiness()[0] and self.fatal is None)
        return snap

    def stats(self) -> dict[str, Any]:
        """``GET /directory/stats``: LMCache's names at the top (and nothing else there), ours
        under ``blendmatch``: the directory's own counts, ``blend`` (the index's full stats),
        ``registry``, ``log`` (Kafka mode), ``engine``, ``batcher``, ``chunk_size``."""
        ours = dict(self.directory.stats())
        index_stats = ours.pop("blend_index", None) or {}
        ours["blend"] = index_stats
        ours["chunk_size"] = self.config.chunk_size
        ours["registry"] = self.registry.counters()
        if self.source is not None:
            ours["log"] = self.source.stats()
        if self.kv_events is not None:
            ours["kv_events"] = self.kv_events.stats()
        ours["engine"] = self.engine_info()
        ours["reuse"] = self.reuse.stats()
        ours["batcher"] = {**self.lookups.stats.as_dict(), "queue_depth": self.lookups.queue_depth,
                           "max_batch_tokens": self.config.max_batch_tokens,
                           "max_batch_wait_ms": self.config.max_batch_wait_ms}
        top = {name: ours.pop(name) for name in _LMCACHE_STATS if name in ours}
        # LMCache's blend fields are always there (zeros while blend lookup is off)
        top["blend"] = {name: index_stats.get(name, 0) for name in _LMCACHE_BLEND_STATS}
        top["blendmatch"] = ours
        return top


#: LMCache 0.5.6's ``DirectoryStats`` names (``GET /directory/stats``'s top level) besides
#: ``blend``, and its ``BlendIndexStats`` names (``blend``'s).
_LMCACHE_STATS = ("num_keys", "num_placements", "l1_keys_by_instance", "l1_count", "l1_size_bytes", "l2_count",
                  "l2_size_bytes")
_LMCACHE_BLEND_STATS = ("num_contents", "num_chunks", "num_claims", "num_namespaces", "table_size")


async def get_context(request: Request) -> ServiceContext:
    """The app's context (the one place that reads ``app.state``). ``async`` on purpose:
    FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop per request."""
    return request.app.state.blendmatch_context  # type: ignore[no-any-return]


#: Route parameter type: ``async def route(ctx: Ctx)``.
Ctx = Annotated[ServiceContext, Depends(get_context)]
