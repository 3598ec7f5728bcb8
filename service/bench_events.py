"""Ingest benchmark: STORE batches through the gate, the key directory and the blend index.

Question answered: "how many cache-event entries per second can one process ingest, and
how much memory does each stored chunk cost?" (issue 3: >= 200k entries/s with 256-token
chunks in batches of 1,000; <= 1.6 KB resident per chunk with blend lookup enabled).

What is timed: ``KeyDirectory.apply`` on decoded JSON (Python dicts and lists, as an HTTP
route holds them after decoding the body): validation, token conversion, the gate, the
directory and ``BlendIndex.add_many``. JSON decoding itself is not included (it depends on
the decoder the service uses); ``parse_s`` reports the validation share. The timed run is
the best of ``repeats`` by wall time; ``entries_per_cpu_s`` divides by the process's CPU
time instead, which a machine shared with other work distorts less.

Memory: ``resident_bytes_per_chunk`` is the growth of the process's resident set
(``/proc``) during the first timed run, over the chunks stored (allocator slack included;
the input requests are built before the baseline). ``traced_bytes_per_chunk`` comes from a
separate pass under ``tracemalloc`` (which would inflate the resident set with its own
bookkeeping) plus the index's token blocks that are mapped straight from the OS (which
``tracemalloc`` does not see). ``index_memory_bytes`` is ``BlendIndex.memory_bytes()``
(capacity, not use). The index allocates tokens in 8 MiB blocks, so every per-chunk figure
carries up to ``8 MiB / entries`` of block slack: use 100k entries or more.

Run: ``python -m blendmatch.service.bench_events [--entries N] [--batch N] [--chunk-size N]
[--engine cpu] [--json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import sys
import time
import tracemalloc
from typing import Any, Optional, Sequence

import numpy as np

from blendmatch.index.events import parse_event_request
from blendmatch.index.key_directory import KeyDirectory

__all__ = ["make_requests", "run", "main"]

#: Token ids are drawn below this (a typical vocabulary size).
VOCAB = 128_000
#: Bytes of each synthetic chunk hash (LMCache-style 32-byte digests in hex).
HASH_BYTES = 32
#: Chunks stored in the traced pass at most (tracing is slow; the figure is per chunk).
MEMORY_PASS_MAX = 100_000


def make_requests(num_entries: int, batch_entries: int, chunk_size: int, *, seed: int = 0,
                  instance_id: str = "bench-0", first_hash: int = 0) -> list[dict[str, Any]]:
    """Decoded ``POST /events`` bodies: one STORE batch of ``batch_entries`` each, distinct
    chunk hashes, random tokens, known offsets, one model and one placement per key."""
    rng = np.random.default_rng(seed)
    requests = []
    seq = 0
    for start in range(0, num_entries, batch_entries):
        n = min(batch_entries, num_entries - start)
        tokens = rng.integers(0, VOCAB, size=(n, chunk_size)).tolist()
        entries = [{
            "key": {"chunk_hash_hex": (first_hash + start + i).to_bytes(HASH_BYTES, "big").hex(),
                    "model_name": "meta-llama/Llama-3.1-8B", "kv_rank": 1 << 24,
                    "object_group_id": 0, "cache_salt": ""},
            "size_bytes": 128 * 1024,
            "token_ids": tokens[i],
            "token_offset": ((start + i) % 64) * chunk_size,
        } for i in range(n)]
        seq += 1
        requests.append({"batches": [{
            "instance_id": instance_id, "incarnation": 0, "seq": seq, "event_type": "store",
            "tier": "l1", "backend": "LocalCPUBackend", "shared": False, "ts": 0.0, "entries": entries,
        }]})
    return requests


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return 0


def _mapped_token_bytes(directory: KeyDirectory) -> int:
    """Bytes of index token blocks mapped straight from the OS (invisible to tracemalloc)."""
    index = directory.blend_index
    store = getattr(index, "_tokens", None)
    blocks = getattr(store, "_py_blocks", ())
    total = 0
    for block in blocks:
        base = block
        while isinstance(base, np.ndarray):  # views of views of the mapping
            base = base.base
        if isinstance(base, memoryview):  # np.frombuffer keeps a memoryview of the mmap
            base = base.obj
        if isinstance(base, mmap.mmap):
            total += int(block.nbytes)
    return total


def _new_directory(chunk_size: int, engine: str) -> KeyDirectory:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=chunk_size, probe_stride=1, engine=engine)
    return d


def _timed_pass(requests: list[dict[str, Any]], chunk_size: int, engine: str, repeats: int) -> dict[str, float]:
    """Best of ``repeats`` runs into fresh directories (the machine may be shared). The
    first run also records the growth of the resident set: it is the only run that does not
    reuse memory freed by an earlier directory, and no tracer inflates it."""
    best: Optional[dict[str, float]] = None
    rss = 0
    chunks = 0
    for attempt in range(repeats):
        d = _new_directory(chunk_size, engine)
        gc.collect()
        rss0 = _rss_bytes()
        parse_s = apply_s = 0.0
        cpu0 = time.process_time()
        for req in requests:
            t0 = time.perf_counter()
            parsed = parse_event_request(req)
            t1 = time.perf_counter()
            d.apply(parsed)
            apply_s += time.perf_counter() - t1
            parse_s += t1 - t0
        cpu_s = time.process_time() - cpu0
        total = parse_s + apply_s
        if attempt == 0:
            gc.collect()
            rss = _rss_bytes() - rss0
            chunks = d.stats()["blend_index"]["num_chunks"]
        if best is None or total < best["total_s"]:
            best = {"total_s": total, "parse_s": parse_s, "apply_s": apply_s, "cpu_s": cpu_s}
        del d
    assert best is not None
    best["resident_bytes_per_chunk"] = rss / chunks if chunks else 0.0
    return best


def _memory_pass(requests: list[dict[str, Any]], chunk_size: int, engine: str) -> dict[str, float]:
    """Traced growth per chunk (tracemalloc + the token blocks mapped from the OS)."""
    d = _new_directory(chunk_size, engine)
    gc.collect()
    tracemalloc.start()
    traced0 = tracemalloc.get_traced_memory()[0]
    for req in requests:
        d.apply(req)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - traced0
    tracemalloc.stop()
    chunks = d.stats()["blend_index"]["num_chunks"]
    mapped = _mapped_token_bytes(d)
    index_bytes = d.blend_index.memory_bytes()  # type: ignore[union-attr]
    return {
        "memory_chunks": chunks,
        "traced_bytes_per_chunk": (traced + mapped) / chunks if chunks else 0.0,
        "index_memory_bytes": index_bytes,
        "index_bytes_per_chunk": index_bytes / chunks if chunks else 0.0,
    }


def run(num_entries: int = 100_000, batch_entries: int = 1000, chunk_size: int = 256,
        engine: str = "cpu", *, repeats: int = 2, memory: bool = True) -> dict[str, Any]:
    """Measure ingest throughput and memory per chunk; returns a flat dict of figures.

    ``entries_per_s`` covers validation + gate + directory + index (decoded JSON in);
    the timed pass is the best of ``repeats``. Defaults finish in well under a minute on
    two cores.
    """
    if num_entries < 1 or batch_entries < 1 or chunk_size < 1:
        raise ValueError("num_entries, batch_entries and chunk_size must be >= 1")
    requests = make_requests(num_entries, batch_entries, chunk_size)
    # A service holds one decoded request at a time; the benchmark holds them all (tens of
    # millions of ints). Freeze them so the cyclic GC does not traverse them on every full
    # collection; the directory's own objects are still collected as in production.
    gc.collect()
    gc.freeze()
    warm = make_requests(min(2 * batch_entries, 4096), batch_entries, chunk_size, seed=1, instance_id="warm")
    wd = _new_directory(chunk_size, engine)  # compiles / loads every numba function used
    for req in warm:
        wd.apply(req)
    engine_name = wd.blend_index.engine.name  # type: ignore[union-attr]
    del wd
    timed = _timed_pass(requests, chunk_size, engine, repeats)
    out: dict[str, Any] = {
        "entries": num_entries,
        "batch_entries": batch_entries,
        "chunk_size": chunk_size,
        "engine": engine_name,
        "entries_per_s": num_entries / timed["total_s"],
        "entries_per_cpu_s": num_entries / timed["cpu_s"],
        "total_s": timed["total_s"],
        "parse_s": timed["parse_s"],
        "apply_s": timed["apply_s"],
        "us_per_entry": 1e6 * timed["total_s"] / num_entries,
        "resident_bytes_per_chunk": timed["resident_bytes_per_chunk"],
    }
    if memory:
        mem_requests = requests[: max(1, MEMORY_PASS_MAX // batch_entries)]
        out.update(_memory_pass(mem_requests, chunk_size, engine))
    gc.unfreeze()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blendmatch.service.bench_events",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--engine", default="cpu", choices=("cpu", "reference", "gpu", "auto"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true", help="skip the (slower) memory pass")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args.entries, args.batch, args.chunk_size, args.engine, repeats=args.repeats,
                 memory=not args.no_memory)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:26s} {v:,.1f}" if isinstance(v, float) else f"{k:26s} {v}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
