"""The ingest gate: which batches of an instance's event stream should be applied?

Question answered: "is this batch new, a duplicate, stale, or the first of a restarted
instance?" Transport-neutral: HTTP push and a durable log (Kafka) feed it the same batches,
so replicas that apply the same log admit the same batches.

Per instance it keeps ``(incarnation, last_seq)``:
- a lower incarnation is **stale** (dropped);
- a higher incarnation means the instance restarted: its L1 placements must be **fenced**
  before the batch is applied (:attr:`Admission.FENCE_AND_APPLY`);
- ``seq <= last_seq`` is a **duplicate** (dropped: at-least-once delivery is harmless);
- a gap (``seq > last_seq + 1``) is logged, counted and admitted (LMCache's sink drops a
  batch it failed to send and moves on, so a gap is lost history, not a reason to stall).

Not thread-safe by itself: the directory calls it under its own lock.
"""

from __future__ import annotations

import enum
import logging
from typing import NamedTuple, Optional

from .logsafe import log_safe

__all__ = ["Admission", "InstanceCursor", "IngestGate"]

log = logging.getLogger(__name__)


class Admission(enum.Enum):
    """What the gate decided about one batch."""

    APPLY = "apply"
    #: The instance restarted (higher incarnation): fence its L1 placements, then apply.
    FENCE_AND_APPLY = "fence_and_apply"
    DUPLICATE = "duplicate"
    STALE = "stale"


class InstanceCursor(NamedTuple):
    """Where the gate stands for one instance."""

    incarnation: int
    last_seq: int


class IngestGate:
    """Per-instance ordering of event batches (see the module docstring for the rules).

    Counters (cumulative): ``applied``, ``duplicates``, ``stale`` (batches), ``gaps`` (batches
    that arrived after a gap), ``missed`` (sequence numbers skipped by those gaps) and
    ``fences`` (restarts seen). Call with the owner's lock held.
    """

    def __init__(self) -> None:
        self._cursors: dict[str, InstanceCursor] = {}
        self.applied = 0
        self.duplicates = 0
        self.stale = 0
        self.gaps = 0
        self.missed = 0
        self.fences = 0

    def admit(self, instance_id: str, incarnation: int, seq: int) -> Admission:
        """Classify one batch and, when it is to be applied, advance the instance's cursor."""
        cur = self._cursors.get(instance_id)
        verdict = Admission.APPLY
        last_seq = 0
        if cur is not None:
            if incarnation < cur.incarnation:
                self.stale += 1
                return Admission.STALE
            if incarnation > cur.incarnation:
                verdict = Admission.FENCE_AND_APPLY
                self.fences += 1
            elif seq <= cur.last_seq:
                self.duplicates += 1
                return Admission.DUPLICATE
            else:
                last_seq = cur.last_seq
        if seq > last_seq + 1:
            self.gaps += 1
            self.missed += seq - last_seq - 1
            log.warning("cache events from %s (incarnation %d): gap before seq %d (last applied %d)",
                        log_safe(instance_id), incarnation, seq, last_seq)
        self._cursors[instance_id] = InstanceCursor(incarnation, seq)
        self.applied += 1
        return verdict

    def forget(self, instance_id: str) -> bool:
        """Drop the instance's cursor: its next batch is admitted as a first batch, whatever
        its incarnation and seq. Used when an instance deregisters or expires, and as the undo
        for a forged incarnation (one batch with a huge incarnation would otherwise mark every
        later, honest batch stale until a restart). Returns whether a cursor was there.
        Idempotent."""
        return self._cursors.pop(instance_id, None) is not None

    @property
    def tracked(self) -> int:
        """Instances with a cursor."""
        return len(self._cursors)

    def cursor(self, instance_id: str) -> Optional[InstanceCursor]:
        """The instance's ``(incarnation, last_seq)``, or None if never seen."""
        return self._cursors.get(instance_id)

    def cursors(self) -> dict[str, InstanceCursor]:
        """A snapshot of every instance's cursor."""
        return dict(self._cursors)

    def export_state(self) -> dict:
        """Checkpoint state: cursors and counters as a JSON-able document. Every field of
        :class:`InstanceCursor` is kept by name, so fields added later survive too."""
        return {"cursors": {inst: c._asdict() for inst, c in self._cursors.items()}, "counters": self.counters()}

    def restore_state(self, doc: dict) -> None:
        """Replace the cursors and counters by an :meth:`export_state`: a batch it had
        admitted is then a duplicate again."""
        self._cursors = {str(inst): InstanceCursor(**c) for inst, c in doc["cursors"].items()}
        for name, value in doc.get("counters", {}).items():
            if name in ("applied", "duplicates", "stale", "gaps", "missed", "fences"):
                setattr(self, name, int(value))

    def counters(self) -> dict[str, int]:
        return {"applied": self.applied, "duplicates": self.duplicates, "stale": self.stale,
                "gaps": self.gaps, "missed": self.missed, "fences": self.fences}
