"""Model test: a random event stream applied to the KeyDirectory gives exactly what a naive
re-computation from the surviving records gives (matches, token bindings, placements).

The naive model below restates the directory's rules (docs/architecture.md, "What flows
through, for a STORE") in the plainest terms: records are
``key -> set of placement identities``; a chunk hash's content is the last usable content a
STORE carried for it while it had keys (identical content only updates a known offset);
a chunk is matchable for a namespace iff its content has the chunk size, its offset is
known and a surviving key of that namespace is bound to it. Matches are found by brute
force. Nothing here knows about claims, occupants, interning or deferred index writes, so
any bookkeeping slip in the directory (a claim left behind, an index row reused while a
binding still holds it, a fence that drops too much) shows up as a difference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from blendmatch.index.wire_models import wire_batch, wire_entry

from ckpt_workload import token_offsets
from blendmatch.index import bindings as bindings_mod
from blendmatch.index.key_directory import SHARED_POOL_INSTANCE, KeyDirectory
from blendmatch.index.types import BlendNamespace, ObjectKey, pack_kv_rank

C = 4
INSTANCES = ("a", "b", "c")
TIERS = ("l1", "l2")
BACKENDS = ("cpu", "disk")
# (model, kv_rank, object_group_id, salt): namespaces (m,"",1), (m,"",2), (n,"",1), (m,"s",1)
SCOPES = (
    ("m", pack_kv_rank(1), 0, ""),
    ("m", pack_kv_rank(1), 1, ""),
    ("m", pack_kv_rank(2, 0), 0, ""),
    ("m", pack_kv_rank(2, 1), 0, ""),
    ("n", pack_kv_rank(1), 0, ""),
    ("m", pack_kv_rank(1), 0, "s"),
)
NAMESPACES = sorted({BlendNamespace(m, s, (r >> 24) & 0xFF) for m, r, _, s in SCOPES})


def _content_pool(rng: random.Random) -> list[list[int]]:
    """Small pool so that identical content recurs across chunk hashes and namespaces."""
    pool = [[rng.randrange(6) for _ in range(C)] for _ in range(10)]
    pool.append([rng.randrange(6) for _ in range(C + 1)])  # wrong length: bound, never indexed
    pool.append([1, 2, 3, 2**32 + 1])  # outside uint32: leaves the binding unfilled
    pool.append([])  # no tokens
    return pool


@dataclass
class Naive:
    """The surviving records and what they imply."""

    records: dict[tuple, set[tuple[str, str, str]]] = field(default_factory=dict)
    content: dict[bytes, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    gate: dict[str, tuple[int, int]] = field(default_factory=dict)

    def admit(self, inst: str, inc: int, seq: int) -> str:
        cur = self.gate.get(inst)
        if cur is not None:
            if inc < cur[0]:
                return "stale"
            if inc == cur[0] and seq <= cur[1]:
                return "duplicate"
            if inc > cur[0]:
                self.fence(inst)
        self.gate[inst] = (inc, seq)
        return "applied"

    def store(self, key: tuple, ident: tuple[str, str, str], tokens: list[int], offset: int) -> None:
        self.records.setdefault(key, set()).add(ident)
        h = key[0]
        usable = bool(tokens) and all(0 <= t < 2**32 for t in tokens)
        if not usable:
            return
        old = self.content.get(h)
        t = tuple(tokens)
        if old is None or old[0] != t:
            self.content[h] = (t, offset)
        elif offset >= 0:
            self.content[h] = (t, offset)

    def delete(self, key: tuple, ident: tuple[str, str, str]) -> None:
        idents = self.records.get(key)
        if idents is None:
            return
        idents.discard(ident)
        if not idents:
            del self.records[key]
            self._drop_unbound(key[0])

    def fence(self, inst: str) -> None:
        for key in list(self.records):
            idents = self.records[key]
            idents -= {i for i in idents if i[0] == inst and i[1] == "l1"}
            if not idents:
                del self.records[key]
                self._drop_unbound(key[0])

    def _drop_unbound(self, h: bytes) -> None:
        if not any(k[0] == h for k in self.records):
            self.content.pop(h, None)

    def candidates(self, query: list[int], ns: BlendNamespace) -> list[dict[bytes, int]]:
        """Per query position: the live chunk hashes (-> offset) whose content is that window."""
        live = {}
        for key in self.records:
            h, model, rank, _, salt = key
            if BlendNamespace(model, salt, (rank >> 24) & 0xFF) != ns or h not in self.content:
                continue
            tokens, offset = self.content[h]
            if len(tokens) == C and offset >= 0:
                live[h] = (tokens, offset)
        return [{h: off for h, (tokens, off) in live.items() if tokens == tuple(query[p:p + C])}
                for p in range(0, len(query) - C + 1)]

    def check_matches(self, query: list[int], ns: BlendNamespace, got: list[tuple[int, bytes, int]]) -> None:
        """LMCache's per-position rule, without the model tracking occupant order: walking
        positions in order, where some live candidate is not yet reported exactly one of them
        is reported (with its offset), elsewhere none; no hash twice. (Which one, in
        first-indexed order, is the index oracle's test: tests/test_index_property.py.)"""
        by_pos = {p: (h, off) for p, h, off in got}
        assert len(by_pos) == len(got), "two matches at one position"
        seen: set[bytes] = set()
        for p, cands in enumerate(self.candidates(query, ns)):
            open_ = {h: off for h, off in cands.items() if h not in seen}
            if not open_:
                assert p not in by_pos, f"match at {p} without an unseen candidate"
                continue
            assert p in by_pos, f"no match at {p}, candidates {sorted(open_)}"
            h, off = by_pos[p]
            assert open_.get(h, -2) == off, f"at {p}: {h!r}/{off} not among {open_}"
            seen.add(h)


def _check(d: KeyDirectory, naive: Naive, rng: random.Random, pool: list[list[int]], step: int) -> None:
    # matches, for every namespace, over queries made of stored contents and noise
    queries = []
    for _ in range(4):
        parts: list[int] = []
        for _ in range(rng.randrange(1, 5)):
            noise = [rng.randrange(6) for _ in range(rng.randrange(3))]
            parts += rng.choice(pool[:10]) if rng.random() < 0.8 else noise
        queries.append(parts)
    batch = [(q, ns) for q in queries for ns in NAMESPACES]
    got = d.blend_index.match_batch(batch)
    for (q, ns), res in zip(batch, got):
        assert [m.cur_st for m in res] == sorted(m.cur_st for m in res), "not ascending cur_st"
        mine = [(m.cur_st, m.chunk_hash, m.old_st) for m in res]
        try:
            naive.check_matches(q, ns, mine)
        except AssertionError as exc:
            raise AssertionError(f"step {step}: query {q} ns {ns}: {exc}") from None
    # token bindings (catches an index row reused while a binding still holds it)
    hashes = sorted({k[0] for k in naive.records} | set(naive.content))
    for h, tokens in zip(hashes, d.get_token_ids(hashes)):
        want = naive.content.get(h)
        if want is None:
            assert tokens is None, f"step {step}: chunk {h.hex()} should have no content"
            assert token_offsets(d, [h])[0] in (None, -1), "an offset without content"
        else:
            assert tokens is not None and tokens.tolist() == list(want[0]), f"step {step}: chunk {h.hex()}"
            assert token_offsets(d, [h]) == [want[1]]
    # placements and counts
    keys = sorted(naive.records)
    got_pl = d.lookup([ObjectKey(*k) for k in keys])
    for k, pls in zip(keys, got_pl):
        assert {(p.instance_id, p.tier, p.backend) for p in pls} == naive.records[k], f"step {step}: key {k}"
    stats = d.stats()
    assert stats["keys"] == len(naive.records)
    assert stats["placements"] == sum(len(v) for v in naive.records.values())
    assert stats["chunk_hashes"] == len({k[0] for k in naive.records})
    assert stats["token_bindings"] == len(naive.content)
    want_l1 = {}
    for idents in naive.records.values():
        for inst in {i[0] for i in idents if i[1] == "l1" and i[0] != SHARED_POOL_INSTANCE}:
            want_l1[inst] = want_l1.get(inst, 0) + 1
    assert stats["l1_keys_per_instance"] == want_l1
    # white-box: the per-instance L1 chunk sets that fencing walks are exact
    want_sets: dict[str, set[bytes]] = {}
    for key, idents in naive.records.items():
        for inst in {i[0] for i in idents if i[1] == "l1" and i[0] != SHARED_POOL_INSTANCE}:
            want_sets.setdefault(inst, set()).add(key[0])
    assert {i: c for i, c in d._l1_chunks.items() if c} == want_sets, f"step {step}"
    # ... and the logs they are filtered from stay bounded by the instance's L1 keys
    store = d._store
    for inst, log in store.l1_log.items():
        assert len(log) <= 2 * want_l1.get(inst, 0) + bindings_mod._L1_LOG_SLACK, f"step {step}: {inst}"
    assert stats["blend_index"]["num_chunks"] == _indexable_chunks(naive)


def _indexable_chunks(naive: Naive) -> int:
    return sum(1 for h, (t, off) in naive.content.items() if len(t) == C and off >= 0)


def _run(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    pool = _content_pool(rng)
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="reference")
    naive = Naive()
    seqs = {i: 0 for i in INSTANCES}
    incs = {i: 0 for i in INSTANCES}
    hashes = [bytes([7, i]) for i in range(12)]
    for step in range(steps):
        r = rng.random()
        inst = rng.choice(INSTANCES)
        if r < 0.05:
            d.fence_instance(inst)
            naive.fence(inst)
            continue
        if r < 0.08:
            incs[inst] += 1  # a restart: the gate fences, then applies
            seqs[inst] = 0
        tier, backend, shared = rng.choice(TIERS), rng.choice(BACKENDS), rng.random() < 0.15
        ident = (SHARED_POOL_INSTANCE if shared else inst, tier, backend)
        kind = "store" if rng.random() < 0.65 else "delete"
        entries, ops = [], []
        for _ in range(rng.randrange(1, 6)):
            h = rng.choice(hashes)
            scope = rng.choice(SCOPES)
            tokens = rng.choice(pool) if rng.random() < 0.7 else []
            offset = rng.choice((-1, 0, 4, 8))
            entries.append(wire_entry(h, scope[0], scope[1], object_group_id=scope[2], cache_salt=scope[3],
                                      size_bytes=16, token_ids=tokens, token_offset=offset))
            ops.append(((h, *scope), tokens, offset))
        seq = seqs[inst] + 1
        if rng.random() < 0.05:
            seq = max(1, seqs[inst])  # a duplicate (or the first batch again)
        elif rng.random() < 0.05:
            seq += 2  # a gap
        inc = incs[inst] - (1 if incs[inst] and rng.random() < 0.04 else 0)  # sometimes stale
        counts = d.apply({"batches": [wire_batch(inst, seq, kind, entries, incarnation=inc, tier=tier,
                                                 backend=backend, shared=shared)]})
        verdict = naive.admit(inst, inc, seq)
        assert counts._asdict() == {"applied": int(verdict == "applied"), "duplicates": int(verdict == "duplicate"),
                                    "stale": int(verdict == "stale")}, f"step {step}"
        if verdict == "applied":
            seqs[inst] = max(seqs[inst], seq)
            for key, tokens, offset in ops:
                if kind == "store":
                    naive.store(key, ident, tokens, offset)
                else:
                    naive.delete(key, ident)
        if step % 7 == 0:
            _check(d, naive, rng, pool, step)
    _check(d, naive, rng, pool, steps)


@pytest.mark.parametrize("seed", range(6))
def test_random_stream_matches_naive_model(seed: int) -> None:
    _run(seed, steps=250)


@pytest.mark.parametrize("seed", range(3))
def test_random_stream_with_l1_logs_compacted_at_once(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """No slack: each instance's L1 log is compacted whenever it holds more entries than
    twice its L1 keys, so the stream crosses many compactions (and fences walk logs with
    stale and repeated entries): the same answers as the naive model, logs bounded."""
    monkeypatch.setattr(bindings_mod, "_L1_LOG_SLACK", 0)
    _run(100 + seed, steps=250)


def test_bulk_batches_match_naive_model() -> None:
    """Large STORE batches with distinct chunk hashes take the directory's bulk path."""
    rng = random.Random(99)
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, probe_stride=1, engine="reference")
    naive = Naive()
    pool = _content_pool(rng)
    seq = 0
    for round_ in range(6):
        entries, ops = [], []
        chosen = rng.sample(range(60), 40)  # distinct hashes in the batch
        for i in chosen:
            h = bytes([9, i])
            scope = rng.choice(SCOPES)
            tokens = rng.choice(pool)
            offset = rng.choice((-1, 0, 4))
            entries.append(wire_entry(h, scope[0], scope[1], object_group_id=scope[2], cache_salt=scope[3],
                                      token_ids=tokens, token_offset=offset))
            ops.append(((h, *scope), tokens, offset))
        seq += 1
        kind = "store" if round_ % 3 != 2 else "delete"
        d.apply({"batches": [wire_batch("a", seq, kind, entries, backend="cpu")]})
        naive.admit("a", 0, seq)
        for key, tokens, offset in ops:
            if kind == "store":
                naive.store(key, ("a", "l1", "cpu"), tokens, offset)
            else:
                naive.delete(key, ("a", "l1", "cpu"))
        _check(d, naive, rng, pool, round_)


def test_numpy_queries_and_stride() -> None:
    """The same model check with a probe stride: only windows at multiples of it match."""
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, probe_stride=2, engine="reference")
    content = [5, 6, 7, 8]
    d.apply({"batches": [wire_batch("a", 1, "store", [wire_entry(b"\x01", "m", token_ids=content, token_offset=0)])]})
    ns = BlendNamespace("m", "", 1)
    assert [m.cur_st for m in d.blend_match(np.array([0, 0] + content, dtype=np.uint32), ns)] == [2]
    assert d.blend_match(np.array([0] + content, dtype=np.uint32), ns) == []
