"""Registry records, applied in one place whatever the event source.

Question answered: "what does a registration, heartbeat, deregistration or expiry do to
this replica's registry and directory?" Both event sources call :func:`apply_control`:
HTTP push (``event_source.HttpPushSource``) with a record built from the request, on the
events thread; Kafka (``kafka.KafkaSource``) with the decoded control record
(``records.py``), with the directory lock held, in its place between event records. So
the two transports cannot drift: the same registry call, the same fence, the same metric
label, the same (escaped) log line.

What stays with each transport is only what the transport itself decides: where the
record comes from, the reply, and (Kafka) the log position that makes an expiry fence
apply only to the heartbeat it judged stale.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from blendmatch.index.key_directory import FenceResult, KeyDirectory
from blendmatch.index.logsafe import log_safe
from blendmatch.index.registry import InstanceRegistry

from .records import CONTROL_OPS

__all__ = ["ControlOutcome", "apply_control"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlOutcome:
    """What one record did. ``applied``: register always; heartbeat, deregister and expire
    when the instance was registered. ``fenced``: the directory's fence (deregister, expire)."""

    op: str
    instance_id: str
    applied: bool
    re_registered: bool = False
    fenced: Optional[FenceResult] = None


def apply_control(record: Mapping[str, Any], *, registry: InstanceRegistry, directory: KeyDirectory,
                  instance_events: Any, at: Optional[float] = None,
                  max_instances: Optional[int] = None) -> ControlOutcome:
    """Apply one registry record ``{"op", "instance_id", ...}`` (``records.CONTROL_OPS``).

    - ``register`` (``ip``, ``http_port``, optional ``metadata``, ``p2p_advertised_url``,
      ``mq_port``): insert or replace; a blank id gets a generated one (returned); not
      applied (counted ``refused_bound``) when it would register one more instance than
      ``max_instances`` (``--max-instances``; None: no bound), the same decision on every
      replica since each applies the same records to the same registry;
    - ``heartbeat``: record it; not applied for an unknown instance (the caller's 404);
    - ``deregister``: forget the instance, fence its private L1 placements, drop its event
      cursor and its declared capacity; idempotent;
    - ``expire``: the same fence, but the declared capacity stays (LMCache's reaper). With
      ``last_heartbeat``, only if the instance's last heartbeat is still that one (a
      heartbeat that arrived after the sweep judged it stale saves it).

    ``at``: the time to record (a log transport passes the record's timestamp so that every
    replica holds the same values); None: now. Deregister and expire take the directory's
    lock: call on the events thread or with ``directory.ingest_lock`` held. Counts
    ``instance_events`` by outcome; raises ``ValueError`` for an unknown op.
    """
    op, iid = record["op"], record["instance_id"]
    if op == "register":
        if max_instances is not None and (not iid or not registry.contains(iid)) and len(registry) >= max_instances:
            instance_events.labels("refused_bound").inc()
            log.warning("registration of instance %s refused: %d instances are registered (--max-instances)",
                        log_safe(iid), len(registry))
            return ControlOutcome(op, iid, False)
        iid, again = registry.register(iid, record["ip"], record["http_port"], metadata=record.get("metadata") or {},
                                       p2p_advertised_url=str(record.get("p2p_advertised_url", "")),
                                       mq_port=int(record.get("mq_port", 0)), at=at, registered_at=at)
        instance_events.labels("re_registered" if again else "registered").inc()
        return ControlOutcome(op, iid, True, re_registered=again)
    if op == "heartbeat":
        known = registry.heartbeat(iid, at=at)
        instance_events.labels("heartbeat" if known else "unknown_heartbeat").inc()
        return ControlOutcome(op, iid, known)
    if op == "deregister":
        was = registry.remove(iid)
        result = directory.drop_instance(iid)
        instance_events.labels("deregistered").inc()
        return ControlOutcome(op, iid, was, fenced=result)
    if op == "expire":
        if not registry.expire_instance(iid, last_heartbeat=record.get("last_heartbeat")):
            return ControlOutcome(op, iid, False)
        result = directory.drop_instance(iid, forget_capacity=False)
        instance_events.labels("expired").inc()
        log.warning("expired instance %s (fence from %s): fenced %d L1 placements (%d keys dropped)", log_safe(iid),
                    log_safe(str(record.get("reaper", "this replica"))), result.placements, result.keys)
        return ControlOutcome(op, iid, True, fenced=result)
    raise ValueError(f"unknown control op {op!r} (one of {', '.join(CONTROL_OPS)})")
