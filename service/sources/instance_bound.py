"""The bound on tracked instance ids (``--max-instances``) for event requests, decided once.

Question answered: "may this event request name an instance id the directory does not track
yet?" A producer that invents instance ids would grow the gate's cursors and the stats
without bound; ``--max-instances`` caps the ids with an event cursor. Both transports decide
it where they apply, in order (:func:`apply_within_bound`): HTTP push on the events thread,
the Kafka source with the directory lock held, in log order. So every replica at the same
log position accepts and refuses the same records: the decision is derived from the log,
like everything else a replica holds. Kafka mode also checks before appending
(:func:`check_instance_bound` against this replica's applied state), so a client usually
hears its 429 at once; a record that passes there and not at apply time (appends racing on
several replicas, or records written by LMCache's own sink) is skipped by every replica alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable

from blendmatch.index.key_directory import ApplyReport, KeyDirectory
from blendmatch.index.logsafe import log_safe
from blendmatch.index.wire import EventRequest

from ..errors import TooManyInstances

__all__ = ["RunTally", "apply_within_bound", "check_instance_bound"]


@dataclass
class RunTally:
    """What the requests applied in a stretch of runs did, summed (the Kafka source's
    metrics per fetched stretch of the log; HTTP push reports each request on its own):
    the batch counts, the entries of applied batches, the requests applied and the STORE
    entries that fed nothing to the blend index, by reason."""

    applied: int = 0
    duplicates: int = 0
    stale: int = 0
    entries: int = 0
    requests: int = 0
    not_indexable: dict[str, int] = field(default_factory=dict)

    def add(self, report: ApplyReport) -> None:
        """Count one applied request's report."""
        c = report.counts
        self.applied += c.applied
        self.duplicates += c.duplicates
        self.stale += c.stale
        self.entries += report.entries_applied
        self.requests += 1
        for reason, n in report.not_indexable.items():
            self.not_indexable[reason] = self.not_indexable.get(reason, 0) + n


def apply_within_bound(directory: KeyDirectory, requests: list[EventRequest], max_instances: int | None,
                       done: str) -> list[ApplyReport | Exception]:
    """Apply decoded event requests in order as few ``KeyDirectory.apply_many`` runs, each
    request refused whole (:class:`TooManyInstances`, nothing of it applied) when its instance
    ids not tracked yet would take the count past ``max_instances`` (None: no bound). The
    bound depends on what the requests before it applied, so a request that names an
    instance id the directory does not track yet first applies the run gathered so far,
    then is checked against the directory as it is: exactly what one-by-one application
    would check. Both transports call it where they apply (HTTP push on the events thread,
    the Kafka source with the directory lock held, in log order), so every replica at the
    same log position accepts and refuses the same records. Each answer is the request's
    report or its error (``apply_many``'s)."""
    out: list[ApplyReport | Exception | None] = [None] * len(requests)
    run: list[EventRequest] = []
    where: list[int] = []

    def apply_gathered() -> None:
        if run:
            for k, report in zip(where, directory.apply_many(run)):
                out[k] = report
            run.clear()
            where.clear()

    for k, request in enumerate(requests):
        if max_instances is not None:
            ids = [batch.instance_id for batch in request.batches]
            if directory.unknown_instances(ids)[1]:  # new ids: the bound depends on the run so far
                apply_gathered()
                try:
                    check_instance_bound(directory, ids, max_instances, done)
                except TooManyInstances as exc:
                    out[k] = exc
                    continue
        run.append(request)
        where.append(k)
    apply_gathered()
    return out  # type: ignore[return-value]


def check_instance_bound(directory: KeyDirectory, instance_ids: Iterable[str], max_instances: int, done: str) -> None:
    """The bound on tracked instance ids (``--max-instances``) for one event request:
    :class:`TooManyInstances` (429) when its ids not tracked yet would take the count of
    instances with an event cursor past the bound. One rule for both transports, decided
    where each applies (:func:`apply_within_bound`); in Kafka mode it is also checked before
    anything is appended, against what this replica applied, so that a client hears the 429
    at once in the common case (a record that passes here and not at apply time, because
    appends raced on several replicas, is skipped by every replica alike)."""
    tracked, new = directory.unknown_instances(instance_ids)
    if new and tracked + len(new) > max_instances:
        raise TooManyInstances(f"body.batches: instance {json.dumps(log_safe(new[0]))} would be one more than the "
                               f"{max_instances} instance ids this server tracks (--max-instances; {tracked} now); "
                               f"ids leave when their instance deregisters or expires; nothing was {done}")
