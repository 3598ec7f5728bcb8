"""``KeyDirectory.apply_many`` (one lock hold for many requests, new contents of
consecutive STORE batches inserted into the blend index in one deferred ``add_many``)
leaves exactly the state that applying the same requests one by one leaves: every answer a
client can ask for (``ckpt_workload.answers``: matches, listings, tokens, offsets, stats).

The workloads mix what the deferral must not reorder: batches of new content (deferred),
content repeated under other chunk hashes (the fingerprint map across deferred batches),
stores and deletes of hashes a deferred batch just bound (a flush first), restarts (a
fence), duplicates, stale batches, config and access batches.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.types import pack_kv_rank
from blendmatch.index.wire import parse_event_request
from blendmatch.index.wire_models import wire_batch, wire_entry

from ckpt_workload import C, answers, contents, workload


def _directory() -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="reference")
    return d


def _requests(batches: list[dict]) -> list:
    return [parse_event_request({"batches": [b]}) for b in batches]


def _deferring_workload(seed: int, n: int = 150) -> list[dict]:
    """Mostly whole batches of new chunk hashes with known offsets (the deferred path),
    with repeats, deletes of fresh hashes, restarts and duplicates mixed in."""
    rng = random.Random(seed)
    cs = contents(seed)
    seq = {"a": 0, "b": 0}
    inc = {"a": 0, "b": 0}
    next_hash = 0
    recent: list[int] = []
    out = []
    for _ in range(n):
        inst = rng.choice(("a", "b"))
        r = rng.random()
        if r < 0.04:
            inc[inst] += 1
            seq[inst] = 0
        seq[inst] += 1
        s = seq[inst]
        if rng.random() < 0.05 and s > 1:
            s -= 1  # a duplicate
        if r < 0.7:  # new hashes: deferred
            entries = []
            for _ in range(rng.randrange(1, 7)):
                next_hash += 1
                recent.append(next_hash)
                entries.append(wire_entry(next_hash.to_bytes(8, "big"), "m", pack_kv_rank(1),
                                          token_ids=cs[rng.randrange(len(cs))].tolist(),
                                          token_offset=rng.randrange(4) * C))
            kind = "store"
        else:  # touch hashes stored a moment ago: stores of other content, or deletes
            kind = "store" if r < 0.85 else "delete"
            picks = rng.sample(recent[-20:], min(len(recent[-20:]), rng.randrange(1, 4))) or [1]
            entries = [wire_entry(h.to_bytes(8, "big"), "m", pack_kv_rank(1),
                                  token_ids=cs[rng.randrange(len(cs))].tolist(), token_offset=rng.choice((-1, 0, C)))
                       for h in picks]
        out.append(wire_batch(inst, s, kind, entries, incarnation=inc[inst], backend="LocalCPUBackend"))
    return out


def _counting(d: KeyDirectory) -> KeyDirectory:
    index = d.blend_index
    real = index.add_many
    index.add_many_calls = 0  # type: ignore[union-attr]

    def add_many(*args, **kwargs):
        index.add_many_calls += 1  # type: ignore[union-attr]
        return real(*args, **kwargs)

    index.add_many = add_many  # type: ignore[method-assign,union-attr]
    return d


def _one_by_one(batches: list[dict]) -> KeyDirectory:
    d = _counting(_directory())
    for req in _requests(batches):
        d.apply_detailed(req)
    return d


def _grouped(batches: list[dict], rng: random.Random) -> tuple[KeyDirectory, list]:
    d = _counting(_directory())
    reqs = _requests(batches)
    reports = []
    i = 0
    while i < len(reqs):
        k = rng.randrange(1, 40)
        reports.extend(d.apply_many(reqs[i:i + k]))
        i += k
    return d, reports


@pytest.mark.parametrize("seed", range(4))
def test_apply_many_equals_one_by_one_mixed(seed: int) -> None:
    batches = workload(seed, 200)
    d1 = _one_by_one(batches)
    d2, reports = _grouped(batches, random.Random(seed))
    assert not [r for r in reports if isinstance(r, Exception)]
    assert answers(d2, seed) == answers(d1, seed)


@pytest.mark.parametrize("seed", range(4))
def test_apply_many_equals_one_by_one_deferring(seed: int) -> None:
    batches = _deferring_workload(seed)
    d1 = _one_by_one(batches)
    d2, reports = _grouped(batches, random.Random(seed + 7))
    assert answers(d2, seed) == answers(d1, seed)
    # the deferral really was exercised: consecutive batches shared their index inserts
    assert d2.blend_index.add_many_calls < 0.6 * d1.blend_index.add_many_calls  # type: ignore[union-attr]
    assert d2.blend_index.stats()["num_chunks"] > 20  # type: ignore[union-attr]


def test_apply_many_one_request_per_report_and_a_failing_request_leaves_the_others() -> None:
    cs = contents(3)
    mk = lambda seq, h: parse_event_request({"batches": [wire_batch("a", seq, "store", [  # noqa: E731
        wire_entry(h.to_bytes(8, "big"), "m", pack_kv_rank(1), token_ids=cs[h % len(cs)].tolist(),
                   token_offset=0)])]})
    d = _directory()
    out = d.apply_many([mk(1, 1), object(), mk(2, 2), mk(2, 3)])  # type: ignore[list-item]
    assert [type(r).__name__ for r in out[:1] + out[2:]] == ["ApplyReport"] * 3
    assert isinstance(out[1], Exception)
    assert [r.counts.applied for r in (out[0], out[2], out[3])] == [1, 1, 0]  # the last: a duplicate seq
    ref = _directory()
    ref.apply_detailed(mk(1, 1))
    ref.apply_detailed(mk(2, 2))
    ref.apply_detailed(mk(2, 3))
    assert answers(d, 3) == answers(ref, 3)
    # every deferred binding got its tokens before the lock was released
    toks = d.get_token_ids([(1).to_bytes(8, "big"), (2).to_bytes(8, "big")])
    assert [t.tolist() for t in toks] == [cs[1].tolist(), cs[2].tolist()]
