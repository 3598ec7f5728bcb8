"""The routing score (issue 26, part 2) against a brute-force oracle.

Two levels, both with hypothesis:

- the pure function (``index/route_score.py``) over random matches, placements (private L1
  and L2, shared pools, L2-only chunks) and live sets, against an oracle that counts
  non-overlapping matches by trying every subset (not by the greedy rule the code uses);
- ``POST /route/score`` of a running app over random fleets built through ``POST /events``
  under the real prefix-chained hashes of the service's token hasher: live, expired
  (heartbeat too old), deregistered (fenced), restarted (a new incarnation fences its L1)
  and never-registered instances, a shared L2 pool; the oracle knows the fleet from its
  description, not from the directory (only the blend matches come from the service: the
  index is tested on its own).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blendmatch.index.placement_rank import rank_placements
from blendmatch.index.placements import Placement
from blendmatch.index.route_score import route_score
from blendmatch.index.types import BlendMatch, pack_kv_rank
from blendmatch.index.wire_models import wire_batch, wire_entry
from service_support import C, b64, config, served

INSTANCES = ("I0", "I1", "I2", "I3")


def _max_disjoint(starts: list[int], c: int) -> int:
    """The most pairwise non-overlapping windows of length ``c`` among ``starts``: every
    subset tried."""
    for size in range(len(starts), 0, -1):
        for combo in itertools.combinations(sorted(starts), size):
            if all(b - a >= c for a, b in zip(combo, combo[1:])):
                return size
    return 0


def _oracle(matches, holders_l1, shared_hashes, prefix_l1, live, candidates, c):
    """``holders_l1[h]``: instances with a private L1 copy of chunk hash ``h`` (liveness not
    applied yet); ``prefix_l1[j]``: the same for the request's j-th chained hash."""
    rows = []
    for inst in (sorted(live) if candidates is None else list(dict.fromkeys(candidates))):
        alive = inst in live
        k = 0
        while alive and k < len(prefix_l1) and inst in prefix_l1[k]:
            k += 1
        prefix = k * c
        mine = [m.cur_st for m in matches if alive and inst in holders_l1.get(m.chunk_hash, ()) and m.cur_st >= prefix]
        frag = c * _max_disjoint(mine, c)
        rows.append({"instance_id": inst, "prefix_tokens": prefix, "fragment_tokens": frag,
                     "reusable_tokens": prefix + frag})
    rows.sort(key=lambda r: (-r["reusable_tokens"], r["instance_id"]))
    shared = c * _max_disjoint([m.cur_st for m in matches if m.chunk_hash in shared_hashes], c)
    return {"shared_tokens": shared, "instances": rows}


# ---------------------------------------------------------------------- the pure function
_owner = st.sampled_from(INSTANCES + ("",))
_placement = st.tuples(_owner, st.sampled_from(("l1", "l2")), st.sampled_from(("cpu", "disk")))


def _placements(raw) -> tuple[Placement, ...]:
    return tuple(Placement(i, 0, t, "pool" if i == "" else b, 1, i == "") for i, t, b in raw)


@settings(max_examples=400, deadline=None)
@given(n_chunks=st.integers(1, 10), c=st.sampled_from((1, 2, 4)), data=st.data())
def test_pure_score_matches_the_oracle(n_chunks, c, data):
    n = n_chunks * c + data.draw(st.integers(0, c - 1))
    chunk_pls = {bytes([h]): _placements(data.draw(st.lists(_placement, max_size=4))) for h in range(6)}
    raw = data.draw(st.lists(st.tuples(st.integers(0, n - c), st.integers(0, 5)), max_size=8))
    seen: set[int] = set()
    matches = []
    for cur, h in raw:  # at most one match per position, as the index answers
        if cur not in seen:
            seen.add(cur)
            matches.append(BlendMatch(bytes([h]), cur, cur))
    prefix_pls = [_placements(data.draw(st.lists(_placement, max_size=3)))
                  for _ in range(data.draw(st.integers(0, n_chunks)))]
    live = frozenset(data.draw(st.sets(st.sampled_from(INSTANCES))))
    candidates = data.draw(st.none() | st.lists(st.sampled_from(INSTANCES + ("nope",)), max_size=6))

    got = route_score(matches, [chunk_pls[m.chunk_hash] for m in matches], prefix_pls, c, live, candidates)

    def l1(pls):
        return {p.instance_id for p in pls if p.tier == "l1" and p.instance_id != ""}

    expected = _oracle(matches, {h: l1(p) for h, p in chunk_pls.items()},
                       {h for h, p in chunk_pls.items() if any(q.instance_id == "" for q in p)},
                       [l1(p) for p in prefix_pls], live, candidates, c)
    assert got.as_wire() == expected


