"""The replica's appends to the log (``POST /events`` and the registry routes in Kafka mode):
answered within a bounded time, by a producer that is replaced when it breaks.

Question answered: "how long can an append take, and what if the producer is wedged?"

- **Bounded answer time** (``--kafka-produce-timeout``, default 5 s): librdkafka fails a
  record it could not deliver within that time (``message.timeout.ms``), and the request
  stops waiting at the same bound whatever the client library does. The answer is then a
  503 naming the bound; the records may still have been appended (an idempotent append:
  resending is safe, the gate counts the copy as a duplicate). Before this, a broker
  outage held each request 30 s.
- **A producer that broke is replaced**: an idempotent producer whose broker came back
  without its producer state (``UNKNOWN_PRODUCER_ID``, out-of-order sequence, a fenced
  epoch, any fatal error) or that let records time out can stay wedged for good (seen:
  every later append timed out after a broker restart). After such an error the poll
  thread builds a new producer (a new producer id), purges the old one (its waiting
  requests are answered at once) and counts it
  (``blendmatch_kafka_producer_renewals_total{reason}``); at most one renewal per bound,
  so an outage does not churn producers.
- **The poll thread never dies** of a client error: it renews the producer instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Optional

from confluent_kafka import KafkaError, KafkaException, Producer
from prometheus_client import Counter

from ..errors import ServiceUnavailable

__all__ = ["LogProducer", "MAX_RECORD_BYTES"]

log = logging.getLogger("blendmatch.service.kafka")

#: Largest record the producer sends (librdkafka's default ``message.max.bytes``; brokers
#: default to about the same). One LMCache batch is one record, so this bounds a batch
#: appended through ``POST /events``: about 500 entries of 256 tokens as JSON lists.
MAX_RECORD_BYTES = 1_000_000

#: Delivery errors after which the producer is replaced (the others concern one record).
_RENEW_ON = {KafkaError.UNKNOWN_PRODUCER_ID, KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
             KafkaError.INVALID_PRODUCER_EPOCH, KafkaError.PRODUCER_FENCED, KafkaError._MSG_TIMED_OUT,
             KafkaError._TIMED_OUT, KafkaError._FATAL, KafkaError.INVALID_PRODUCER_ID_MAPPING}


class LogProducer:
    """One per source. ``append`` runs on the event loop; a thread polls the producer."""

    def __init__(self, bootstrap: str, client_id: str, timeout_s: float, registry: Any,
                 logger: Optional[Any] = None) -> None:
        self.bootstrap, self.client_id, self.timeout_s = bootstrap, client_id, timeout_s
        self.logger = logger  # librdkafka's log (client_log.py); None: librdkafka prints it to stderr
        self._producer: Optional[Producer] = None
        self._renew: Optional[str] = None      # why the poll thread should replace the producer
        self._renewed_at = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.renewals = 0
        self.m_renewals = Counter("blendmatch_kafka_producer_renewals", "producers replaced after an error",
                                  ["reason"], registry=registry)

    def _make(self) -> Producer:
        conf = {"bootstrap.servers": self.bootstrap, "client.id": self.client_id,
                "enable.idempotence": True, "acks": "all", "linger.ms": 1,
                "message.timeout.ms": max(1, int(self.timeout_s * 1000)),
                "message.max.bytes": MAX_RECORD_BYTES, "error_cb": self._on_error}
        if self.logger is not None:
            conf["logger"] = self.logger
        return Producer(conf)

    def start(self, guard: Callable[[Callable[[], None]], Callable[[], None]]) -> threading.Thread:
        self._producer = self._make()
        self._thread = threading.Thread(target=guard(self._loop), name="blendmatch-kafka-producer", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self._producer is not None:
            left = self._producer.flush(5.0)
            if left:
                log.warning("%d appended records were not acknowledged before the stop", left)

    @property
    def running(self) -> bool:
        return self._producer is not None and not self._stop.is_set()

    # ------------------------------------------------------------------ renewal
    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self.ask_renewal(f"fatal: {err.name()}")

    def ask_renewal(self, why: str) -> None:
        if self._renew is None:
            self._renew = why

    def _loop(self) -> None:
        try:
            self._producer.list_topics(timeout=5)  # warms the idempotent producer (PID), 0.5 s otherwise
        except KafkaException:
            pass
        while not self._stop.is_set():
            why = self._renew
            if why is not None and time.monotonic() - self._renewed_at >= self.timeout_s:
                self._replace(why)
            try:
                self._producer.poll(0.05)
            except Exception as exc:  # noqa: BLE001 - never die of a client error: replace the producer
                log.warning("kafka producer poll failed (%s: %s): replacing it", type(exc).__name__, exc)
                self.ask_renewal(f"poll: {type(exc).__name__}")
                self._stop.wait(0.05)

    def _replace(self, why: str) -> None:
        old, self._producer = self._producer, self._make()
        self._renew, self._renewed_at = None, time.monotonic()
        self.renewals += 1
        self.m_renewals.labels(why.split(":")[0]).inc()
        log.warning("kafka producer replaced (%s): appends go through a new producer id", why)
        try:  # its waiting requests are answered now (purged), not at their bound
            old.purge()
            old.flush(1.0)
        except Exception:  # noqa: BLE001 - the old one is dropped either way
            log.debug("purging the replaced producer failed", exc_info=True)

    # ------------------------------------------------------------------ appends
    async def append(self, topic: str, records: list[tuple[bytes, bytes, Optional[list]]]) -> list[tuple[int, int]]:
        """Append ``(key, value, headers)`` records; their ``(partition, offset)`` once the
        broker acknowledged every one, within ``timeout_s``. Raises ServiceUnavailable
        otherwise (the message says how many were appended, or that it is unknown)."""
        producer = self._producer
        if producer is None or self._stop.is_set():
            raise ServiceUnavailable("the Kafka producer is not running")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = [loop.create_future() for _ in records]

        def callback(fut: asyncio.Future) -> Callable[[Any, Any], None]:
            def done(err: Any, msg: Any) -> None:
                if err is not None and (err.code() in _RENEW_ON or err.fatal()):
                    self.ask_renewal(f"delivery: {err.name()}")
                result = (err, None) if err is not None else (None, (msg.partition(), msg.offset()))
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))
            return done

        try:
            for (key, value, headers), fut in zip(records, futures):
                producer.produce(topic, value=value, key=key, headers=headers, on_delivery=callback(fut))
        except (BufferError, KafkaException) as exc:
            raise ServiceUnavailable(f"could not append to {topic}: {exc}") from None
        try:
            results = await asyncio.wait_for(asyncio.gather(*futures), self.timeout_s)
        except asyncio.TimeoutError:
            self.ask_renewal("no acknowledgement")
            raise ServiceUnavailable(
                f"the broker did not acknowledge within {self.timeout_s:g} s (--kafka-produce-timeout): it may be "
                "unreachable; the records may or may not have been appended, resending is safe") from None
        errors = [err for err, _ in results if err is not None]
        if errors:
            codes = {e.code() for e in errors}
            why = ("the producer was replaced after an error while they waited" if KafkaError._PURGE_QUEUE in codes
                   else "the broker may be unreachable" if KafkaError._MSG_TIMED_OUT in codes else str(errors[0]))
            others = "; the others were appended" if len(errors) < len(records) else ""
            raise ServiceUnavailable(f"the broker did not acknowledge {len(errors)} of {len(records)} records ({why}; "
                                     f"appends wait at most {self.timeout_s:g} s, --kafka-produce-timeout){others}; "
                                     "resending is safe")
        return [pos for _, pos in results]
