"""Placements per match are capped, best-ranked first, and the rest counted (issue 47, item 3).

``top_placements`` over ``ranked_copies`` must be exactly the first ``cap`` of
``rank_placements`` (the ranking rule, ``index/placement_rank.py``) and count every usable
copy: checked against that oracle over generated holder sets, requesters and live sets.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from blendmatch.index.placement_rank import rank_placements, ranked_copies, top_placements
from blendmatch.index.placements import Placement

IDS = ["", "a", "b", "c", "d", "e", "ab", "a\x00", "z"]

placement = st.builds(
    lambda iid, inc, tier, backend, size, shared: Placement("" if shared else iid, 0 if shared else inc, tier,
                                                            backend, size, shared),
    st.sampled_from(IDS), st.integers(0, 2), st.sampled_from(["l1", "l2"]),
    st.sampled_from(["LocalCPUBackend", "disk", "mooncake"]), st.integers(0, 3), st.booleans())


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.lists(placement, max_size=24), st.one_of(st.none(), st.sampled_from(IDS)),
       st.sets(st.sampled_from(IDS)), st.integers(0, 30))
def test_top_placements_is_the_first_cap_of_the_full_ranking(pls, requester, live, cap):
    full = rank_placements(pls, requester, frozenset(live))
    kept, usable = top_placements(ranked_copies(pls), requester, frozenset(live), cap)
    assert kept == full[:cap]
    assert usable == len(full)


def test_a_big_fleet_requester_own_copies_first_then_peers_by_id():
    pls = [Placement(f"i{k:04d}", 0, "l1", "LocalCPUBackend", 1, False) for k in range(1000)]
    pls += [Placement("i0500", 0, "l2", "disk", 1, False), Placement("", 0, "l2", "mooncake", 1, True)]
    live = frozenset(f"i{k:04d}" for k in range(0, 1000, 2))
    kept, usable = top_placements(ranked_copies(pls), "i0500", live, 4)
    assert [(p.instance_id, p.tier) for p in kept] == [("i0500", "l1"), ("i0000", "l1"), ("i0002", "l1"),
                                                       ("i0004", "l1")]
    assert usable == 500 + 1 + 1
    assert kept == rank_placements(pls, "i0500", live)[:4]


# ---------------------------------------------------------------------- through the service
import pytest  # noqa: E402

from service_support import C, MODEL, b64, chunks, config, events, hash_of, metric_samples, served, store  # noqa: E402

FLEET = [f"gpu-{k:02d}" for k in range(30)]
ROWS = chunks(6, seed=47)
QUERY = ROWS.reshape(-1)


async def _big_fleet(client) -> dict[int, list[Placement]]:
    """30 instances, 20 of them registered (live), each holding chunks 0..5 in L1 (a shared
    prompt); a shared pool holds chunk 2; gpu-03 also holds chunk 4 on disk. Returns each
    chunk's stored copies (for the oracle)."""
    for inst in FLEET[:20]:
        r = await client.post("/instances", json={"instance_id": inst, "ip": "10.0.0.1", "http_port": 1})
        assert r.status_code == 200
    held: dict[int, list[Placement]] = {k: [] for k in range(6)}
    batches = []
    for inst in reversed(FLEET):  # arrival order unlike the ranking
        batches.append(store(inst, 1, ROWS))
        for k in range(6):
            held[k].append(Placement(inst, 0, "l1", "LocalCPUBackend", 1024, False))
    batches.append(store("pool", 1, ROWS[2:3], first_hash=2, offsets=[2 * C], tier="l2", backend="mooncake",
                         shared=True))
    held[2].append(Placement("", 0, "l2", "mooncake", 1024, True))
    batches.append(store("gpu-03", 2, ROWS[4:5], first_hash=4, offsets=[4 * C], tier="l2", backend="disk"))
    held[4].append(Placement("gpu-03", 0, "l2", "disk", 1024, False))
    r = await client.post("/events", json=events(*batches))
    assert r.status_code == 200, r.text
    return held


def _where(match) -> list[tuple[str, str, str]]:
    return [(p["instance_id"], p["tier"], p["backend"]) for p in match["placements"]]


@pytest.mark.anyio
@pytest.mark.parametrize("requester", [None, "gpu-03", "gpu-25"])
async def test_each_match_lists_the_first_cap_of_its_ranking_and_counts_the_rest(requester):
    cap = 4
    async with served(config(max_placements_per_match=cap)) as (client, _):
        held = await _big_fleet(client)
        live = frozenset(FLEET[:20])
        body = {"tokens_b64": b64(QUERY), "model_name": MODEL, "include_placements": True,
                "requester_instance_id": requester}
        got = (await client.post("/directory/blend-lookup", json=body)).json()
        assert got["dropped_without_live_holder"] == 0 and got["placements_truncated"] is False
        assert [m["chunk_hash"] for m in got["matches"]] == [hash_of(k).hex() for k in range(6)]
        omitted = 0
        for k, m in enumerate(got["matches"]):
            full = rank_placements(held[k], requester, live)
            assert _where(m) == [(p.instance_id, p.tier, p.backend) for p in full[:cap]]
            assert m["placements_omitted"] == len(full) - cap
            omitted += len(full) - cap
        batch = await client.post("/directory/blend-lookup/batch", json={"queries": [body, body]})
        assert batch.json()["results"] == [got, got]
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples['blendmatch_placements_omitted_total{reason="cap"}'] == 3 * omitted
        assert samples.get('blendmatch_placements_omitted_total{reason="bytes"}', 0) == 0


@pytest.mark.anyio
async def test_placement_bytes_are_bounded_per_request_and_the_rest_counted():
    bound = 1024
    async with served(config(max_placements_per_match=8, max_placement_answer_bytes=bound)) as (client, _):
        held = await _big_fleet(client)
        live = frozenset(FLEET[:20])
        body = {"tokens_b64": b64(QUERY), "model_name": MODEL, "include_placements": True}
        r = await client.post("/directory/blend-lookup/batch", json={"queries": [body] * 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        listed = [m for res in results for m in res["matches"]]
        assert len(listed) == 18  # every match is still answered: only placements are bounded
        used = 0
        cut = next(i for i, m in enumerate(listed) if not m["placements"])
        for i, m in enumerate(listed):
            full = rank_placements(held[i % 6], None, live)
            if i < cut:  # a leading run of matches keeps its placements (the cap's first 8)
                assert _where(m) == [(p.instance_id, p.tier, p.backend) for p in full[:8]]
                assert m["placements_omitted"] == len(full) - 8
                used += len(json.dumps(m["placements"], separators=(",", ":"))) - 1  # the items and commas
            else:  # from the first that would not fit: none listed, every usable copy counted
                assert m["placements"] == [] and m["placements_omitted"] == len(full)
        assert 0 < cut < 18 and used <= bound
        # the answer where the bound bit and every later one say so; earlier ones do not
        assert [res["placements_truncated"] for res in results] == [i * 6 + 5 >= cut for i in range(3)]
        samples = metric_samples((await client.get("/metrics")).text)
        assert samples["blendmatch_placement_answers_truncated_total"] == 1
        assert samples['blendmatch_placements_omitted_total{reason="bytes"}'] == sum(
            m["placements_omitted"] for m in listed[cut:])
        # a new request has a budget of its own: a single lookup answers as the batch's first
        one = (await client.post("/directory/blend-lookup", json=body)).json()
        assert one == results[0]


@pytest.fixture
def anyio_backend():
    return "asyncio"
