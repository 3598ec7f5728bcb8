"""Blend lookups through the service on the GPU engine (the strict fake device of
``tests/fake_cupy.py``): the lookup thread decodes each batch into the engine's lent pinned
staging area and submits it before it collects the previous batch; every answer is the CPU
engine's, byte for byte, also when the device fails in the middle of the run."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from blendmatch.index.tokens import decode_query_tokens
from blendmatch.service.app import create_app
from blendmatch.service.config import ServiceConfig

from test_gpu_engine import fake_device  # noqa: F401 - a fixture

C = 16


def _store_body(rows: np.ndarray) -> dict:
    entries = [{"key": {"chunk_hash_hex": (b"\xab" + int(i).to_bytes(8, "big")).hex(), "model_name": "m",
                        "kv_rank": 1 << 24, "object_group_id": 0, "cache_salt": ""},
                "size_bytes": 1024, "token_ids": rows[i].tolist(), "token_offset": 0} for i in range(len(rows))]
    return {"batches": [{"instance_id": "t", "incarnation": 0, "seq": 1, "event_type": "store", "tier": "l1",
                         "backend": "LocalCPUBackend", "shared": False, "ts": 0.0, "entries": entries}]}


def _queries(rows: np.ndarray, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        q = rng.integers(0, 40, size=int(rng.integers(C, 700)), dtype=np.uint32)
        for _ in range(int(rng.integers(0, 4))):  # stored chunks at random offsets
            at = int(rng.integers(0, max(1, q.size - C)))
            q[at:at + C] = rows[int(rng.integers(0, len(rows)))][: q[at:at + C].size]
        body = {"tokens_b64": base64.b64encode(q.astype("<u4").tobytes()).decode(), "model_name": "m"}
        if k % 7 == 3:
            body["tokens_b64"] = "not base64!"  # a bad query in the middle of a batch
        out.append(body)
    return out


async def _answers(engine: str, rows: np.ndarray, queries: list[dict], fail_at: int | None = None):
    app = create_app(ServiceConfig(chunk_size=C, engine=engine, host="127.0.0.1", max_batch_tokens=4096))
    async with app.router.lifespan_context(app):
        ctx = app.state.blendmatch_context
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            (await client.post("/events", json=_store_body(rows))).raise_for_status()
            index = ctx.directory.blend_index
            assert index.pipelined == (engine == "gpu")
            results: list = [None] * len(queries)
            before = dict(getattr(index.engine, "stats", dict)())  # after the start-up warm-up

            async def one(i: int) -> None:
                r = await client.post("/directory/blend-lookup", json=queries[i])
                results[i] = (r.status_code, r.content)

            tasks = []
            for i in range(len(queries)):  # 32 clients' worth, arriving together
                if fail_at is not None and i == fail_at:
                    await asyncio.gather(*tasks)
                    inner = index.engine
                    for slot in inner._slots:
                        def broken():
                            raise RuntimeError("cudaErrorIllegalAddress: simulated")
                        slot.ev["done"].synchronize = broken
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
            stats = dict(ctx.lookups.stats.as_dict())
            stats["engine"] = index.engine.name
            after = dict(getattr(index.engine, "stats", dict)())
            stats["engine_stats"] = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int)}
            stats["failovers"] = index.stats()["engine_failovers"]
    return results, stats


def test_gpu_pipeline_answers_like_the_cpu_engine(fake_device):
    rows = np.random.default_rng(1).integers(0, 40, size=(300, C), dtype=np.uint32)
    queries = _queries(rows, 96, seed=2)
    want, cpu_stats = asyncio.run(_answers("cpu", rows, queries))
    fake_device.DEVICE.h2d.clear()
    got, gpu_stats = asyncio.run(_answers("gpu", rows, queries))
    assert got == want
    assert sum(1 for s, _ in want if s == 200) > 60 and any(s >= 400 for s, _ in want)
    assert any(b'"matches": []' not in body and s == 200 for s, body in want)
    assert gpu_stats["engine"] == "gpu" and gpu_stats["max_batch_queries"] > 1 and gpu_stats["batches"] > 5
    # every batch was decoded straight into the engine's pinned staging area (no staging copy)
    eng = gpu_stats["engine_stats"]
    assert eng["in_place_passes"] == eng["device_batches"] > 0


def test_gpu_failure_mid_run_answers_everything_on_the_cpu(fake_device):
    rows = np.random.default_rng(3).integers(0, 40, size=(300, C), dtype=np.uint32)
    queries = _queries(rows, 64, seed=4)
    want, _ = asyncio.run(_answers("cpu", rows, queries))
    got, stats = asyncio.run(_answers("gpu", rows, queries, fail_at=30))
    assert got == want
    assert stats["engine"] == "cpu" and stats["failovers"] == 1


def test_decode_into_a_lent_buffer():
    qs = [np.arange(5, dtype=np.uint32), np.arange(100, 103, dtype=np.uint32)]
    sources = [base64.b64encode(q.tobytes()).decode() for q in qs]
    sources.insert(1, "bad!")
    lent = np.full(8, 7, dtype=np.uint32)
    asked = []

    def out(nq: int, n: int):
        asked.append((nq, n))
        return lent

    flat, offsets, errors = decode_query_tokens(sources, out=out)
    assert asked == [(2, 8)] and errors[1] is not None and errors[0] is None
    assert np.shares_memory(flat, lent) and flat.tolist() == [0, 1, 2, 3, 4, 100, 101, 102]
    assert offsets.tolist() == [0, 5, 8] and not flat.flags.writeable
    flat2, _, _ = decode_query_tokens(sources, out=lambda nq, n: None)  # declined: its own buffer
    assert flat2.tolist() == flat.tolist() and not np.shares_memory(flat2, lent)
    with pytest.raises(ValueError, match="lent token buffer"):
        decode_query_tokens(sources, out=lambda nq, n: np.zeros(n + 1, np.uint32))
