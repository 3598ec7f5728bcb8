"""Dense ids for the namespaces that claim chunks in the blend index, with a live-claim count each.

Claims store a namespace as a small integer (the kernels compare integers, never strings);
this table is the one mapping between the two. Ids are never reused, so a lookup's ids,
taken once per batch, stay valid however claims change under it. Not thread-safe: the
:class:`~blendmatch.index.blend_index.BlendIndex` lock guards it.
"""

from __future__ import annotations

import sys
from typing import Any

from .types import BlendNamespace

__all__ = ["NamespaceIds"]


class NamespaceIds:
    """``id_of(ns)`` (created on first use), ``get(ns)`` (-1 when unknown) and ``claims[id]``,
    the live claims of each id (callers add and subtract as they claim and drop)."""

    def __init__(self) -> None:
        self._ids: dict[BlendNamespace, int] = {}
        self.claims: list[int] = []

    def id_of(self, ns: BlendNamespace) -> int:
        """The namespace's id, created (its strings interned: many claims share them) if new."""
        nid = self._ids.get(ns)
        if nid is None:
            nid = len(self.claims)
            self._ids[BlendNamespace(sys.intern(ns.model_name), sys.intern(ns.cache_salt), int(ns.world_size))] = nid
            self.claims.append(0)
        return nid

    def get(self, ns: BlendNamespace) -> int:
        """The namespace's id, or -1 when nothing ever claimed under it."""
        return self._ids.get(ns, -1)

    def live(self) -> int:
        """How many namespaces hold at least one claim now."""
        return sum(1 for c in self.claims if c > 0)

    def export(self) -> dict[str, Any]:
        """JSON-able: ``namespaces`` (``[model, salt, world_size]`` per id) and ``ns_claims``."""
        ns_list: list[Any] = [None] * len(self.claims)
        for ns, nid in self._ids.items():
            ns_list[nid] = [ns.model_name, ns.cache_salt, int(ns.world_size)]
        return {"namespaces": ns_list, "ns_claims": list(self.claims)}

    def restore(self, doc: dict[str, Any]) -> None:
        """Replace the table by an :meth:`export` (ids unchanged: the claim columns hold them)."""
        ids: dict[BlendNamespace, int] = {}
        for nid, item in enumerate(doc["namespaces"]):
            if item is not None:
                model, salt, ws = item
                ids[BlendNamespace(sys.intern(model), sys.intern(salt), int(ws))] = nid
        self._ids = ids
        self.claims = [int(x) for x in doc["ns_claims"]]
