"""Writers adding and removing while readers match: no exceptions, every match verifiable."""

from __future__ import annotations

import threading

import numpy as np

from blendmatch.index import BlendIndex, BlendNamespace

NS = BlendNamespace("m")


def test_concurrent_writers_and_readers():
    c = 16
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 1 << 31, size=(3000, c), dtype=np.uint32)
    content_of = {b"%d" % i: pool[i] for i in range(len(pool))}
    idx = BlendIndex(chunk_size=c, engine="cpu")
    idx.add_many(pool[:500], [b"%d" % i for i in range(500)], np.arange(500) * c, NS)
    errors: list[BaseException] = []
    stop = threading.Event()
    checked = [0]

    def writer(seed: int) -> None:
        r = np.random.default_rng(seed)
        try:
            for _ in range(400):
                i = int(r.integers(0, len(pool)))
                h = b"%d" % i
                if r.random() < 0.6:
                    idx.add(pool[i], h, i * c, NS)
                else:
                    idx.remove_claim(pool[i], h, NS)
                if r.random() < 0.05:  # bulk path too (forces rebuilds as the set grows)
                    j = r.integers(0, len(pool), size=64)
                    idx.add_many(pool[j], [b"%d" % k for k in j], j * c, NS)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    def reader(seed: int) -> None:
        r = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                picks = r.integers(0, len(pool), size=40)
                q = np.concatenate([pool[picks].ravel(), r.integers(0, 1 << 31, size=100, dtype=np.uint32)])
                rev = q[::-1].copy()
                for qq, res in zip((q, rev), idx.match_batch([(q, NS), (rev, NS)])):
                    for m in res:
                        assert np.array_equal(qq[m.cur_st:m.cur_st + c], content_of[m.chunk_hash])
                        assert m.old_st == int(m.chunk_hash) * c
                        checked[0] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    readers = [threading.Thread(target=reader, args=(100 + s,)) for s in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    stop.set()
    for t in readers:
        t.join(timeout=60)
    assert not errors, errors
    assert checked[0] > 0
    # the final state answers exactly what a fresh index built from the survivors answers
    st = idx.stats()
    assert st["num_chunks"] == st["num_claims"] == st["num_contents"]
    q = pool.ravel()
    survivors = idx.match(q, NS)
    fresh = BlendIndex(chunk_size=c, engine="reference")
    for m in survivors:
        fresh.add(content_of[m.chunk_hash], m.chunk_hash, m.old_st, NS)
    assert fresh.match(q, NS) == survivors and len(survivors) == st["num_chunks"]


def test_a_lookup_sees_a_whole_request_or_none_of_it():
    """Issue 23: a lookup could see half of one event request (41% of lookups during a
    300-entry batch saw exactly one of its first and last chunks). Each request here either
    stores 300 new chunks or gives the same 300 chunk hashes new content (a removal and an
    add per entry); a reader racing the writer must see every chunk of a request or none:
    for the query "old contents ++ new contents", all of the old, all of the new, or nothing."""
    from blendmatch.index import KeyDirectory, pack_kv_rank, wire_batch, wire_entry

    c, k, requests = 4, 300, 24
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=c, engine="cpu")
    ns = BlendNamespace("m", "", 1)

    def content(r: int, version: int) -> np.ndarray:  # distinct ids per request and version
        base = 1 + ((r * 2 + version) * k) * c
        return np.arange(base, base + k * c, dtype=np.uint32).reshape(k, c)

    def request(r: int, version: int) -> dict:
        rows = content(r, version)
        return {"batches": [wire_batch("w", 2 * r + version + 1, "store", [
            wire_entry((r * k + i).to_bytes(8, "big"), "m", pack_kv_rank(1), token_ids=rows[i].tolist(),
                       token_offset=i * c) for i in range(k)])]}

    bodies = [request(r, v) for r in range(requests) for v in (0, 1)]
    queries = [(np.concatenate([content(r, 0).reshape(-1), content(r, 1).reshape(-1)]), ns) for r in range(requests)]
    started = [0]
    done = threading.Event()
    seen: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i, body in enumerate(bodies):
                started[0] = i // 2
                d.apply(body)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
        finally:
            done.set()

    def reader() -> None:
        try:
            reads = 0
            while not done.is_set() or reads < 50:
                r = started[0]
                got = d.blend_index.match_batch([queries[r], queries[max(r - 1, 0)]])
                for res in got:
                    old = sum(m.cur_st < k * c for m in res)
                    seen.append((old, len(res) - old))
                reads += 1
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    partial = [s for s in seen if s not in ((0, 0), (k, 0), (0, k))]
    assert not partial, f"{len(partial)} of {len(seen)} lookups saw part of a request, e.g. {partial[:5]}"
    # not vacuous: the readers saw whole requests land (which kinds they catch depends on the
    # scheduler: the old version of a request lives only until its rewrite, microseconds when
    # the writer runs alone, so requiring both kinds failed on a quiet machine)
    assert {(k, 0), (0, k)} & set(seen)


def test_verification_keeps_the_gil_inside_the_lock(monkeypatch):
    """A lookup verifies under the index lock. A kernel there that released the GIL handed it
    to the busy event loop and kept the lock until the GIL came back: ingest waited for it
    (p99 0.7-0.8 ms against 2-3 us now, docs/performance.md, issue 28's ninth round). Both
    kernels of the verification are compiled to keep the GIL, and it calls those; the
    writers' bulk lookups still release it."""
    from blendmatch.index import storage, verify

    assert not verify.per_position_rule.targetoptions.get("nogil")
    assert not storage._fm_lookup_held.targetoptions.get("nogil")
    assert storage._fm_lookup.targetoptions.get("nogil")
    c = 16
    rows = np.random.default_rng(5).integers(0, 1 << 31, size=(4, c), dtype=np.uint32)
    idx = BlendIndex(chunk_size=c, engine="cpu")
    idx.add_many(rows, [b"a", b"b", b"c", b"d"], np.arange(4) * c, NS)

    def released(self, fps):  # the releasing lookup must not be on the lookup path
        raise AssertionError("verification called the GIL-releasing lookup")

    monkeypatch.setattr(storage.FingerprintMap, "lookup", released)
    query = np.concatenate([rows[2], rows[0]])
    assert [m.chunk_hash for m in idx.match(query, NS)] == [b"c", b"a"]
