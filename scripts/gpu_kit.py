"""The Python steps of ``scripts/gpu_check.sh`` (run with the kit's installed package).

    python3 scripts/gpu_kit.py STEP WORKDIR [--fake]

Steps: ``imports`` (the package's bottom rooms import without pydantic/FastAPI; the service
imports with the carried wheels), ``trial`` (trial launch + self-test, both kernel modes),
``scale`` (self-test at scale: tens of millions of tokens, split passes and a tiny grid,
bit for bit against the CPU engine), ``engine-bench`` (windows/s at 1M chunks for 64 and 256
queries x 32,768 tokens: the CPU engine, the GPU's kernels alone, the GPU end to end one
batch at a time and pipelined, and where each batch's time goes), ``service-bench`` (the
service in-process, 32 clients, 8k- and 32k-token blend lookups, GPU vs CPU engine: lookups/s,
p50, p99), ``notebook`` (``notebooks/engine_batching.ipynb``'s sweep, condensed: windows/s
and batch p50/p99 per engine, tokens per query and queries per batch), ``service-smoke``
(the service in-process on the reference engine: proves the carried wheels), ``summary``
(writes ``summary.json`` from the step records, with the engine's targets computed).

``--fake``: the GPU is ``tests/fake_cupy.py`` (the strict numpy-backed fake device) and every
size is shrunk, so the measuring steps run on any machine with a C++ compiler: the dry run
proves the plumbing and the summary's shape, never a figure (its figures say ``"fake": true``
and the targets are not judged). Each step writes its figures to
``WORKDIR/figures_<step>.json``; sizes are fixed so that every step fits its time bound.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SERVICE_DEPS = ("pydantic", "fastapi", "starlette", "uvicorn")


def _figures(workdir: Path, step: str, figures: dict[str, Any]) -> None:
    (workdir / f"figures_{step}.json").write_text(json.dumps(figures, indent=1, sort_keys=True))
    print(json.dumps(figures, indent=1, sort_keys=True))


class _Block:
    """A meta-path finder that refuses the service's dependencies."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in SERVICE_DEPS:
            raise ImportError(f"blocked for the check: {name}")
        return None


def step_imports(workdir: Path) -> None:
    blocker = _Block()
    sys.meta_path.insert(0, blocker)
    try:
        for mod in ("blendmatch", "blendmatch.gpu", "blendmatch.gpu.cupy_engine", "blendmatch.index",
                    "blendmatch.bench.gpu_micro", "blendmatch.bench.engine"):
            importlib.import_module(mod)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in SERVICE_DEPS)
        assert not leaked, f"imported without need: {leaked}"
    finally:
        sys.meta_path.remove(blocker)
    import blendmatch
    import blendmatch.service.app  # noqa: F401 - with the carried wheels

    pkg = Path(blendmatch.__file__).resolve().parent
    assert (pkg / "gpu" / "cupy_engine.py").is_file(), f"{pkg} is not an installed blendmatch package"
    _figures(workdir, "imports", {"package": str(pkg), "python": sys.version.split()[0],
                                  "service_deps": {m: getattr(importlib.import_module(m), "__version__", "?")
                                                   for m in ("pydantic", "fastapi", "uvicorn")}})


def step_trial(workdir: Path) -> None:
    from blendmatch.gpu.cupy_engine import gpu_unavailable
    from blendmatch.gpu.select import create_gpu_engine

    why = gpu_unavailable()
    if why is not None:
        raise SystemExit(f"GPU unavailable: {type(why).__name__}: {why}")
    figures: dict[str, Any] = {}
    for kernels in ("fused", "array"):
        t0 = time.perf_counter()
        eng = create_gpu_engine(reason="gpu_check", kernels=kernels)  # compiles + self-test (trial geometry)
        figures[f"trial_{kernels}_s"] = round(time.perf_counter() - t0, 3)
        figures["device"] = eng.device_name
        eng.close()
    _figures(workdir, "trial", figures)


