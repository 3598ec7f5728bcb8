"""Declared capacity and used bytes: the two halves of LMCache's ``/instances/usage``.

Question answered: "how much may each instance's memory compartment hold, and how much
does it hold now?" Cache events report bytes held, never bytes holdable, so servers declare
capacity on ``config`` batches; the directory keeps the used bytes from its placements.

:class:`CapacityDeclarations` (LMCache 0.5.6's ``ServerConfigRegistry`` rule): one
declaration is one ``config`` batch per compartment ``(tier, backend)``, all sharing an
``(incarnation, capacity_revision)`` stamp. Per instance, a *newer* stamp starts a fresh
declaration (a compartment it omits stops being reported), an *equal* stamp extends it, an
*older* one is a straggler and is dropped. Capacity 0 means "no limit declared"
(:data:`UNDECLARED_CAPACITY`): its usage ratio is ``None``, never a division by zero.

:class:`UsageLedger`: running totals of placement bytes per ``(owner, tier, backend)``
(owner ``""`` is a shared pool) and count and bytes per tier, kept incrementally by the
directory so that stats and a metrics scrape cost O(1), not a walk of the keys.

Neither class locks: the directory calls them with its own lock held. Declarations travel in
checkpoints as plain JSON-able data (``export_state`` / ``restore_state``); the ledger is
derived from the placements and rebuilt from them after a restore (``UsageLedger.rebuild``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from .placements import SHARED_POOL_INSTANCE

__all__ = ["UNDECLARED_CAPACITY", "CapacityDeclarations", "Compartment", "UsageLedger", "instance_usage_report",
           "usage_ratio", "usage_report"]

#: "No cap declared": real caps are positive, so an unlimited backend declaring 0 must not
#: read as permanently full.
UNDECLARED_CAPACITY = 0


class Compartment(NamedTuple):
    """One declared memory compartment of an instance."""

    tier: str
    backend: str
    capacity_bytes: int
    shared: bool


def usage_ratio(used_bytes: int, capacity_bytes: int) -> Optional[float]:
    """``used / capacity``, or None when no capacity was declared (not clamped: above 1.0
    means the declared cap disagrees with what the tier admitted)."""
    return used_bytes / capacity_bytes if capacity_bytes > UNDECLARED_CAPACITY else None


class CapacityDeclarations:
    """Each instance's newest capacity declaration (see the module docstring)."""

    def __init__(self) -> None:
        self._by_instance: dict[str, dict[tuple[str, str], Compartment]] = {}
        self._stamps: dict[str, tuple[int, int]] = {}

    def consume(self, instance_id: str, incarnation: int, revision: int, tier: str, backend: str,
                capacity_bytes: int, shared: bool) -> bool:
        """Apply one admitted config batch; returns False when it was an older straggler."""
        stamp = (incarnation, revision)
        stored = self._stamps.get(instance_id, (-1, -1))
        if stamp < stored:
            return False
        if stamp > stored:
            self._by_instance[instance_id] = {}
            self._stamps[instance_id] = stamp
        self._by_instance[instance_id][(tier, backend)] = Compartment(tier, backend, capacity_bytes, shared)
        return True

    def forget(self, instance_id: str) -> None:
        """Drop an instance's declaration (it deregistered or expired). Idempotent."""
        self._by_instance.pop(instance_id, None)
        self._stamps.pop(instance_id, None)

    def get(self, instance_id: str) -> tuple[Compartment, ...]:
        return tuple(self._by_instance.get(instance_id, {}).values())

    def stamp(self, instance_id: str) -> Optional[tuple[int, int]]:
        return self._stamps.get(instance_id)

    def instances(self) -> list[str]:
        return list(self._by_instance)

    def rows(self) -> list[dict[str, Any]]:
        """Every declared compartment, for ``/directory/stats``."""
        return [{"instance_id": inst, "tier": c.tier, "backend": c.backend, "capacity_bytes": c.capacity_bytes,
                 "capacity_revision": self._stamps[inst][1], "incarnation": self._stamps[inst][0],
                 "shared": c.shared}
                for inst, comps in self._by_instance.items() for c in comps.values()]

    def export_state(self) -> dict[str, Any]:
        """Checkpoint state, plain JSON-able data (stamps travel with the modules, so a restored registry
        still drops stragglers from before the snapshot)."""
        return {"declarations": [
            {"instance_id": inst, "incarnation": inc, "revision": rev,
             "modules": [list(c) for c in self._by_instance.get(inst, {}).values()]}
            for inst, (inc, rev) in self._stamps.items()]}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Replace everything with an :meth:`export_state` value."""
        self._by_instance.clear()
        self._stamps.clear()
        for d in state.get("declarations", ()):
            inst = str(d["instance_id"])
            self._stamps[inst] = (int(d["incarnation"]), int(d["revision"]))
            self._by_instance[inst] = {(str(t), str(b)): Compartment(str(t), str(b), int(c), bool(s))
                                       for t, b, c, s in d.get("modules", ())}


class UsageLedger:
    """Bytes held per ``(owner, tier, backend)`` and count/bytes per tier (running totals)."""

    def __init__(self) -> None:
        self.by_owner: dict[tuple[str, str, str], int] = {}
        self.tier_count: dict[str, int] = {"l1": 0, "l2": 0}
        self.tier_bytes: dict[str, int] = {"l1": 0, "l2": 0}

    def add(self, owner: str, tier: str, backend: str, count: int, delta_bytes: int) -> None:
        """``count`` placements appeared (negative: went) and bytes changed by ``delta_bytes``."""
        if count:
            self.tier_count[tier] = self.tier_count.get(tier, 0) + count
        if delta_bytes:
            self.tier_bytes[tier] = self.tier_bytes.get(tier, 0) + delta_bytes
            ident = (owner, tier, backend)
            total = self.by_owner.get(ident, 0) + delta_bytes
            if total > 0:
                self.by_owner[ident] = total
            else:
                self.by_owner.pop(ident, None)

    def rebuild(self, placements: Iterable[Any]) -> None:
        """Start over from every placement held (after a restore). O(placements)."""
        self.by_owner.clear()
        self.tier_count = {"l1": 0, "l2": 0}
        self.tier_bytes = {"l1": 0, "l2": 0}
        for p in placements:
            self.add(p.instance_id, p.tier, p.backend, 1, p.size_bytes)

    def remove_placements(self, placements: Iterable[Any]) -> None:
        """Placements (``Placement`` tuples) that went away."""
        for p in placements:
            self.add(p.instance_id, p.tier, p.backend, -1, -p.size_bytes)

    def owners(self) -> dict[str, dict[tuple[str, str], int]]:
        """``owner -> (tier, backend) -> bytes``; shared pools under ``""``."""
        out: dict[str, dict[tuple[str, str], int]] = {}
        for (owner, tier, backend), n in self.by_owner.items():
            out.setdefault(owner, {})[(tier, backend)] = n
        return out


def usage_report(owners: Mapping[str, Mapping[tuple[str, str], int]], declared: Mapping[str, Sequence[Any]],
                 registered: Iterable[str] = ()) -> dict[str, Any]:
    """LMCache's ``GET /instances/usage`` body from the ledger's bytes per owner and the
    declarations: every instance that is registered, holds bytes or declared capacity, and
    the shared pools counted once (capacity only where every declaring instance agrees)."""
    registered = set(registered)
    instances = [instance_usage_report(inst, owners.get(inst, {}), declared.get(inst, ()), inst in registered)
                 for inst in sorted(registered | (set(owners) - {SHARED_POOL_INSTANCE}) | set(declared))]
    claims: dict[tuple[str, str], set[int]] = {}
    for comps in declared.values():
        for c in comps:
            if c.shared:
                claims.setdefault((c.tier, c.backend), set()).add(c.capacity_bytes)
    shared = [_module_usage(t, b, used, _agreed(claims.get((t, b))), True)
              for (t, b), used in sorted(owners.get(SHARED_POOL_INSTANCE, {}).items())]
    return {"instances": instances, "shared_modules": shared}


def _module_usage(tier: str, backend: str, used: int, capacity: int, shared: bool) -> dict[str, Any]:
    return {"tier": tier, "backend": backend, "shared": shared, "used_bytes": used, "capacity_bytes": capacity,
            "usage_ratio": usage_ratio(used, capacity)}


def instance_usage_report(instance_id: str, used: Mapping[tuple[str, str], int], declared: Sequence[Any],
                    registered: bool) -> dict[str, Any]:
    """LMCache's ``InstanceMemoryStatus``: private compartments sorted by (tier, backend);
    declared-but-empty compartments report 0 bytes; shared ones are fleet-level."""
    caps = {(c.tier, c.backend): c.capacity_bytes for c in declared}
    modules = {(t, b): _module_usage(t, b, n, caps.get((t, b), 0), False) for (t, b), n in used.items()}
    for c in declared:
        if not c.shared and (c.tier, c.backend) not in modules:
            modules[(c.tier, c.backend)] = _module_usage(c.tier, c.backend, 0, c.capacity_bytes, False)
    return {"instance_id": instance_id, "registered": registered, "declared_capacity": bool(declared),
            "modules": [modules[k] for k in sorted(modules)]}


def _agreed(values: Optional[set[int]]) -> int:
    """A shared pool's capacity: the one value every declaring instance agrees on, else 0
    (undeclared: picking one would depend on declaration order)."""
    return next(iter(values)) if values and len(values) == 1 else 0
