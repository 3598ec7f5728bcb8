"""The instance registry: which MP servers are alive, and which went silent.

Question answered: "which LMCache MP servers are registered, and which have not sent a
heartbeat for longer than the timeout?" LMCache 0.5.6's servers call ``POST /instances``
and ``PUT /instances/{id}/heartbeat`` on the same coordinator URL they send events and
lookups to; a 404 on a heartbeat makes them re-register (``lmcache.v1.mp_coordinator.
registrar.keep_registered``). Membership is thin data: ip, ports, metadata, times.

What expiry *means* for the cache is the directory's business: the service's reaper
calls :meth:`InstanceRegistry.expire` and hands each expired id to
``KeyDirectory.drop_instance`` (fence its private L1 placements, forget its event cursor),
the same as LMCache's health loop. Its L2 and shared placements stay: their storage
outlives the process and leaves only through DELETE events.

Clock: liveness uses a monotonic clock (an NTP step cannot expire the fleet);
``registration_time`` is wall-clock, for display. Both clocks are injectable for tests.

Thread safety: one lock guards the table; every method takes it. The registry never calls
out while holding it.

Persistence: :meth:`snapshot` / :meth:`restore` are plain JSON-able data. A heartbeat's
monotonic time is meaningless in another process, so the snapshot stores each instance's
*age* (seconds since its last heartbeat) and a restore re-bases it on the new clock: the
time the coordinator was down does not count against the fleet.
"""

from __future__ import annotations

from .logsafe import log_safe

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

if TYPE_CHECKING:
    from .key_directory import KeyDirectory

__all__ = ["DEFAULT_HEALTH_CHECK_INTERVAL_S", "DEFAULT_INSTANCE_TIMEOUT_S", "InstanceRecord", "InstanceRegistry"]

log = logging.getLogger(__name__)

#: LMCache's defaults: a sweep every 10 s, expiry after 30 s without a heartbeat (its
#: servers heartbeat every 5 s).
DEFAULT_HEALTH_CHECK_INTERVAL_S = 10.0
DEFAULT_INSTANCE_TIMEOUT_S = 30.0


@dataclass
class InstanceRecord:
    """One registered MP server (LMCache's ``MPInstance``)."""

    instance_id: str
    ip: str
    http_port: int
    registration_time: float
    last_heartbeat: float
    metadata: dict[str, str] = field(default_factory=dict)
    p2p_advertised_url: str = ""
    mq_port: int = 0

    def as_wire(self) -> dict[str, Any]:
        """The ``GET /instances`` row (LMCache's fields)."""
        return {"instance_id": self.instance_id, "ip": self.ip, "http_port": self.http_port,
                "registration_time": self.registration_time, "metadata": dict(self.metadata),
                "p2p_advertised_url": self.p2p_advertised_url, "mq_port": self.mq_port}