def _rank_oracle(copy: tuple[str, str, str], who: Any) -> tuple[Any, ...]:
    """The ranking table of docs/routing.md, written out: own L1, other L1, shared, L2."""
    inst, tier, backend = copy
    cls = 2 if inst == "" else (0 if inst == who else 1) if tier == "l1" else 3
    return cls, inst != who, inst, tier, backend


@settings(max_examples=300, deadline=None)
@given(raw=st.lists(st.tuples(_owner, st.sampled_from(("l1", "l2")), st.sampled_from(("cpu", "disk"))), max_size=8),
       live=st.sets(st.sampled_from(INSTANCES)), who=st.sampled_from(INSTANCES + (None, "nope")))
def test_pure_ranking_matches_the_oracle(raw, live, who):
    got = rank_placements(_placements(raw), who, live)
    usable = {(i, t, "pool" if i == "" else b) for i, t, b in raw if i == "" or i in live}
    assert [(p.instance_id, p.tier, p.backend) for p in got] == sorted(usable, key=lambda cp: _rank_oracle(cp, who))


# ---------------------------------------------------------------------- the service
class _App:
    """One app for every example, its loop on a thread of its own (hypothesis drives sync
    test bodies; each example uses its own model name and instance ids)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._cm = served(config(health_check_interval=0))
        self.client, self.app = self.run(self._cm.__aenter__())
        self.ctx = self.app.state.blendmatch_context
        self.examples = 0

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def close(self) -> None:
        self.run(self._cm.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def app():
    a = _App()
    yield a
    a.close()


_STATUS = st.sampled_from(("live", "expired", "deregistered", "restarted", "unregistered"))
_SEQ = st.tuples(st.sampled_from(INSTANCES + ("pool",)), st.sampled_from(("l1", "l2")),
                 st.lists(st.integers(0, 4), min_size=1, max_size=7))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), statuses=st.tuples(*[_STATUS] * len(INSTANCES)),
       seqs=st.lists(_SEQ, min_size=1, max_size=6), query=st.lists(st.integers(0, 5), min_size=1, max_size=8),
       tail=st.integers(0, C - 1), default_rows=st.booleans(), lead=st.integers(-1, 5),
       requester=st.sampled_from(INSTANCES + (None,)), mirror=st.booleans())
def test_service_score_and_placements_match_the_oracle(app, seed, statuses, seqs, query, tail, default_rows, lead,
                                                       requester, mirror):
    app.examples += 1
    tag = f"x{app.examples}"
    model = f"model-{tag}"
    rng = np.random.default_rng(seed)
    contents = rng.integers(0, 50_000, size=(6, C), dtype=np.uint32)  # 5 stored, 5 = never stored
    hasher = app.ctx.token_hasher
    ids = {i: f"{tag}-{i}" for i in INSTANCES}
    status = dict(zip(INSTANCES, statuses))
    pool = f"{tag}-pool"

    l1: dict[str, set[bytes]] = {i: set() for i in INSTANCES}
    shared: set[bytes] = set()
    copies: dict[bytes, set[tuple[str, str, str]]] = {}  # every copy stored: (instance_id, tier, backend)
    batches = []
    seq_no: dict[str, int] = {}
    if mirror:  # the pool also holds the first sequence: chunks with shared and private copies
        seqs = seqs + [("pool", "l2", seqs[0][2])]
    for owner, tier, idx in seqs:
        tokens = contents[idx].reshape(-1)
        hashes = hasher.chunk_hashes(tokens)
        entries = [wire_entry(h, model, pack_kv_rank(1), size_bytes=64, token_ids=contents[j].tolist(),
                              token_offset=k * C) for k, (h, j) in enumerate(zip(hashes, idx))]
        inst = pool if owner == "pool" else ids[owner]
        seq_no[inst] = seq_no.get(inst, 0) + 1
        if owner == "pool":
            batches.append(wire_batch(inst, seq_no[inst], "store", entries, tier="l2", backend="mooncake", shared=True))
            shared.update(hashes)
            for h in hashes:
                copies.setdefault(h, set()).add(("", "l2", "mooncake"))
        else:
            batches.append(wire_batch(inst, seq_no[inst], "store", entries, tier=tier, backend=f"{tier}-be"))
            if tier == "l1":
                l1[owner].update(hashes)
            for h in hashes:
                copies.setdefault(h, set()).add((inst, tier, f"{tier}-be"))

    async def build() -> None:
        c = app.client
        for i in INSTANCES:
            if status[i] in ("live", "deregistered", "restarted"):
                r = await c.post("/instances", json={"instance_id": ids[i], "ip": "10.0.0.1", "http_port": 1})
                assert r.status_code == 200
            elif status[i] == "expired":  # last heard from long ago: not live, not reaped yet
                app.ctx.registry.register(ids[i], "10.0.0.1", 1, at=time.monotonic() - 10 * app.ctx.registry.timeout_s)
        r = await c.post("/events", json={"batches": batches})
        assert r.status_code == 200, r.text
        for i in INSTANCES:
            if status[i] == "deregistered":
                assert (await c.delete(f"/instances/{ids[i]}")).status_code == 204
            elif status[i] == "restarted":  # a new incarnation: its old L1 copies are fenced
                r = await c.post("/events", json={"batches": [wire_batch(ids[i], 1, "store", [], incarnation=1)]})
                assert r.status_code == 200, r.text

    app.run(build())
    for i in INSTANCES:
        if status[i] in ("deregistered", "restarted"):
            l1[i] = set()
            for cs in copies.values():  # fenced: its L1 copies are gone, its L2 ones stay
                cs.discard((ids[i], "l1", "l1-be"))
    live = {ids[i] for i in INSTANCES if status[i] in ("live", "restarted")}

    if 0 <= lead < len(seqs):  # open with a stored sequence: long prefixes (past the first hashing step)
        query = seqs[lead][2] + query
    q_tokens = np.concatenate([contents[query].reshape(-1), contents[5][:tail]])
    candidates = None if default_rows else [ids[i] for i in INSTANCES] + ["nobody"]
    body: dict[str, Any] = {"tokens_b64": b64(q_tokens), "model_name": model}
    if candidates is not None:
        body["candidates"] = candidates

    placed_body = {"token_ids": q_tokens.tolist(), "model_name": model, "include_placements": True}
    if requester is not None:
        placed_body["requester_instance_id"] = ids[requester]

    async def ask() -> tuple[Any, Any, Any]:
        score = await app.client.post("/route/score", json=body)
        lookup = await app.client.post("/directory/blend-lookup", json={"tokens_b64": b64(q_tokens), "model_name": model})
        placed = await app.client.post("/directory/blend-lookup", json=placed_body)
        return score, lookup, placed

    score, lookup, placed = app.run(ask())
    assert score.status_code == 200, score.text
    matches = [BlendMatch(bytes.fromhex(m["chunk_hash"]), m["old_st"], m["cur_st"]) for m in lookup.json()["matches"]]
    holders = {}
    for i in INSTANCES:
        for h in l1[i]:
            holders.setdefault(h, set()).add(ids[i])
    q_hashes = hasher.chunk_hashes(q_tokens)
    expected = _oracle(matches, holders, shared, [holders.get(h, set()) for h in q_hashes], live, candidates, C)
    assert score.json() == expected

    # placements: each match's live copies, ranked; matches without one dropped and counted
    who = None if requester is None else ids[requester]

    want, dropped = [], 0
    for m in matches:
        usable = sorted((cp for cp in copies.get(m.chunk_hash, ()) if cp[0] == "" or cp[0] in live),
                        key=lambda cp: _rank_oracle(cp, who))
        if not usable:
            dropped += 1
            continue
        want.append({"chunk_hash": m.chunk_hash.hex(), "old_st": m.old_st, "cur_st": m.cur_st,
                     "placements": [{"instance_id": i, "tier": t, "backend": b} for i, t, b in usable],
                     "placements_omitted": 0})
    assert placed.json() == {"matches": want, "dropped_without_live_holder": dropped, "placements_truncated": False}

    async def cleanup() -> None:  # the next example's default rows are its own live fleet
        for i in INSTANCES:
            await app.client.delete(f"/instances/{ids[i]}")

    app.run(cleanup())


def test_score_needs_the_reader_role_and_bad_bodies_are_422(app):
    async def go() -> None:
        c = app.client
        r = await c.post("/route/score", json={"token_ids": [1], "model_name": "m", "candidates": "I0"})
        assert r.status_code == 422 and "candidates" in r.text
        r = await c.post("/route/score", json={"tokens_b64": "!!", "model_name": "m"})
        assert r.status_code == 422 and "tokens_b64" in r.text
        r = await c.post("/route/score", json={"token_ids": [1], "model_name": "m", "candidates": []})
        assert r.status_code == 200 and r.json() == {"shared_tokens": 0, "instances": []}
        # the fast path and the route answer the same bytes (a streamed body has no
        # Content-Length: the fast path hands it to the route)
        tokens = np.arange(3 * C, dtype=np.uint32)
        for body in ({"token_ids": tokens.tolist(), "model_name": "m", "candidates": ["b", "a"]},
                     {"tokens_b64": b64(tokens), "model_name": "m", "candidates": ["a"]}):
            fast = await c.post("/route/score", json=body)

            async def streamed(data: bytes = json.dumps(body).encode()):
                yield data[:5]
                yield data[5:]

            routed = await c.post("/route/score", content=streamed(), headers={"content-type": "application/json"})
            assert fast.status_code == routed.status_code == 200 and fast.content == routed.content

    app.run(go())
    from blendmatch.service.access import rule_for

    assert rule_for("POST", "/route/score")[0].roles == frozenset({"reader"})


def test_a_long_prefix_spans_the_hashing_steps(app):
    """A prefix of 13 chunks (the hashing grows in steps of 4, 8, ...): all of it counts, and
    a chunk after it that the instance also holds is a fragment."""
    rows = np.random.default_rng(7).integers(0, 50_000, size=(16, C), dtype=np.uint32)
    hasher = app.ctx.token_hasher
    seq = rows[:13].reshape(-1)
    entries = [wire_entry(h, "long", pack_kv_rank(1), size_bytes=64, token_ids=rows[k].tolist(), token_offset=k * C)
               for k, h in enumerate(hasher.chunk_hashes(seq))]
    other = [wire_entry(b"\x01" * 8, "long", pack_kv_rank(1), size_bytes=64, token_ids=rows[15].tolist(),
                        token_offset=0)]

    async def go() -> Any:
        c = app.client
        assert (await c.post("/instances", json={"instance_id": "long-A", "ip": "10.0.0.1", "http_port": 1})
                ).status_code == 200
        assert (await c.post("/events", json={"batches": [wire_batch("long-A", 1, "store", entries),
                                                          wire_batch("long-A", 2, "store", other)]})).status_code == 200
        query = np.concatenate([seq, rows[14], rows[15]])
        r = await c.post("/route/score", json={"token_ids": query.tolist(), "model_name": "long",
                                               "candidates": ["long-A"]})
        await c.delete("/instances/long-A")
        return r

    r = app.run(go())
    assert r.json() == {"shared_tokens": 0, "instances": [{"instance_id": "long-A", "prefix_tokens": 13 * C,
                                                           "fragment_tokens": C, "reusable_tokens": 14 * C}]}


def test_the_worked_example_of_docs_routing_md():
    """docs/routing.md's example, with its chunk size (256) and its answer."""
    c = 256
    rng = np.random.default_rng(1)
    s, d, r1, r2 = (rng.integers(0, 50_000, size=(n, c), dtype=np.uint32) for n in (2, 3, 1, 1))
    other = rng.integers(0, 50_000, size=(1, c), dtype=np.uint32)
    question = rng.integers(60_000, 90_000, size=100, dtype=np.uint32)

    async def go() -> Any:
        async with served(config(chunk_size=c, health_check_interval=0)) as (client, app):
            hasher = app.state.blendmatch_context.token_hasher

            def entries(rows: np.ndarray, skip: int = 0) -> list[dict[str, Any]]:
                hashes = hasher.chunk_hashes(rows.reshape(-1))
                return [wire_entry(h, "llama", pack_kv_rank(1), size_bytes=1 << 20, token_ids=row.tolist(),
                                   token_offset=k * c) for k, (h, row) in enumerate(zip(hashes, rows))][skip:]

            for inst in ("gpu-a", "gpu-b", "gpu-c"):
                await client.post("/instances", json={"instance_id": inst, "ip": "10.0.0.1", "http_port": 8080})
            body = {"batches": [
                wire_batch("gpu-a", 1, "store", entries(s)),
                wire_batch("gpu-b", 1, "store", entries(np.concatenate([other, d]))),
                wire_batch("gpu-c", 1, "store", entries(np.concatenate([s, r1]))),
                wire_batch("pool", 1, "store", entries(np.concatenate([other, r2]), skip=1), tier="l2",
                           backend="mooncake", shared=True)]}
            assert (await client.post("/events", json=body)).status_code == 200
            request = np.concatenate([s.reshape(-1), d.reshape(-1), r1.reshape(-1), r2.reshape(-1), question])
            assert request.shape == (1892,)
            return (await client.post("/route/score", json={"token_ids": request.tolist(), "model_name": "llama"})).json()

    assert asyncio.run(go()) == {"shared_tokens": 256, "instances": [
        {"instance_id": "gpu-b", "prefix_tokens": 0, "fragment_tokens": 768, "reusable_tokens": 768},
        {"instance_id": "gpu-c", "prefix_tokens": 512, "fragment_tokens": 256, "reusable_tokens": 768},
        {"instance_id": "gpu-a", "prefix_tokens": 512, "fragment_tokens": 0, "reusable_tokens": 512}]}


