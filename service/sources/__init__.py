"""Event sources: where cache events (and, in a fleet, registry calls) come from.

- **HTTP push** (``--event-transport http``, the default): ``POST /events`` applies on the
  events thread; the registry lives in this process. One node.
- **Kafka** (``--event-transport kafka``, :mod:`.kafka`): the replica follows LMCache's
  cache-event topic; ``POST /events`` and the registry routes append to the topic, and
  every replica applies what it reads. N replicas; ``docs/fleet.md``.

The routes see neither: they call ``service/event_source.py``'s ``EventSource`` (one
implementation per transport). Both feed the same gate (``KeyDirectory.apply_detailed`` /
``apply_many``) and apply registry records through the one :func:`.control.apply_control`. ``confluent_kafka`` is an
optional dependency (``pip install 'blendmatch[kafka]'``): :func:`build_kafka_source`
imports it only when Kafka mode is asked for, so an HTTP-mode server runs without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KafkaUnavailable", "build_kafka_source"]


class KafkaUnavailable(RuntimeError):
    """Kafka mode was asked for but ``confluent_kafka`` is not installed."""


def build_kafka_source(config: Any, **kwargs: Any) -> Any:
    """A :class:`~blendmatch.service.sources.kafka.KafkaSource` (imports confluent_kafka)."""
    try:
        import confluent_kafka  # noqa: F401
    except ImportError as exc:
        raise KafkaUnavailable("--event-transport kafka needs confluent-kafka: pip install 'blendmatch[kafka]' "
                               f"({exc})") from None
    from .kafka import KafkaSource

    return KafkaSource(config, **kwargs)
