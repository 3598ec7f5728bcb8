"""Ingest benchmark: STORE batches through the gate, the key directory and the blend index.

Question answered: "how many cache-event entries per second can one process ingest, and
how much memory does each stored chunk cost?" (the targets: >= 200k entries/s with 256-token
chunks in batches of 1,000; <= 1.6 KB resident per chunk with blend lookup enabled).

What is timed: ``KeyDirectory.apply``: validation, token conversion, the gate, the
directory and ``BlendIndex.add_many``, for the same batches in two input forms, side by
side in one run:

- ``json_*``: decoded JSON, ``token_ids`` as Python lists of ints (what the HTTP route
  holds after decoding a body). Converting 256 Python ints per entry is the largest single
  cost, bound by reading the int objects.
- ``packed_*``: ``token_ids`` as uint32 numpy arrays (in-process producers, a binary
  transport): the same path with no per-token work.

JSON decoding itself is not included (it depends on the decoder the service uses);
``*_parse_s`` reports the validation share. Every request is built before timing and held,
so each batch is read cold from memory (pessimistic: a service applies a body right after
decoding it, partly still in cache). The held requests are frozen out of the cyclic GC,
whose collections, triggered by the directory's allocations, stay on and part of the cost
as they walk the directory's and the index's objects; in a service they also walk the
containers of the request being applied, which this benchmark does not count. The forms
alternate, ``repeats`` runs each into fresh directories; the figures are each form's best
run by wall time. ``*_entries_per_cpu_s`` divides by the process's CPU time instead, which
a machine shared with other work distorts less. A run counts only if every entry was
indexed.

Memory: ``resident_bytes_per_chunk`` is the growth of the process's resident set
(``/proc``) during the first timed run (JSON form), over the chunks stored (allocator slack
included; the input requests are built before the baseline). ``traced_bytes_per_chunk``
comes from a separate pass under ``tracemalloc`` (which would inflate the resident set with
its own bookkeeping) plus the index's token blocks that are mapped straight from the OS
(which ``tracemalloc`` does not see). ``index_memory_bytes`` is
``BlendIndex.memory_bytes()`` (capacity, not use). The index allocates tokens in 8 MiB
blocks, so every per-chunk figure carries up to ``8 MiB / entries`` of block slack: use
100k entries or more.

``--kv-events`` adds ``packed_kv_events``: the packed form with a vLLM
KV-events publisher attached (``service/publish``) and a subscriber draining it on a
thread, alternating with the other forms; ``kv_events_overhead`` is its relative loss of
ingest rate, ``packed_kv_events_drain_s`` how long the publisher took to send what was
still queued when ingest ended (not in the rate). ``--kv-events-rate R`` (default 100,000)
adds ``packed_paced`` and ``packed_paced_kv_events``: the same requests offered at R
entries/s, off and on; ``*_achieved_entries_per_s`` and ``*_cpu_us_per_entry`` for each,
``kv_events_paced_overhead`` the relative loss of achieved rate.

Run: ``python -m blendmatch.bench.events [--entries N] [--batch N[,N]] [--chunk-size N]
[--engine cpu] [--repeats N] [--no-memory] [--json] [--kv-events]``.
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

from blendmatch.index import KeyDirectory, parse_event_request

__all__ = ["make_requests", "run", "main"]

#: Token ids are drawn below this (a typical vocabulary size).
VOCAB = 128_000
#: Bytes of each synthetic chunk hash (LMCache-style 32-byte digests in hex).
HASH_BYTES = 32
#: Chunks stored in the traced pass at most (tracing is slow; the figure is per chunk).
MEMORY_PASS_MAX = 100_000


def make_requests(num_entries: int, batch_entries: int, chunk_size: int, *, seed: int = 0,
                  instance_id: str = "bench-0", first_hash: int = 0, packed: bool = False) -> list[dict[str, Any]]:
    """Decoded ``POST /events`` bodies: one STORE batch of ``batch_entries`` each, distinct
    chunk hashes, random tokens, known offsets, one model and one placement per key.

    ``packed``: ``token_ids`` are read-only uint32 rows of one array per batch (as an
    in-process producer or a binary transport would hand them over) instead of lists of
    ints; the ids are the same for the same ``seed``.
    """
    rng = np.random.default_rng(seed)
    requests = []
    seq = 0
    for start in range(0, num_entries, batch_entries):
        n = min(batch_entries, num_entries - start)
        block = rng.integers(0, VOCAB, size=(n, chunk_size))
        if packed:
            block = block.astype(np.uint32)
            block.setflags(write=False)
            tokens: Sequence[Any] = list(block)
        else:
            tokens = block.tolist()
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


class _Publishing:
    """``--kv-events``: a vLLM KV-events publisher on loopback with one subscriber draining
    it on a thread (what a router would do, here on the same two cores)."""

    def __init__(self, d: KeyDirectory) -> None:
        import threading

        import zmq

        from blendmatch.service.publish import KVEventsPublisher, KVEventsSettings

        self.pub = KVEventsPublisher(KVEventsSettings(endpoint="tcp://127.0.0.1:*", buffer_steps=1000))
        self.pub.start()
        d.set_holder_watch(self.pub.watch)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.pub.bound_endpoint)
        self.received = 0
        self.bytes = 0
        self._stop = False
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()
        time.sleep(0.2)  # let the subscription reach the publisher (not timed)

    def _drain(self) -> None:
        while not self._stop:
            if self.sub.poll(50):
                frames = self.sub.recv_multipart(copy=False)
                self.received += 1
                self.bytes += len(frames[2])

    def close(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.pub.wait_idle(600)
        drain_s = time.perf_counter() - t0
        while self.received < self.pub.next_seq and time.perf_counter() - t0 < 10:
            time.sleep(0.01)
        self._stop = True
        self.thread.join()
        self.sub.close(0)
        self.ctx.term()
        self.pub.stop()
        return {"drain_s": drain_s, "messages": float(self.pub.next_seq), "received": float(self.received),
                "payload_bytes": float(self.bytes), "dropped": float(self.pub.counters["dropped"])}


def _apply_all(requests: list[dict[str, Any]], chunk_size: int,
               engine: str, publish: bool = False, rate: float = 0.0) -> tuple[KeyDirectory, dict[str, float]]:
    """One timed run into a fresh directory; ``rss0`` is the resident set just before it.
    ``publish``: with a KV-events publisher attached (its drain after ingest is reported,
    not counted in ``total_s``)."""
    d = _new_directory(chunk_size, engine)
    publishing = _Publishing(d) if publish else None
    gc.collect()
    rss0 = _rss_bytes()
    parse_s = apply_s = 0.0
    cpu0 = time.process_time()
    start = time.perf_counter()
    done = 0
    for req in requests:
        if rate > 0:  # offered load: request k is due at start + entries before it / rate
            wait = start + done / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            done += sum(len(b["entries"]) for b in req["batches"])
        t0 = time.perf_counter()
        parsed = parse_event_request(req)
        t1 = time.perf_counter()
        d.apply(parsed)
        apply_s += time.perf_counter() - t1
        parse_s += t1 - t0
    cpu_s = time.process_time() - cpu0
    wall_s = time.perf_counter() - start
    extra = publishing.close() if publishing is not None else {}
    extra["wall_s"] = wall_s
    return d, {"total_s": parse_s + apply_s, "parse_s": parse_s, "apply_s": apply_s, "cpu_s": cpu_s, "rss0": rss0,
               **extra}


def _timed_passes(forms: dict[str, list[dict[str, Any]]], chunk_size: int, engine: str,
                  repeats: int, rate: float = 0.0) -> tuple[dict[str, dict[str, float]], float]:
    """Best of ``repeats`` runs per input form, the forms alternating run by run (the
    machine may be shared: alternating exposes both to the same conditions), and the
    resident-set growth per chunk of the very first run: it is the only run that does not
    reuse memory freed by an earlier directory, and no tracer inflates it."""
    best: dict[str, dict[str, float]] = {}
    resident_per_chunk = 0.0
    for _ in range(repeats):
        for form, requests in forms.items():
            first = not best
            d, run = _apply_all(requests, chunk_size, engine, publish=form.endswith("_kv_events"),
                                rate=rate if "paced" in form else 0.0)
            chunks = d.stats()["blend_index"]["num_chunks"]
            entries = sum(len(b["entries"]) for req in requests for b in req["batches"])
            if chunks != entries:  # a figure only counts if every entry was indexed
                raise RuntimeError(f"{form} input: {chunks} chunks indexed for {entries} entries")
            if first:
                gc.collect()
                resident_per_chunk = (_rss_bytes() - run["rss0"]) / chunks if chunks else 0.0
            if form not in best or run["total_s"] < best[form]["total_s"]:
                best[form] = run
            del d
    return best, resident_per_chunk


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
        engine: str = "cpu", *, repeats: int = 3, memory: bool = True, kv_events: bool = False,
        kv_events_rate: float = 100_000.0) -> dict[str, Any]:
    """Measure ingest throughput (both input forms) and memory per chunk; returns a flat
    dict of figures.

    ``json_entries_per_s`` / ``packed_entries_per_s`` cover validation + gate + directory +
    index, with tokens as lists of ints (decoded JSON) / as uint32 arrays; each is the best
    of ``repeats`` runs. Defaults finish in about a minute on two cores.

    ``kv_events``: also the packed form with a vLLM KV-events publisher attached
    (``packed_kv_events_*``), alternating with the others in the same run, plus
    ``kv_events_overhead``: the relative loss of ingest rate.
    """
    if num_entries < 1 or batch_entries < 1 or chunk_size < 1:
        raise ValueError("num_entries, batch_entries and chunk_size must be >= 1")
    forms = {"json": make_requests(num_entries, batch_entries, chunk_size),
             "packed": make_requests(num_entries, batch_entries, chunk_size, packed=True)}
    if kv_events:
        forms["packed_kv_events"] = forms["packed"]
        if kv_events_rate > 0:  # the same at an offered load (entries/s), off and on
            forms["packed_paced"] = forms["packed_paced_kv_events"] = forms["packed"]
    # A service holds one decoded request at a time; the benchmark holds them all (tens of
    # millions of ints). Freeze them so the cyclic GC does not traverse them on every full
    # collection; the directory's own objects are still collected as in production.
    gc.collect()
    gc.freeze()
    wd = _new_directory(chunk_size, engine)  # compiles / loads every numba function used
    for packed in (False, True):
        for req in make_requests(min(2 * batch_entries, 4096), batch_entries, chunk_size, seed=1,
                                 instance_id=f"warm-{packed}", packed=packed):
            wd.apply(req)
    engine_name = wd.blend_index.engine.name  # type: ignore[union-attr]
    del wd
    timed, resident_per_chunk = _timed_passes(forms, chunk_size, engine, repeats, kv_events_rate)
    out: dict[str, Any] = {
        "entries": num_entries,
        "batch_entries": batch_entries,
        "chunk_size": chunk_size,
        "engine": engine_name,
    }
    for form, t in timed.items():
        out[f"{form}_entries_per_s"] = num_entries / t["total_s"]
        out[f"{form}_entries_per_cpu_s"] = num_entries / t["cpu_s"]
        out[f"{form}_us_per_entry"] = 1e6 * t["total_s"] / num_entries
        out[f"{form}_parse_s"] = t["parse_s"]
        out[f"{form}_apply_s"] = t["apply_s"]
        for k in ("drain_s", "messages", "received", "payload_bytes", "dropped"):
            if k in t:
                out[f"{form}_{k}"] = t[k]
        if "paced" in form:  # achieved rate over the whole run (pauses included), CPU per entry
            out[f"{form}_achieved_entries_per_s"] = num_entries / t["wall_s"]
            out[f"{form}_cpu_us_per_entry"] = 1e6 * t["cpu_s"] / num_entries
    if kv_events:
        out["kv_events_overhead"] = 1 - out["packed_kv_events_entries_per_s"] / out["packed_entries_per_s"]
        if kv_events_rate > 0:
            out["kv_events_offered_entries_per_s"] = kv_events_rate
            out["kv_events_paced_overhead"] = 1 - (out["packed_paced_kv_events_achieved_entries_per_s"]
                                                   / out["packed_paced_achieved_entries_per_s"])
    out["resident_bytes_per_chunk"] = resident_per_chunk
    if memory:
        mem_requests = forms["json"][: max(1, MEMORY_PASS_MAX // batch_entries)]
        out.update(_memory_pass(mem_requests, chunk_size, engine))
    gc.unfreeze()
    return out


def access_cost(num_entries: int = 100_000, batch_entries: int = 1000, chunk_size: int = 256,
                engine: str = "cpu", *, repeats: int = 3) -> dict[str, float]:
    """Microseconds per ACCESS entry applied to a directory holding ``num_entries`` stored
    keys (LMCache's per-key access count): the first access of each key (its record is
    created), a repeat access (counted), and an access of an unknown key (a no-op); each
    the best of ``repeats`` passes over every key, beside a STORE of the same entries."""
    stores = make_requests(num_entries, batch_entries, chunk_size, packed=True)

    def as_access(reqs: list[dict[str, Any]], instance: str, first_hash: int = 0) -> list[dict[str, Any]]:
        out = []
        for seq, req in enumerate(reqs, 1):
            batch = dict(req["batches"][0], event_type="access", instance_id=instance, seq=seq, ts=float(seq))
            entries = []
            for e in batch["entries"]:
                key = dict(e["key"])
                if first_hash:
                    key["chunk_hash_hex"] = (int(key["chunk_hash_hex"], 16) + first_hash).to_bytes(HASH_BYTES,
                                                                                                    "big").hex()
                entries.append({"key": key, "size_bytes": 0})
            batch["entries"] = entries
            out.append({"batches": [batch]})
        return out

    best: dict[str, float] = {}
    for _ in range(repeats):
        d = _new_directory(chunk_size, engine)
        t0 = time.perf_counter()
        for req in stores:
            d.apply(req)
        times = {"store": time.perf_counter() - t0}
        for name, reqs in (("access_first", as_access(stores, "reader-1")),
                           ("access_repeat", as_access(stores, "reader-2")),
                           ("access_unknown", as_access(stores, "reader-3", first_hash=1 << 40))):
            t0 = time.perf_counter()
            for req in reqs:
                d.apply(req)
            times[name] = time.perf_counter() - t0
        if d.access_counts([d.list_keys(limit=1)[0].key]) != [2]:
            raise AssertionError("both ACCESS passes should have counted")
        for name, t in times.items():
            us = 1e6 * t / num_entries
            best[f"{name}_us_per_entry"] = min(best.get(f"{name}_us_per_entry", us), us)
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blendmatch.bench.events",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--batch", type=lambda v: [int(x) for x in v.split(",")], default=[1000], metavar="B[,B]",
                        help="entries per STORE batch; several (64,1000: the service's targets) run one after another")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--engine", default="cpu", choices=("cpu", "reference", "gpu", "auto"))
    parser.add_argument("--repeats", type=int, default=3, help="runs per input form; the best counts")
    parser.add_argument("--no-memory", action="store_true", help="skip the (slower) memory pass")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--kv-events", action="store_true",
                        help="also the packed form with a vLLM KV-events publisher attached (side by side)")
    parser.add_argument("--kv-events-rate", type=float, default=100_000.0,
                        help="with --kv-events: also both at this offered load, entries/s (0: skip)")
    parser.add_argument("--access", action="store_true",
                        help="only the cost of ACCESS entries (per-key access counts) beside a STORE of the same keys")
    args = parser.parse_args(argv)
    if args.access:
        for batch in args.batch:
            result = access_cost(args.entries, batch, args.chunk_size, args.engine, repeats=args.repeats)
            print(json.dumps({"batch_entries": batch, **result}) if args.json else
                  "  ".join(f"{k} {v:.2f}" for k, v in result.items()) + f"  ({batch}-entry batches)")
        return 0
    lines = []
    for batch in args.batch:
        result = run(args.entries, batch, args.chunk_size, args.engine, repeats=args.repeats,
                     memory=not args.no_memory, kv_events=args.kv_events, kv_events_rate=args.kv_events_rate)
        if args.json:
            print(json.dumps(result))
            continue
        for k, v in result.items():
            print(f"{k:26s} {v:,.{3 if abs(v) < 100 else 1}f}" if isinstance(v, float) else f"{k:26s} {v}")
        lines.append(f"STORE ingest, {batch}-entry batches of {args.chunk_size} tokens, in process, one poster "
                     f"(no HTTP, no JSON text parsing; loadtest's 'events {batch}xP' rows measure those): "
                     f"{result['json_entries_per_s']:,.0f} entries/s from decoded JSON (token lists), "
                     f"{result['packed_entries_per_s']:,.0f} entries/s from packed uint32 token arrays")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
