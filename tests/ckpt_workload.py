"""A random cache-event workload and a full-answer fingerprint of a directory (checkpoint tests).

The workload exercises everything a checkpoint must carry: several instances and
incarnations (restarts fence L1), L1/L2/shared tiers, stores with and without tokens,
content shared by several chunk hashes (occupant order matters), re-stores with different
content, deletes and re-adds (a re-added hash goes last), several namespaces, a STORE of
the wrong length (private tokens), config batches (capacities), and seq gaps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.types import BlendNamespace, ObjectKey, pack_kv_rank
from blendmatch.index.wire_models import wire_batch, wire_entry

C = 4
MODELS = ("m", "n")
SALTS = ("", "s")
INSTANCES = ("a", "b", "c")


def _h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def token_offsets(d: KeyDirectory, chunk_hashes: list[bytes]) -> list[int | None]:
    """Each chunk hash's binding offset (-1 unknown; None: no binding), read through the
    directory's public state (``export_state``, the checkpoint's view), not an accessor of
    its own: an offset is otherwise observable only as a match's ``old_st``."""
    with d.ingest_lock:
        state = d.export_state()
        offsets = dict(zip(state["hashes"], state["offsets"]))
    return [None if h not in offsets else int(offsets[h]) for h in chunk_hashes]


def contents(seed: int) -> np.ndarray:
    """The workload's few distinct contents (few: many occupants per content)."""
    return np.random.default_rng(seed + 10_000).integers(0, 40, size=(12, C), dtype=np.uint32)


def workload(seed: int, n_batches: int = 120, *, restarts: bool = True) -> list[dict[str, Any]]:
    """``n_batches`` wire batches in emission order (per instance: increasing seq).
    ``restarts=False``: one incarnation and no seq gaps, so every batch is admitted once
    and a replayed one is exactly a duplicate."""
    rng = np.random.default_rng(seed)
    contents_ = contents(seed)
    seq = {i: 0 for i in INSTANCES}
    inc = {i: 0 for i in INSTANCES}
    out = []
    for _ in range(n_batches):
        inst = INSTANCES[int(rng.integers(len(INSTANCES)))]
        r = rng.random()
        if restarts and r < 0.04:  # restart: new incarnation, seq starts over
            inc[inst] += 1
            seq[inst] = 0
        seq[inst] += 2 if restarts and rng.random() < 0.05 else 1  # an occasional gap
        kind = "store" if r < 0.6 else ("delete" if r < 0.9 else ("config" if r < 0.95 else "access"))
        tier = "l2" if rng.random() < 0.2 else "l1"
        shared = tier == "l2" and rng.random() < 0.5
        model = MODELS[int(rng.integers(2))]
        salt = SALTS[int(rng.integers(2))]
        ws = 1 if rng.random() < 0.8 else 2
        entries = []
        for _ in range(int(rng.integers(1, 6))):
            h = _h(int(rng.integers(60)))
            kw: dict[str, Any] = {"cache_salt": salt, "size_bytes": int(rng.integers(1, 4)) * 512}
            if kind == "store":
                p = rng.random()
                if p < 0.75:
                    kw["token_ids"] = contents_[int(rng.integers(len(contents_)))].tolist()
                    kw["token_offset"] = int(rng.integers(0, 4)) * C if rng.random() < 0.9 else -1
                elif p < 0.8:
                    kw["token_ids"] = rng.integers(0, 40, size=C + 1).tolist()  # wrong length
                    kw["token_offset"] = 0
            entries.append(wire_entry(h, model, pack_kv_rank(ws), **kw))
        extra: dict[str, Any] = {}
        if kind == "config":
            entries = []
            extra = {"capacity_bytes": int(rng.integers(1, 1 << 30)), "capacity_revision": int(rng.integers(5))}
        out.append(wire_batch(inst, seq[inst], kind, entries, incarnation=inc[inst], tier=tier, shared=shared,
                              backend="LocalCPUBackend" if tier == "l1" else "Disk", **extra))
    return out


def queries(seed: int, n: int = 40) -> list[tuple[np.ndarray, BlendNamespace]]:
    """Queries built from workload ``seed``'s contents (so they hit), in every namespace."""
    rng = np.random.default_rng(seed + 20_000)
    cs = contents(seed)
    out = []
    for _ in range(n):
        parts = [cs[int(rng.integers(len(cs)))] for _ in range(int(rng.integers(1, 6)))]
        parts.append(rng.integers(0, 40, size=int(rng.integers(0, 3)), dtype=np.uint32))
        ns = BlendNamespace(MODELS[int(rng.integers(2))], SALTS[int(rng.integers(2))], 1 if rng.random() < 0.8 else 2)
        out.append((np.concatenate(parts).astype(np.uint32), ns))
    return out


def answers(d: KeyDirectory, seed: int) -> dict[str, Any]:
    """Everything a client can ask, in full: blend matches, key listings (order included),
    placements, tokens, offsets, counts (slot-table internals aside: a restore rebuilds it)."""
    qs = queries(seed)
    out: dict[str, Any] = {}
    if d.blend_index is not None:
        out["matches"] = d.blend_index.match_batch(qs)
        out["single"] = [d.blend_match(t, ns) for t, ns in qs[:5]]
    listing = d.list_keys(limit=None)
    out["list"] = listing
    keys = [kp.key for kp in listing] + [ObjectKey(_h(999), "m", pack_kv_rank(1), 0, "")]
    out["lookup"] = d.lookup(keys)
    out["access"] = d.access_counts(keys)
    hashes = [_h(i) for i in range(60)]
    out["tokens"] = [None if t is None else t.tolist() for t in d.get_token_ids(hashes)]
    out["offsets"] = token_offsets(d, hashes)
    stats = d.stats()
    blend = stats.pop("blend_index")
    if blend is not None:
        for k in list(blend):
            if k.startswith("table_") or k in ("memory_bytes", "engine_reason"):
                blend.pop(k)
    out["stats"] = stats
    out["blend_stats"] = blend
    return out


def feed(d: KeyDirectory, batches: list[dict[str, Any]]) -> list[Any]:
    return [d.apply({"batches": [b]}) for b in batches]
