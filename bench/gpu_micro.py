"""Device micro-benchmark of the GPU engine: hash + probe + compaction, timed on the device.

Run on a GPU machine: ``python -m blendmatch.bench.gpu_micro --help`` (``scripts/gpu_check.sh``
does). Builds a slot table like ``SlotArray``'s for ``--chunks`` fingerprints, plants about 32
real hits per query, checks the first batch's candidates against a CPU engine bit for bit,
and reports the median phase timings and windows/s per kernel mode.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from blendmatch.gpu import QueryBatch, TAG_SHARED, create_gpu_engine, prefix_fingerprints
from blendmatch.gpu.cpu import CpuEngine
from blendmatch.gpu.fingerprint import power_tables, slots_and_tags
from blendmatch.gpu.reference import ReferenceEngine
from blendmatch.gpu.xp_probe import TrialSlots

def _bench_inputs(chunks: int, queries: int, tokens: int, window: int, stride: int, seed: int = 1):
    """A slot table for ``chunks`` indexed fingerprints (16 slots each, like ``SlotArray``),
    ``queries`` random queries of ``tokens`` tokens, and about 32 real hits planted per query."""
    rng = np.random.default_rng(seed)
    qs = [rng.integers(0, 128_000, size=tokens, dtype=np.uint32) for _ in range(queries)]
    size = max(1024, 1 << int(16 * max(chunks, 1) - 1).bit_length())
    fps = rng.integers(0, 2**63, size=chunks, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    planted = []
    for q in qs:
        pf, pi = power_tables(q.size + 1)
        h = prefix_fingerprints(q, window, np, pf, pi)
        if h.size:
            planted.append(h[rng.integers(0, h.size, size=min(32, h.size))])
    if planted:
        fps = np.concatenate([fps] + planted)
    slot, tag = slots_and_tags(fps, size - 1)
    table = np.zeros(size, dtype=np.uint8)
    uniq, counts = np.unique(slot, return_counts=True)
    table[slot] = tag
    table[uniq[counts > 1]] = TAG_SHARED
    return qs, TrialSlots(table)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import statistics

    p = argparse.ArgumentParser(prog="python -m blendmatch.bench.gpu_micro",
                                description="Device micro-benchmark of the GPU engine (hash + probe + compaction).")
    p.add_argument("--chunks", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32_768)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernels", default="fused,array")
    p.add_argument("--check", default="cpu", choices=("cpu", "reference", "none"),
                   help="engine the first batch's candidates are compared with, bit for bit")
    p.add_argument("--out", default=None, help="folder for bench_gpu.json")
    args = p.parse_args(argv)

    qs, slots = _bench_inputs(args.chunks, args.queries, args.tokens, args.window, args.stride)
    batch = QueryBatch.from_queries(qs, args.window, args.stride)
    want = None
    if args.check != "none":
        if args.check == "cpu":
            ref_engine: Any = CpuEngine(reason="bench check")
        else:
            ref_engine = ReferenceEngine(reason="bench check")
        want = ref_engine.probe(batch, slots)
    results = []
    for mode in [m.strip() for m in args.kernels.split(",") if m.strip()]:
        engine = create_gpu_engine(reason="bench", kernels=mode)
        try:
            for _ in range(3):
                got = engine.probe(batch, slots)  # warm-up: first one uploads the table
            same = None if want is None else bool(want.same_as(got) and want.windows == got.windows)
            runs = [engine.probe(batch, slots).timings for _ in range(args.iters)]
        finally:
            engine.close()
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        w = got.windows
        row = {"kernels": mode, "device": engine.device_name, "windows": w, "candidates": len(got),
               "matches_check": same, "median_s": med,
               "kernel_windows_per_s": w / med["kernels_s"] if med["kernels_s"] > 0 else None,
               "end_to_end_windows_per_s": w / med["total_s"] if med["total_s"] > 0 else None}
        results.append(row)
        print(f"[{mode}] {engine.device_name}: {w} windows, {len(got)} candidates, check={same}; "
              + ", ".join(f"{k}={v * 1e3:.3f}ms" for k, v in med.items())
              + f"; kernels {(row['kernel_windows_per_s'] or 0) / 1e9:.2f} G windows/s, end-to-end "
              f"{(row['end_to_end_windows_per_s'] or 0) / 1e9:.2f} G windows/s")
    report = {"args": vars(args), "table_size": int(slots.table.size), "results": results}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump(report, f, indent=2)
    bad = [r for r in results if r["matches_check"] is False]
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover - device tool
    raise SystemExit(main())
