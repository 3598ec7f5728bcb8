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
