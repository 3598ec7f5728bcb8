"""Placements: who holds which copy of a key, where.

Question answered: "on which instance, tier and backend does a copy of this key live, and
which copies die when an instance restarts?" A placement is one copy of a key:
``(instance_id, incarnation, tier, backend, size_bytes, shared)``. One key has at most one
placement per ``(instance_id, tier, backend)`` (:func:`placement_ident`). A shared-pool
placement (``shared=true`` batches) belongs to no instance: it is stored with
``instance_id ""`` (:data:`SHARED_POOL_INSTANCE`) and incarnation 0, so every reporter of
the same pool and tier updates (and any reporter's DELETE drops) the same placement.
Fencing an instance drops its private L1 copies (:func:`is_private_l1`) and keeps its L2
and shared ones (their memory outlives a process restart).
"""

from __future__ import annotations

from typing import NamedTuple

from .types import ObjectKey

__all__ = ["L1", "SHARED_POOL_INSTANCE", "KeyPlacements", "Placement", "is_private_l1", "placement_ident"]

#: The tier whose copies live in an instance's own memory (fenced when it restarts).
L1 = "l1"

#: ``instance_id`` of a shared-pool placement (it belongs to no one instance).
SHARED_POOL_INSTANCE = ""


class Placement(NamedTuple):
    """One copy of a key: on which instance (``""`` for a shared pool), tier and backend."""

    instance_id: str
    incarnation: int
    tier: str
    backend: str
    size_bytes: int
    shared: bool


class KeyPlacements(NamedTuple):
    """A key and (some of) its placements, as :meth:`KeyDirectory.list_keys` returns them."""

    key: ObjectKey
    placements: tuple[Placement, ...]


def placement_ident(p: Placement) -> tuple[str, str, str]:
    """What makes two placements of one key the same copy: ``(instance_id, tier, backend)``
    (a newer report of the same copy replaces the older one)."""
    return p.instance_id, p.tier, p.backend


def is_private_l1(p: Placement, instance_id: str) -> bool:
    """Is ``p`` a private (non-shared) L1 copy on ``instance_id``? Those die when it restarts."""
    return p.instance_id == instance_id and p.tier == L1 and not p.shared
