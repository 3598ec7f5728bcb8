"""The Python steps of ``scripts/gpu_check.sh`` (run with the kit's installed package).

    python3 scripts/gpu_kit.py STEP WORKDIR [--dry-run]

Steps: ``imports`` (the package's bottom rooms import without pydantic/FastAPI; the service
imports with the carried wheels), ``trial`` (trial launch + self-test, both kernel modes),
``scale`` (self-test at scale: tens of millions of tokens, split passes and a tiny grid,
bit for bit against the CPU engine), ``bench`` (GPU windows/s, GPU/CPU ratio, lookup
latency through the service in-process on the GPU and CPU engines), ``service-smoke`` (the
service in-process on the CPU engine: proves the carried wheels), ``summary`` (writes
``summary.json`` from the step records). Each step writes its figures to
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


def _rate(fn, windows: int, iters: int) -> float:
    fn()  # warm-up (compile, upload)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return windows / statistics.median(times)


async def _lookup_latency(engine: str, n_chunks: int, queries: int, tokens: int) -> dict[str, float]:
    """Store ``n_chunks`` chunks through ``POST /events``, then time ``queries`` blend lookups
    of ``tokens`` tokens each (half of them hits) through the app in-process."""
    import httpx
    import numpy as np

    from blendmatch.service.app import create_app
    from blendmatch.service.config import ServiceConfig

    c = 256
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 50_000, size=(n_chunks, c), dtype=np.uint32)
    app = create_app(ServiceConfig(chunk_size=c, engine=engine, host="127.0.0.1"))
    lat: list[float] = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kit", timeout=60) as client:
            for start in range(0, n_chunks, 512):
                entries = [{"key": {"chunk_hash_hex": (b"\xab" + int(i).to_bytes(8, "big")).hex(),
                                    "model_name": "m", "kv_rank": 1 << 24, "object_group_id": 0, "cache_salt": ""},
                            "size_bytes": 1024, "token_ids": rows[i].tolist(), "token_offset": 0}
                           for i in range(start, min(n_chunks, start + 512))]
                batch = {"instance_id": "kit", "incarnation": 0, "seq": start // 512 + 1, "event_type": "store",
                         "tier": "l1", "backend": "LocalCPUBackend", "shared": False, "ts": 0.0,
                         "entries": entries}
                r = await client.post("/events", json={"batches": [batch]})
                r.raise_for_status()
            for k in range(queries):
                q = rng.integers(0, 50_000, size=tokens, dtype=np.uint32)
                if k % 2:
                    q[:c] = rows[int(rng.integers(0, n_chunks))]
                body = {"tokens_b64": base64.b64encode(q.astype("<u4").tobytes()).decode(), "model_name": "m"}
                t0 = time.perf_counter()
                r = await client.post("/directory/blend-lookup", json=body)
                lat.append(time.perf_counter() - t0)
                r.raise_for_status()
    lat.sort()
    return {"p50_ms": round(1e3 * lat[len(lat) // 2], 3), "p99_ms": round(1e3 * lat[min(len(lat) - 1,
                                                                                       int(len(lat) * 0.99))], 3),
            "queries": queries, "query_tokens": tokens, "chunks": n_chunks}


def step_bench(workdir: Path) -> None:
    from blendmatch.bench.gpu_micro import _bench_inputs
    from blendmatch.gpu import QueryBatch
    from blendmatch.gpu.cpu import CpuEngine
    from blendmatch.gpu.select import create_gpu_engine

    # issue 27's target size: 1M chunks, 64 x 32,768-token queries (2M tokens) per batch
    qs, slots = _bench_inputs(chunks=1_000_000, queries=64, tokens=32_768, window=256, stride=1)
    batch = QueryBatch.from_queries(qs, 256, 1)
    w = batch.num_windows()
    cpu = CpuEngine(reason="bench")
    figures: dict[str, Any] = {"bench_windows_per_batch": w}
    figures["cpu_windows_per_s"] = round(_rate(lambda: cpu.probe(batch, slots), w, 5))
    want = cpu.probe(batch, slots)
    for kernels in ("fused", "array"):
        eng = create_gpu_engine(reason="bench", kernels=kernels)
        try:
            _check(f"bench {kernels}", eng.probe(batch, slots), want)
            rate = _rate(lambda: eng.probe(batch, slots), w, 20)
            # medians of 20 batches: one batch's timings are noisy (the first device run's single
            # sample said 4.5 G windows/s where the median of 30 was 9.9)
            runs = [eng.probe(batch, slots).timings for _ in range(20)]
            k = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            figures[f"gpu_{kernels}_windows_per_s"] = round(rate)
            figures[f"gpu_{kernels}_kernel_windows_per_s"] = round(w / k["kernels_s"]) if k["kernels_s"] else None
            figures[f"gpu_{kernels}_timings_s"] = {key: round(v, 6) for key, v in k.items()}
            figures[f"gpu_{kernels}_over_cpu"] = round(rate / figures["cpu_windows_per_s"], 2)
        finally:
            eng.close()
    for engine in ("gpu", "cpu"):
        figures[f"lookup_{engine}"] = asyncio.run(_lookup_latency(engine, n_chunks=20_000, queries=200,
                                                                  tokens=32_768))
    _figures(workdir, "bench", figures)


def step_service_smoke(workdir: Path) -> None:
    # the numpy reference engine: this proves the service and the carried wheels, not an engine
    # (and needs no JIT compilation, so it is quick in a fresh environment)
    _figures(workdir, "service-smoke", {"lookup_reference_smoke": asyncio.run(_lookup_latency(
        "reference", n_chunks=500, queries=10, tokens=4096))})


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
               "steps": steps, "figures": figures}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(json.dumps(summary, indent=1, sort_keys=True))


def main(argv: list[str]) -> int:
    step, workdir = argv[0], Path(argv[1])
    if step == "summary":
        step_summary(workdir, Path(argv[2]), "--dry-run" in argv)
        return 0
    fn = {"imports": step_imports, "trial": step_trial, "scale": step_scale, "bench": step_bench,
          "service-smoke": step_service_smoke}[step]
    fn(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
