"""librdkafka's log through :class:`ClientLog`: one line per kind per interval, each saying
how many were left out (issue 45, item 4; the broker-down figure is in
tests/test_kafka_topics.py). No broker: confluent-kafka calls ``logger.log(level, fmt, fac,
name, message)``, which these tests call the same way."""

from __future__ import annotations

import logging

from blendmatch.service.sources import client_log
from blendmatch.service.sources.client_log import ClientLog

FMT = "%s [%s] %s"


def _fail(cl: ClientLog, n: int, fac: str = "FAIL", level: int = logging.ERROR) -> None:
    for i in range(n):
        cl.log(level, FMT, fac, "rdkafka#consumer-1", f"127.0.0.1:9/bootstrap: Connect to ipv4#127.0.0.1:9 failed ({i})")


def test_one_line_per_kind_per_interval_with_the_count_left_out(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(client_log.time, "monotonic", lambda: now[0])
    cl = ClientLog(interval=60.0)
    with caplog.at_level(logging.DEBUG, logger="blendmatch.service.kafka.client"):
        _fail(cl, 500)
        _fail(cl, 3, fac="ERROR")
        now[0] += 59.0
        _fail(cl, 100)
        now[0] += 1.5  # past the interval since the first FAIL line
        _fail(cl, 1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("librdkafka FAIL [rdkafka#consumer-1] 127.0.0.1:9/bootstrap: Connect") \
        and lines[0].endswith("(0)")
    assert lines[1].startswith("librdkafka ERROR ")
    assert lines[2].endswith("(599 more FAIL lines in the last 60 s)"), lines[2]
    assert [r.levelno for r in caplog.records] == [logging.ERROR] * 3
    assert (cl.received, cl.forwarded) == (604, 3)


def test_the_level_librdkafka_gave_is_kept():
    got = []

    class Target:
        def log(self, level, msg, *args):
            got.append((level, msg % args))

        def isEnabledFor(self, level):  # noqa: N802
            return True

    cl = ClientLog(interval=60.0, target=Target())  # type: ignore[arg-type]
    cl.log(logging.WARNING, FMT, "PARTCNT", "rdkafka#producer-1", "partition count changed from 1 to 4")
    assert got == [(logging.WARNING, "librdkafka PARTCNT [rdkafka#producer-1] partition count changed from 1 to 4")]
