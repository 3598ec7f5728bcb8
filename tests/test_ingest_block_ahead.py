"""Ingest maps the index's next token block before it takes the index's write lock (issue 28
item 2): mapping and pre-faulting a block cost ~2.5 ms, paid under the lock that every
lookup's verification waits on. Checked by recording, for every block the token store
allocates while a directory ingests, whether the write lock was held and which thread
mapped it (once past half of the last block, the next one is mapped on the blocks thread,
not by the ingesting thread); and that the answers are those of a directory that allocates
under the lock (the old way), with exactly one block more mapped ahead."""

from __future__ import annotations

import threading

import numpy as np

import blendmatch.index.storage as storage
from blendmatch.bench.events import make_requests
from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.types import BlendNamespace

C = 16


def _directory(monkeypatch, allocations: list[tuple[bool, str]] | None) -> KeyDirectory:
    monkeypatch.setattr(storage.TokenStore, "BLOCK_BYTES", 64 * C * 4)  # 64 rows per block
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="cpu")
    if allocations is not None:
        real = storage._alloc_block
        lock = d.blend_index.write_lock  # type: ignore[union-attr]
        monkeypatch.setattr(storage, "_alloc_block",
                            lambda rows, width: allocations.append((lock._is_owned(), threading.current_thread().name))
                            or real(rows, width))
    return d


def test_token_blocks_are_mapped_outside_the_write_lock(monkeypatch):
    held: list[tuple[bool, str]] = []
    d = _directory(monkeypatch, held)
    for req in make_requests(1000, 24, C, seed=3):  # crosses 15 block boundaries, 24 entries at a time
        d.apply(req)
    assert len(held) >= 15 and not any(locked for locked, _ in held), held
    ahead = [name for _, name in held if name.startswith("blendmatch-blocks")]
    assert len(ahead) >= 14, held  # all but the first growth found its block mapped ahead
    assert d.stats()["blend_index"]["num_chunks"] == 1000

    old = _directory(monkeypatch, None)
    old.blend_index.prepare_add = lambda rows: None  # type: ignore[union-attr,method-assign]
    for req in make_requests(1000, 24, C, seed=3):
        old.apply(req)
    rng = np.random.default_rng(0)
    rows = [np.asarray(e["token_ids"], dtype=np.uint32) for req in make_requests(1000, 24, C, seed=3)
            for e in req["batches"][0]["entries"]]
    query = np.concatenate([rows[i] for i in rng.choice(1000, 40, replace=False)])
    ns = BlendNamespace("meta-llama/Llama-3.1-8B", "", 1)
    assert d.blend_match(query, ns) == old.blend_match(query, ns) and len(d.blend_match(query, ns)) == 40
    block = 64 * C * 4
    assert d.blend_index.memory_bytes() - old.blend_index.memory_bytes() == block  # type: ignore[union-attr]