def _check(label: str, got, want) -> int:
    if not (want.same_as(got) and want.windows == got.windows):
        raise SystemExit(f"{label}: GPU {len(got)} candidates over {got.windows} windows, "
                         f"CPU {len(want)} over {want.windows}")
    return len(want)


def step_scale(workdir: Path) -> None:
    import numpy as np

    from blendmatch.bench.gpu_micro import _bench_inputs
    from blendmatch.gpu import QueryBatch
    from blendmatch.gpu.cpu import CpuEngine
    from blendmatch.gpu.select import create_gpu_engine

    qs, slots = _bench_inputs(chunks=1_000_000, queries=8, tokens=1 << 22, window=256, stride=1)  # 32M tokens
    cpu = CpuEngine(reason="check")
    eng = create_gpu_engine(reason="gpu_check scale", kernels="fused")
    figures: dict[str, Any] = {"scale_tokens": sum(int(q.size) for q in qs)}
    try:
        batch = QueryBatch.from_queries(qs, 256, 1)
        want = cpu.probe(batch, slots)
        figures["scale_candidates"] = _check("full batch", eng.probe(batch, slots), want)
        eng.max_pass_tokens = 1 << 21  # passes through the middle of queries
        _check("split passes", eng.probe(batch, slots), want)
        figures["scale_split_batches"] = eng.split_batches
        eng.max_pass_tokens = 1 << 26
        eng.max_blocks = 4  # thousands of grid-stride iterations per thread
        small = QueryBatch.from_queries(qs[:1], 256, 3)
        _check("tiny grid", eng.probe(small, slots), cpu.probe(small, slots))
        figures["scale_memory"] = eng.memory_stats()
        figures["scale_ok"] = True
    finally:
        eng.close()
    _figures(workdir, "scale", figures)


FAKE = False  # --fake: the fake device and shrunken sizes (set by main)


def _use_fake_device() -> None:
    """Install ``tests/fake_cupy.py`` as the CuPy the GPU engine imports."""
    global FAKE
    FAKE = True
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path.insert(0, str(tests))
    import fake_cupy

    from blendmatch.gpu import cupy_engine

    cupy_engine._import_cupy = lambda: fake_cupy.cupy
    cupy_engine._import_cupyx = lambda: fake_cupy.cupyx


def _size(real: int, fake: int) -> int:
    return fake if FAKE else real


def _rate(fn, windows: int, iters: int) -> float:
    fn()  # warm-up (compile, upload)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return windows / statistics.median(times)