def test_score_with_blend_lookup_disabled_counts_prefixes_only():
    """No blend index: no fragments, but the prefix (chained hashes in L1) still counts."""
    rows = np.random.default_rng(3).integers(0, 50_000, size=(3, C), dtype=np.uint32)

    async def go() -> Any:
        async with served(config(enable_blend_lookup=False, health_check_interval=0)) as (client, app):
            hashes = app.state.blendmatch_context.token_hasher.chunk_hashes(rows[:2].reshape(-1))
            entries = [wire_entry(h, "m", pack_kv_rank(1), size_bytes=8, token_ids=rows[k].tolist(), token_offset=k * C)
                       for k, h in enumerate(hashes)]
            await client.post("/instances", json={"instance_id": "A", "ip": "10.0.0.1", "http_port": 1})
            assert (await client.post("/events", json={"batches": [wire_batch("A", 1, "store", entries)]})
                    ).status_code == 200
            r = await client.post("/route/score", json={"tokens_b64": b64(rows.reshape(-1)), "model_name": "m"})
            bad = await client.post("/route/score", json={"tokens_b64": "!!", "model_name": "m"})
            return r, bad

    r, bad = asyncio.run(go())
    assert r.json() == {"shared_tokens": 0, "instances": [{"instance_id": "A", "prefix_tokens": 2 * C,
                                                           "fragment_tokens": 0, "reusable_tokens": 2 * C}]}
    assert bad.status_code == 422 and "tokens_b64" in bad.text
