"""A chunk held by every instance of a fleet: the cost of one more holder, and of its answer.

Question answered: "a shared system prompt of ``--chunks`` chunks is stored by each of
``--instances`` instances in turn: what does adding one holder cost as the fleet grows, and
does a lookup with ``include_placements`` over that prompt hold up the lookups behind it?"
(issue 47, item 3).

Part 1 (the directory, in-process, no HTTP): ``--instances`` STORE batches, one per
instance, each of the same ``--chunks`` chunks (LMCache JSON bodies, parsed before the
clock starts: only ``KeyDirectory.apply`` is timed). Printed: the time per holder added
(one batch's apply / its chunks) averaged over the last 10 instances before each of the
``--marks`` (e.g. the 91st..100th and the 991st..1,000th instance), the whole seeding
time, then one holder leaving and coming back at full size (a DELETE and a STORE of the
prompt by one instance: per chunk). Constant per-add times across the marks mean O(1);
times growing with the mark mean O(holders) per add.

Part 2 (``--latency``; the service in-process, ``httpx.ASGITransport``): every instance
registered, the app's directory filled as in part 1, then ``--rounds`` times: a lookup of
the whole prompt with ``include_placements`` is sent, and right behind it a lookup of one
stored chunk (no placements). Printed: the one-chunk lookup's latency behind the big one
(p50 and max), alone (p50), and the big answer's size and latency.

Runs against any checkout whose ``blendmatch`` package it imports (absolute imports only),
so the same file measures a base commit: ``PYTHONPATH=<a tree exposing blendmatch.index,
.gpu, .service> python bench/holders.py``. Run: ``python -m blendmatch.bench.holders
[--instances 1000] [--chunks 200] [--marks 100,1000] [--latency] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.wire import parse_event_body

__all__ = ["main", "seed"]

MODEL = "holders-bench"


def _body(instance: str, seq: int, kind: str, rows: np.ndarray, hashes: Sequence[bytes]) -> bytes:
    c = rows.shape[1]
    entries = [{"key": {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": 1 << 24, "object_group_id": 0,
                        "cache_salt": ""}, "size_bytes": 1 << 20, "token_offset": k * c,
                **({"token_ids": rows[k].tolist()} if kind == "store" else {})}
               for k, h in enumerate(hashes)]
    return json.dumps({"batches": [{"instance_id": instance, "incarnation": 0, "seq": seq, "event_type": kind,
                                    "tier": "l1", "backend": "LocalCPUBackend", "shared": False,
                                    "entries": entries}]}).encode()


def _prompt(chunks: int, chunk_size: int, seed: int) -> tuple[np.ndarray, list[bytes]]:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 50_000, size=(chunks, chunk_size), dtype=np.uint32)
    return rows, [b"\x47" + k.to_bytes(15, "big") for k in range(chunks)]


def seed(directory: Any, instances: int, rows: np.ndarray, hashes: Sequence[bytes], marks: Sequence[int],
         progress: bool = False) -> dict[str, Any]:
    """Store the prompt on ``instances`` instances in turn (``inst-0`` ...); the time per
    holder added over the 10 instances before each mark, and the whole apply time."""
    template = _body("inst-XXXXXXXX", 1, "store", rows, hashes)
    per_add: dict[int, list[float]] = {m: [] for m in marks}
    total = 0.0
    for n in range(instances):
        request = parse_event_body(template.replace(b"inst-XXXXXXXX", f"inst-{n:08d}".encode()))
        t = time.perf_counter()
        directory.apply(request)
        dt = time.perf_counter() - t
        total += dt
        for m in marks:
            if m - 10 <= n < m:
                per_add[m].append(dt / len(hashes))
        if progress and (n + 1) % 100 == 0:
            print(f"  {n + 1} instances, {total:.1f} s applying", file=sys.stderr, flush=True)
    return {"seed_s": total, "per_add_us": {m: statistics.mean(v) * 1e6 for m, v in per_add.items() if v}}


def churn(directory: Any, instance: int, rows: np.ndarray, hashes: Sequence[bytes]) -> dict[str, float]:
    """One holder (``inst-<instance>``) drops the prompt and stores it again: us per chunk each."""
    inst = f"inst-{instance:08d}"
    delete = parse_event_body(_body(inst, 2, "delete", rows, hashes))
    store = parse_event_body(_body(inst, 3, "store", rows, hashes))
    t = time.perf_counter()
    directory.apply(delete)
    t1 = time.perf_counter()
    directory.apply(store)
    t2 = time.perf_counter()
    return {"remove_us": (t1 - t) / len(hashes) * 1e6, "re_add_us": (t2 - t1) / len(hashes) * 1e6}


async def _latency(args: argparse.Namespace, rows: np.ndarray, hashes: Sequence[bytes]) -> dict[str, Any]:
    import httpx

    from blendmatch.service.app import create_app
    from blendmatch.service.config import ServiceConfig

    cfg = ServiceConfig(chunk_size=rows.shape[1], engine="cpu", host="127.0.0.1", instance_timeout=3600.0,
                        log_level="warning")
    app = create_app(cfg)
    async with app.router.lifespan_context(app):
        ctx = app.state.blendmatch_context
        for n in range(args.instances):
            ctx.registry.register(f"inst-{n:08d}", "10.0.0.1", 1)
        t = time.perf_counter()
        seed(ctx.directory, args.instances, rows, hashes, (), progress=args.progress)
        print(f"  service filled in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        tokens = base64.b64encode(rows.reshape(-1).astype("<u4").tobytes()).decode()
        one = base64.b64encode(rows[7].astype("<u4").tobytes()).decode()
        big_body = {"tokens_b64": tokens, "model_name": MODEL, "include_placements": True,
                    "requester_instance_id": "inst-00000005"}
        small_body = {"tokens_b64": one, "model_name": MODEL}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:

            async def timed(body: dict[str, Any]) -> tuple[float, httpx.Response]:
                t0 = time.perf_counter()
                r = await client.post("/directory/blend-lookup", json=body)
                r.raise_for_status()
                return time.perf_counter() - t0, r

            for _ in range(3):  # warm: engine kernels, the placement memo
                await timed(big_body)
                await timed(small_body)
            alone = [(await timed(small_body))[0] for _ in range(args.rounds)]
            behind, big = [], []
            size = 0
            for _ in range(args.rounds):
                big_task = asyncio.ensure_future(timed(big_body))
                await asyncio.sleep(0)  # the big one is submitted first
                small_s, r_small = await timed(small_body)
                big_s, r_big = await big_task
                assert r_small.json()["matches"], "the one-chunk lookup found nothing"
                behind.append(small_s)
                big.append(big_s)
                size = len(r_big.content)
    return {"one_chunk_alone_p50_s": statistics.median(alone), "one_chunk_behind_p50_s": statistics.median(behind),
            "one_chunk_behind_max_s": max(behind), "placed_answer_bytes": size,
            "placed_p50_s": statistics.median(big)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.holders", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--instances", type=int, default=1000)
    p.add_argument("--chunks", type=int, default=200)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--marks", default="100,1000", help="instance counts to report the per-add time at")
    p.add_argument("--latency", action="store_true", help="also part 2: lookups behind a placements lookup")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seed", type=int, default=47)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--json", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    marks = [int(m) for m in args.marks.split(",") if m and int(m) <= args.instances]
    rows, hashes = _prompt(args.chunks, args.chunk_size, args.seed)
    d = KeyDirectory()
    d.enable_blend_lookup(args.chunk_size, engine="cpu")
    out: dict[str, Any] = {"instances": args.instances, "chunks": args.chunks,
                           "loadavg": os.getloadavg()[0]}
    out.update(seed(d, args.instances, rows, hashes, marks, args.progress))
    out.update(churn(d, args.instances // 2, rows, hashes))
    print(f"{args.instances} instances x {args.chunks} shared chunks: seeded in {out['seed_s']:.1f} s "
          f"(load average {out['loadavg']:.1f})")
    for m, us in out["per_add_us"].items():
        print(f"  per holder added, instances {m - 9}..{m}: {us:8.1f} us")
    print(f"  one holder at full size: remove {out['remove_us']:.1f} us, re-add {out['re_add_us']:.1f} us per chunk")
    del d
    if args.latency:
        lat = asyncio.run(_latency(args, rows, hashes))
        out.update(lat)
        print(f"  include_placements lookup of the prompt: {lat['placed_answer_bytes']} bytes, "
              f"p50 {lat['placed_p50_s'] * 1e3:.1f} ms")
        print(f"  one-chunk lookup: alone p50 {lat['one_chunk_alone_p50_s'] * 1e3:.1f} ms; right behind it "
              f"p50 {lat['one_chunk_behind_p50_s'] * 1e3:.1f} ms, max {lat['one_chunk_behind_max_s'] * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