def _median_timings(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted(set().union(*runs)) if runs else []
    return {k: round(statistics.median(r.get(k, 0.0) for r in runs), 6) for k in keys}


def _pipelined(eng, batch, slots, n: int, lend: bool, fill: bool = True) -> tuple[float, list, Any]:
    """``n`` copies of ``batch`` through ``probe_async`` two deep: wall seconds, each batch's
    timings, the last candidates. ``lend``: each batch's tokens are first copied into the
    engine's lent pinned staging area (what the service's decode does), timed with it;
    ``fill=False``: not copied (the staging sets already hold this batch from an earlier
    round): the device pipeline with no host copy of the tokens at all."""
    from blendmatch.gpu import QueryBatch
    from blendmatch.gpu.engine import probe_async

    pending, timings, last = [], [], None
    t0 = time.perf_counter()
    for _ in range(n):
        b = batch
        if lend:
            buf = eng.lend_tokens(batch.num_queries, batch.num_tokens)
            if buf is not None:
                if fill:
                    buf[:] = batch.tokens
                b = QueryBatch(buf, batch.offsets, batch.window, batch.stride)
        pending.append(probe_async(eng, b, slots))
        if len(pending) > 2:
            last = pending.pop(0).result()
            timings.append(last.timings)
    for h in pending:
        last = h.result()
        timings.append(last.timings)
    return time.perf_counter() - t0, timings, last


def step_engine_bench(workdir: Path) -> None:
    """The GPU engine's figures at 1M chunks: per shape (queries x 32,768 tokens), the CPU
    engine, the fused GPU engine's kernels alone (``kernels_s``: device-only), one batch at a
    time (``probe``) and pipelined (``probe_async`` two deep, plain and with the tokens copied
    into the lent pinned area first), each checked against the CPU engine, and the median
    phase timings of each mode (where a batch's time goes: ``stage_s`` host copy into pinned
    memory, ``upload_s``/``kernels_s``/``copyback_s`` each stream's events, ``wait_s`` the
    host blocked on the device)."""
    from blendmatch.bench.gpu_micro import _bench_inputs
    from blendmatch.gpu import QueryBatch
    from blendmatch.gpu.cpu import CpuEngine
    from blendmatch.gpu.select import create_gpu_engine

    tokens = _size(32_768, 1024)
    chunks = _size(1_000_000, 5_000)
    cpu = CpuEngine(reason="bench")
    eng = create_gpu_engine(reason="bench", kernels="fused")
    figures: dict[str, Any] = {"fake": FAKE, "device": eng.device_name, "engine_bench": {}}
    try:
        for queries, reps in ((_size(64, 4), _size(20, 6)), (_size(256, 8), _size(8, 4))):
            qs, slots = _bench_inputs(chunks=chunks, queries=queries, tokens=tokens, window=256, stride=1)
            batch = QueryBatch.from_queries(qs, 256, 1)
            w = batch.num_windows()
            row: dict[str, Any] = {"queries": queries, "tokens": tokens, "chunks": chunks, "windows": w}
            want = cpu.probe(batch, slots)
            row["cpu_windows_per_s"] = round(_rate(lambda: cpu.probe(batch, slots), w, max(3, reps // 4)))
            _check("bench probe", eng.probe(batch, slots), want)
            row["gpu_serial_windows_per_s"] = round(_rate(lambda: eng.probe(batch, slots), w, reps))
            serial = [eng.probe(batch, slots).timings for _ in range(reps)]
            row["gpu_serial_timings_s"] = _median_timings(serial)
            k = statistics.median(t["kernels_s"] for t in serial)
            row["gpu_device_only_windows_per_s"] = round(w / k) if k else None
            # pipelined: from the batch's host arrays (the engine copies them into pinned memory);
            # pipelined_lent: copied by the caller into the lent pinned area (the service's path:
            # its decode writes there); pipelined_prestaged: the staging sets already hold the
            # tokens (warmed by the lent round), so no host copy: what the device pipeline can do
            for label, lend, fill in (("pipelined", False, True), ("pipelined_lent", True, True),
                                      ("pipelined_prestaged", True, False)):
                _pipelined(eng, batch, slots, 3, lend, fill)  # warm-up
                wall, runs, last = _pipelined(eng, batch, slots, reps, lend, fill)
                _check(f"bench {label}", last, want)
                row[f"gpu_{label}_windows_per_s"] = round(w * reps / wall)
                row[f"gpu_{label}_timings_s"] = _median_timings(runs)
            e2e = row["gpu_pipelined_windows_per_s"]
            dev = row["gpu_device_only_windows_per_s"]
            row["pipelined_over_device_only"] = round(e2e / dev, 3) if dev else None
            row["pipelined_over_serial"] = round(e2e / row["gpu_serial_windows_per_s"], 3)
            row["pipelined_over_cpu"] = round(e2e / row["cpu_windows_per_s"], 3)
            row["engine_stats"] = {k: v for k, v in eng.stats().items() if isinstance(v, (int, float, str))}
            figures["engine_bench"][f"{queries}x{tokens}"] = row
    finally:
        eng.close()
    _figures(workdir, "engine-bench", figures)


async def _store_chunks(client, rows) -> None:
    for start in range(0, len(rows), 512):
        entries = [{"key": {"chunk_hash_hex": (b"\xab" + int(i).to_bytes(8, "big")).hex(),
                            "model_name": "m", "kv_rank": 1 << 24, "object_group_id": 0, "cache_salt": ""},
                    "size_bytes": 1024, "token_ids": rows[i].tolist(), "token_offset": 0}
                   for i in range(start, min(len(rows), start + 512))]
        batch = {"instance_id": "kit", "incarnation": 0, "seq": start // 512 + 1, "event_type": "store",
                 "tier": "l1", "backend": "LocalCPUBackend", "shared": False, "ts": 0.0, "entries": entries}
        r = await client.post("/events", json={"batches": [batch]})
        r.raise_for_status()


def _lookup_bodies(rng, rows, n: int, tokens: int, c: int) -> list[dict]:
    import numpy as np

    bodies = []
    for k in range(n):
        q = rng.integers(0, 50_000, size=tokens, dtype=np.uint32)
        if k % 2:
            q[:c] = rows[int(rng.integers(0, len(rows)))]
        bodies.append({"tokens_b64": base64.b64encode(q.astype("<u4").tobytes()).decode(), "model_name": "m"})
    return bodies


def _latency_figures(lat: list[float], wall: float) -> dict[str, float]:
    lat = sorted(lat)
    return {"lookups": len(lat), "lookups_per_s": round(len(lat) / wall, 1),
            "p50_ms": round(1e3 * lat[len(lat) // 2], 3),
            "p99_ms": round(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3)}


async def _service_run(engine: str, n_chunks: int, shapes: list[tuple[int, int, int]]) -> dict[str, Any]:
    """One in-process service on ``engine``: store ``n_chunks`` chunks through ``POST
    /events``, then for each ``(tokens, clients, per_client)`` let ``clients`` concurrent
    clients send ``per_client`` blend lookups each, back to back (half of them hits)."""
    import httpx
    import numpy as np

    from blendmatch.service.app import create_app
    from blendmatch.service.config import ServiceConfig

    c = 256
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 50_000, size=(n_chunks, c), dtype=np.uint32)
    app = create_app(ServiceConfig(chunk_size=c, engine=engine, host="127.0.0.1"))
    out: dict[str, Any] = {}
    async with app.router.lifespan_context(app):
        ctx = app.state.blendmatch_context
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kit", timeout=120) as client:
            await _store_chunks(client, rows)
            out["engine"] = ctx.directory.blend_index.engine.name
            for tokens, clients, per_client in shapes:
                bodies = _lookup_bodies(rng, rows, clients * per_client, tokens, c)
                for b in bodies[:clients]:  # warm-up
                    (await client.post("/directory/blend-lookup", json=b)).raise_for_status()
                lat: list[float] = []
                before = ctx.lookups.stats.as_dict()

                async def one(k: int) -> None:
                    for j in range(per_client):
                        t0 = time.perf_counter()
                        r = await client.post("/directory/blend-lookup", json=bodies[k * per_client + j])
                        lat.append(time.perf_counter() - t0)
                        r.raise_for_status()

                t0 = time.perf_counter()
                await asyncio.gather(*(one(k) for k in range(clients)))
                fig = _latency_figures(lat, time.perf_counter() - t0)
                after = ctx.lookups.stats.as_dict()
                batches = after["batches"] - before["batches"]
                fig.update(tokens=tokens, clients=clients, batches=batches,
                           mean_batch_queries=round((after["queries"] - before["queries"]) / max(1, batches), 2),
                           pipelined=ctx.directory.blend_index.pipelined)
                out[f"{tokens}"] = fig
    return out


def step_service_bench(workdir: Path) -> None:
    """Blend lookups through the service in-process at 8k and 32k tokens, 32 clients, on the
    GPU engine and on the CPU engine of the same node."""
    n_chunks = _size(20_000, 600)
    clients = _size(32, 8)
    shapes = [(_size(8_192, 1024), clients, _size(16, 3)), (_size(32_768, 2048), clients, _size(8, 3))]
    figures: dict[str, Any] = {"fake": FAKE, "service_bench": {"chunks": n_chunks}}
    for engine in ("gpu", "cpu"):
        figures["service_bench"][engine] = asyncio.run(_service_run(engine, n_chunks, shapes))
    _figures(workdir, "service-bench", figures)


def step_notebook(workdir: Path) -> None:
    """``notebooks/engine_batching.ipynb``'s sweep, condensed (the device image has no
    Jupyter): ``BlendIndex.match_batch_detailed`` end to end per engine (cpu, gpu), tokens per
    query and queries per batch, at the notebook's data (random chunks, a quarter of each
    query's tokens indexed chunks at unaligned positions); windows/s from the median batch
    time, batch p50/p99 and the engine's share. Every engine's matches are checked equal."""
    import numpy as np

    from blendmatch.gpu import select_engine
    from blendmatch.index import BlendIndex, BlendNamespace

    n_chunks, c = _size(100_000, 2_000), 256
    lengths = [_size(1024, 512), _size(8192, 1024), _size(32768, 2048)]
    per_batch = [1, 4, 16, 64] if not FAKE else [1, 4]
    reps = _size(15, 3)
    ns = BlendNamespace("kit-model")
    rng = np.random.default_rng(0)
    contents = rng.integers(0, 1 << 31, size=(n_chunks, c), dtype=np.uint32)
    hashes = [i.to_bytes(16, "little") for i in range(n_chunks)]
    offsets = (np.arange(n_chunks, dtype=np.int64) % 64) * c

    def make_query(length: int) -> np.ndarray:
        q = rng.integers(0, 1 << 31, size=length, dtype=np.uint32)
        n = min(int(0.25 * length / c), length // (2 * c))
        for s, k in zip(rng.choice(length // (2 * c), size=n, replace=False), rng.choice(n_chunks, size=n, replace=False)):
            pos = int(s) * 2 * c + int(rng.integers(0, c + 1))
            q[pos:pos + c] = contents[int(k)]
        return q

    queries = {L: [make_query(L) for _ in range(max(per_batch))] for L in lengths}
    rows, answers = [], {}
    for name in ("cpu", "gpu"):
        eng = select_engine(name)
        idx = BlendIndex(chunk_size=c, engine=eng)
        idx.reserve(n_chunks)
        idx.add_many(contents, hashes, offsets, ns)
        for L in lengths:
            for Q in per_batch:
                work = [(q, ns) for q in queries[L][:Q]]
                results, _ = idx.match_batch_detailed(work)
                if answers.setdefault((L, Q), results) != results:
                    raise SystemExit(f"notebook sweep: {name} disagrees with the CPU engine on {Q} x {L} tokens")
                times, engine_times, windows = [], [], 0
                for _ in range(reps):
                    t0 = time.perf_counter()
                    _, st = idx.match_batch_detailed(work)
                    times.append(time.perf_counter() - t0)
                    engine_times.append(st.engine_s)
                    windows = st.windows
                times.sort()
                med = statistics.median(times)
                rows.append({"engine": eng.name, "query_tokens": L, "queries_per_batch": Q, "windows": windows,
                             "windows_per_s": round(windows / med) if med else None,
                             "p50_ms": round(1e3 * med, 3), "p99_ms": round(1e3 * times[min(len(times) - 1,
                                                                                          int(0.99 * len(times)))], 3),
                             "engine_share": round(statistics.median(engine_times) / med, 3) if med else None})
        eng.close()
    _figures(workdir, "notebook", {"fake": FAKE, "notebook_engine_batching": {"chunks": n_chunks, "rows": rows}})


#: The GPU engine's targets (docs/performance.md, "The pipeline"; an H200, one kit run):
#: pipelined end to end >= 5 G windows/s at 64 x 32,768-token batches and >= 70% of the
#: device-only figure; 32k-token lookups through the service at 32 clients: more lookups/s on the GPU than on the CPU engine, p50 <= 1.2x.
TARGET_E2E_WINDOWS_PER_S = 5e9
TARGET_E2E_OVER_DEVICE = 0.7
TARGET_P50_OVER_CPU = 1.2


def targets(figures: dict[str, Any]) -> dict[str, Any]:
    """Each target with its measured value and ``pass`` (True/False; None when not measured,
    or measured on the fake device, which proves plumbing, never a figure)."""
    fake = bool(figures.get("fake"))
    eb = figures.get("engine_bench") or {}
    row = next((v for k, v in eb.items() if k.startswith(f"{4 if fake else 64}x")), None)
    sb = figures.get("service_bench") or {}

    def longest(engine: str) -> dict[str, Any] | None:  # the 32k-token shape (2k on the fake)
        runs = {int(k): v for k, v in (sb.get(engine) or {}).items() if k.isdigit()}
        return runs[max(runs)] if runs else None

    gpu, cpu = longest("gpu"), longest("cpu")

    def judge(ok: bool | None) -> bool | None:
        return None if fake or ok is None else bool(ok)

    e2e = row.get("gpu_pipelined_windows_per_s") if row else None
    dev = row.get("gpu_device_only_windows_per_s") if row else None
    out = {
        "e2e_windows_per_s_at_64x32768": {"target": TARGET_E2E_WINDOWS_PER_S, "measured": e2e,
                                          "pass": judge(None if e2e is None else e2e >= TARGET_E2E_WINDOWS_PER_S)},
        "e2e_over_device_only": {"target": TARGET_E2E_OVER_DEVICE,
                                 "measured": None if not (e2e and dev) else round(e2e / dev, 3),
                                 "pass": judge(None if not (e2e and dev) else e2e / dev >= TARGET_E2E_OVER_DEVICE)},
        "service_32k_lookups_per_s_gpu_over_cpu": {
            "target": "> 1", "measured": None if not (gpu and cpu) else round(gpu["lookups_per_s"] / cpu["lookups_per_s"], 3),
            "pass": judge(None if not (gpu and cpu) else gpu["lookups_per_s"] > cpu["lookups_per_s"])},
        "service_32k_p50_gpu_over_cpu": {
            "target": TARGET_P50_OVER_CPU, "measured": None if not (gpu and cpu) else round(gpu["p50_ms"] / cpu["p50_ms"], 3),
            "pass": judge(None if not (gpu and cpu) else gpu["p50_ms"] <= TARGET_P50_OVER_CPU * cpu["p50_ms"])},
    }
    out["all_pass"] = judge(all(t["pass"] for t in out.values()) if all(t["pass"] is not None for t in out.values())
                            else None)
    out["judged"] = not fake and out["all_pass"] is not None
    return out


def step_service_smoke(workdir: Path) -> None:
    # the numpy reference engine: this proves the service and the carried wheels, not an engine
    # (and needs no JIT compilation, so it is quick in a fresh environment)
    run = asyncio.run(_service_run("reference", 500, [(4096, 2, 5)]))
    _figures(workdir, "service-smoke", {"lookup_reference_smoke": run["4096"]})


def step_summary(workdir: Path, out: Path, dry_run: bool) -> None:
    steps = []
    for line in (workdir / "steps.tsv").read_text().splitlines():
        name, status, seconds = line.split("\t")[:3]
        steps.append({"name": name, "status": status, "seconds": float(seconds)})
    figures: dict[str, Any] = {}
    for f in sorted(workdir.glob("figures_*.json")):
        figures.update(json.loads(f.read_text()))
    device = figures.get("device")
    if device is None:
        env = workdir / "device.txt"
        device = env.read_text().strip() if env.exists() and env.read_text().strip() else None
    summary = {"device": device or ("none (dry run)" if dry_run else "unknown"), "dry_run": dry_run,
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "steps": steps, "figures": figures,
               "targets": targets(figures)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(json.dumps(summary, indent=1, sort_keys=True))


def main(argv: list[str]) -> int:
    step, workdir = argv[0], Path(argv[1])
    if step == "summary":
        step_summary(workdir, Path(argv[2]), "--dry-run" in argv)
        return 0
    if "--fake" in argv:
        _use_fake_device()
    fn = {"imports": step_imports, "trial": step_trial, "scale": step_scale, "engine-bench": step_engine_bench,
          "service-bench": step_service_bench, "notebook": step_notebook, "service-smoke": step_service_smoke}[step]
    fn(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
