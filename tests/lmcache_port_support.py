"""What the ports of LMCache's key-directory and blend-index tests share
(``test_lmcache_ported_key_directory.py``, ``test_lmcache_ported_blend_index.py``): the same
behaviour as LMCache's tests, asserted in our own words against our public API.

Source: LMCache/LMCache ``tests/v1/mp_coordinator/test_key_directory.py`` and
``test_blend_index.py`` at commit ``08340ea459272bf990c73fa42cb476614a4ee4ad`` (the
closest version of these files we could reach to the 0.5.6 release; the 0.5.6 wheel's
``BlendIndex`` names its ``remove`` ``remove_claim``, otherwise the API the tests use is the
wheel's). One test per LMCache test, same name; its docstring names the original.

What changed in the port, and only that:

- LMCache feeds ``KeyDirectory.consume(CacheEventBatch(...))`` directly; blendmatch's
  directory takes the ``POST /events`` body (``KeyDirectory.apply``), so each batch goes in
  as wire JSON, through our ingest gate (every test's batches already have fresh
  ``(instance, incarnation, seq)``). A batch LMCache cannot construct (empty backend on a
  store, tier ``all``, ``seq`` 0, ...) is a ``ValueError`` from ``apply`` here, with nothing
  applied.
- ``get_token_ids`` answers ``None`` (ours) where LMCache answers ``()``; ``list_keys`` is
  our ``key_page`` (total + a page of ``KeyPlacements``); ``stats``/``blend_stats`` are dicts
  (``stats()["blend_index"]``). ``BlendIndex.remove(content, hash, ns)`` is our
  ``remove_claim``.
- Where blendmatch deliberately differs (docs/lmcache.md "Deliberate differences"), the
  test says "Differs" in its docstring and asserts our documented behaviour instead.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from blendmatch.index import BlendMatch, BlendNamespace, KeyDirectory, ObjectKey, pack_kv_rank, wire_batch, wire_entry

#: The namespace ``okey``'s keys store in, so the one blend queries over them ask from.
NS = BlendNamespace(model_name="m", world_size=1)


def okey(b: int, rank: int = 0, world_size: int = 1, model: str = "m", salt: str = "") -> ObjectKey:
    """A key shaped as a server emits one (``kv_rank`` packs the parallel setup)."""
    return ObjectKey(chunk_hash=bytes([b]) * 4, model_name=model,
                     kv_rank=pack_kv_rank(world_size, rank, world_size, rank), cache_salt=salt)


def entries(keys: list[ObjectKey], size: Optional[int], tokens: Optional[list[int]], offset: int) -> list[dict]:
    """Wire entries for ``keys``; ``size`` None leaves ``size_bytes`` out (delete, access)."""
    out = []
    for k in keys:
        e = wire_entry(k.chunk_hash, k.model_name, k.kv_rank, cache_salt=k.cache_salt, size_bytes=size or 0,
                       token_ids=tokens or None, token_offset=offset)
        if size is None:
            e.pop("size_bytes")
        out.append(e)
    return out


def apply_batch(d: KeyDirectory, keys: Optional[list[ObjectKey]] = None, *, instance: str = "node-a",
                inc: int = 1, seq: int = 1, kind: str = "store", tier: str = "l1", backend: str = "dram",
                size: Optional[int] = 1024, shared: bool = False, tokens: Optional[list[int]] = None,
                offset: int = 0) -> None:
    """Apply one batch (LMCache's ``_batch`` defaults: node-a, incarnation 1, L1 dram, 1 KiB)."""
    wire = entries(keys if keys is not None else [okey(0xAA)], size, tokens, offset)
    counts = d.apply({"batches": [wire_batch(instance, seq, kind, wire, incarnation=inc, tier=tier,
                                             backend=backend, shared=shared)]})
    assert counts.applied == 1, counts  # every batch here is fresh at the gate


def tokens_of(d: KeyDirectory, *bs: int) -> list[list[int]]:
    """Each chunk's known tokens as a list (``[]``: unknown or not yet carried)."""
    return [[] if t is None else t.tolist() for t in d.get_token_ids([bytes([b]) * 4 for b in bs])]


def query(*tokens: int) -> np.ndarray:
    """A blend query as LMCache's tests build one (uint64 ids)."""
    return np.asarray(tokens, dtype=np.uint64)


def blend_directory(chunk: int) -> KeyDirectory:
    """A directory with blend lookup on (CPU engine: the ports test behaviour, not engines)."""
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=chunk, probe_stride=1, engine="cpu")
    return d


def as_tuples(matches: list[BlendMatch]) -> list[tuple[bytes, int, int]]:
    """Matches as ``(chunk_hash, old_st, cur_st)``, what LMCache's tests compare."""
    return [(m.chunk_hash, m.old_st, m.cur_st) for m in matches]