class InstanceRegistry:
    """Registered instances and their heartbeats (see the module docstring).

    Counters (cumulative): ``registrations``, ``re_registrations``, ``heartbeats``,
    ``unknown_heartbeats`` (answered 404), ``removals`` and ``expirations``.
    """

    def __init__(self, timeout_s: float = DEFAULT_INSTANCE_TIMEOUT_S, *,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        if not timeout_s > 0:
            raise ValueError(f"instance timeout must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._instances: dict[str, InstanceRecord] = {}
        self.registrations = 0
        self.re_registrations = 0
        self.heartbeats = 0
        self.unknown_heartbeats = 0
        self.removals = 0
        self.expirations = 0

    def register(self, instance_id: str, ip: str, http_port: int, *, metadata: Optional[Mapping[str, str]] = None,
                 p2p_advertised_url: str = "", mq_port: int = 0, at: Optional[float] = None,
                 registered_at: Optional[float] = None) -> tuple[str, bool]:
        """Insert or replace an instance -> ``(instance_id, re_registered)``. A blank id
        gets a generated one (``mp-<32 hex>``, as LMCache). Counts as a heartbeat.

        ``at`` / ``registered_at``: the heartbeat time (on the registry's clock) and the
        wall-clock registration time to record instead of "now": a log transport passes
        the record's timestamp, so that every replica applying the log holds the same
        values (``service/sources/kafka.py``)."""
        instance_id = instance_id.strip() or f"mp-{uuid.uuid4().hex}"
        record = InstanceRecord(instance_id, ip, int(http_port),
                                self._wall() if registered_at is None else float(registered_at),
                                self._clock() if at is None else float(at),
                                dict(metadata or {}), p2p_advertised_url, int(mq_port))
        with self._lock:
            existed = instance_id in self._instances
            self._instances[instance_id] = record
            self.registrations += 1
            self.re_registrations += existed
        return instance_id, existed

    def heartbeat(self, instance_id: str, *, at: Optional[float] = None) -> bool:
        """Record a heartbeat (at ``at`` on the registry's clock, default now); False for an
        unknown instance (the caller answers 404 and the server re-registers)."""
        now = self._clock() if at is None else float(at)
        with self._lock:
            record = self._instances.get(instance_id)
            if record is None:
                self.unknown_heartbeats += 1
                return False
            record.last_heartbeat = now
            self.heartbeats += 1
            return True

    def remove(self, instance_id: str) -> bool:
        """Deregister; returns whether it was registered. Idempotent."""
        with self._lock:
            gone = self._instances.pop(instance_id, None) is not None
            self.removals += gone
            return gone

    def contains(self, instance_id: str) -> bool:
        with self._lock:
            return instance_id in self._instances

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._instances)

    def live_ids(self, now: Optional[float] = None) -> frozenset[str]:
        """The instances that count as alive at ``now`` (default: the registry's clock):
        registered and heard from within ``timeout_s`` (one :meth:`expire` would not remove).
        Placement-aware answers serve only their copies (``placement_rank.py``)."""
        now = self._clock() if now is None else now
        with self._lock:
            return frozenset(i for i, r in self._instances.items() if now - r.last_heartbeat <= self.timeout_s)

    def list(self) -> list[dict[str, Any]]:
        """Every instance as its ``GET /instances`` row, in registration order."""
        with self._lock:
            return [r.as_wire() for r in self._instances.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._instances)

    def expire(self, now: Optional[float] = None) -> list[str]:
        """Remove and return every instance silent for more than ``timeout_s`` (strictly)
        at ``now`` (default: the registry's clock). The caller fences what they held."""
        now = self._clock() if now is None else now
        with self._lock:
            gone = [i for i, r in self._instances.items() if now - r.last_heartbeat > self.timeout_s]
            for i in gone:
                del self._instances[i]
            self.expirations += len(gone)
        for i in gone:
            log.warning("instance %s sent no heartbeat for more than %g s: expired (its L1 placements are fenced)",
                        log_safe(i), self.timeout_s)
        return gone

    def stale(self, now: Optional[float] = None) -> list[tuple[str, float]]:
        """``(instance_id, last_heartbeat)`` of every instance :meth:`expire` would remove at
        ``now``, without removing them: a fleet's reaper publishes these as expiry fences and
        every replica removes them when it applies the fence (:meth:`expire_instance`)."""
        now = self._clock() if now is None else now
        with self._lock:
            return [(i, r.last_heartbeat) for i, r in self._instances.items() if now - r.last_heartbeat > self.timeout_s]

    def expire_instance(self, instance_id: str, *, last_heartbeat: Optional[float] = None) -> bool:
        """Remove one instance as expired (an applied expiry fence); whether it was here.
        With ``last_heartbeat`` (from :meth:`stale`), only if no heartbeat came since."""
        with self._lock:
            record = self._instances.get(instance_id)
            gone = record is not None and (last_heartbeat is None or record.last_heartbeat == last_heartbeat)
            if gone:
                del self._instances[instance_id]
            self.expirations += gone
        if gone:
            log.warning("instance %s sent no heartbeat for more than %g s: expired (its L1 placements are fenced)",
                        log_safe(instance_id), self.timeout_s)
        return gone

    def usage(self, directory: "KeyDirectory", instance_id: Optional[str] = None) -> Optional[dict[str, Any]]:
        """``GET /instances/usage`` (``instance_id`` None) or ``GET /instances/{id}/usage``
        (None when that instance is unknown): the directory's used bytes joined to declared
        capacity, with this registry's membership."""
        if instance_id is None:
            return directory.usage(self.ids())
        return directory.instance_usage(instance_id, self.contains(instance_id))

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"registered": len(self._instances), "registrations": self.registrations,
                    "re_registrations": self.re_registrations, "heartbeats": self.heartbeats,
                    "unknown_heartbeats": self.unknown_heartbeats, "removals": self.removals,
                    "expirations": self.expirations}

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """Plain JSON-able state: ``{"version": 1, "timeout_s", "instances": [{..., "age_s"}]}``."""
        now = self._clock()
        with self._lock:
            rows = [{**r.as_wire(), "age_s": max(0.0, now - r.last_heartbeat)} for r in self._instances.values()]
        return {"version": 1, "timeout_s": self.timeout_s, "instances": rows}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Replace the table with a :meth:`snapshot` value (ages re-based on this clock)."""
        if state.get("version", 1) != 1:
            raise ValueError(f"unsupported registry snapshot version {state.get('version')!r}")
        now = self._clock()
        records = _records(state.get("instances", ()), now)
        with self._lock:
            self._instances = {r.instance_id: r for r in records}


def _records(rows: Iterable[Mapping[str, Any]], now: float) -> list[InstanceRecord]:
    return [InstanceRecord(str(row["instance_id"]), str(row["ip"]), int(row["http_port"]),
                           float(row.get("registration_time", 0.0)), now - float(row.get("age_s", 0.0)),
                           {str(k): str(v) for k, v in dict(row.get("metadata", {})).items()},
                           str(row.get("p2p_advertised_url", "")), int(row.get("mq_port", 0)))
            for row in rows]
