"""Compile every JIT kernel the service runs before it says ready (and ``blendmatch warmup``).

Question answered: "will the first STORE or lookup after ``/readyz`` says ready pay a
numba compilation?" It must not: a cold compile of the STORE parser alone took 13-22 s,
and LMCache's HTTP event sink gives up after 2 s and logs the batches as lost.

How: rather than a hand-kept list of kernels and signatures (which drifts as kernels are
added, and misses a specialization such as a read-only array), :func:`compile_everything`
drives a private scratch service through the real code paths once, with small realistic
requests, in-process over ASGI: a STORE of one 256-token LMCache entry (the body LMCache
sends: the split parser of ``index/_jsonentries.py``), a body that parser gives up on (the
``token_ids`` split of ``index/_jsontok.py``), a body large enough to be split on the
prepare thread, a DELETE, then blend lookups in both token forms, singly and batched,
``/directory/lookup`` in both forms and ``/route/score``. The scratch service has its own
directory with the real one's chunk size, stride and filter, on a CPU engine of its own
(the numba kernels are the CPU engine's and the index's; the GPU engine compiles its own
kernels when it is built, and the CPU engine is its documented failover), so the real
index, its engine, its metrics and its checkpoint see nothing; the real index then runs
its own :meth:`BlendIndex.warm_up` on its lookup thread (page-in). The CPU engine's
parallel probe (taken only by batches of 2^18 windows or more) and the vLLM KV-events
encoder (``--kv-events-endpoint``) are compiled too.

``tests/test_warmup.py`` holds this to its promise: after a warm-up, every numba
dispatcher in the package's modules has a compiled signature.

Numba loads what an earlier run compiled from the compile cache (``blendmatch.compile_cache``),
so a warm start costs about a second here and a cold one tens of seconds. The service
runs this in the background after the port opened: ``/readyz`` answers 503
``compiling``, and lookups and event posts 503 with ``Retry-After`` (``context.py``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from blendmatch.compile_cache import current as compile_cache

from blendmatch.index.tokens import SPLIT_MIN_BYTES

from .config import ServiceConfig

__all__ = ["WarmupReport", "compile_everything", "store_body", "WarmupFailed"]

log = logging.getLogger("blendmatch.service.warmup")

Progress = Callable[[str], None]

_MODEL = "blendmatch/warm-up"
_INSTANCE = "blendmatch-warm-up"
#: Entries of the big body: over ``PREPARE_MIN_BYTES`` (split on the prepare thread) and
#: over 3/4 of the fingerprint map's first 1,024 slots (its growth, ``index/storage.py``).
_BIG_ENTRIES = 800


class WarmupFailed(RuntimeError):
    """A warm-up request got an answer other than the one expected (a bug: the same request
    would fail for a client)."""


@dataclass
class WarmupReport:
    """What :func:`compile_everything` did: ``seconds`` in all, per step, and the cache."""

    seconds: float = 0.0
    steps: list[tuple[str, float]] = field(default_factory=list)
    cache: str = ""


def _key(i: int, world_size: int = 1) -> dict[str, Any]:
    return {"chunk_hash_hex": f"{i:064x}", "model_name": _MODEL, "kv_rank": world_size << 24,
            "object_group_id": 0, "cache_salt": ""}


def store_body(tokens: np.ndarray, *, seq: int = 1, first_hash: int = 1, chunk_size: int = 256,
               instance_id: str = _INSTANCE, model_name: str = _MODEL, event_type: str = "store") -> bytes:
    """An LMCache 0.5.6 ``POST /events`` body (what ``HttpCacheEventSink`` posts): one batch
    of one ``store`` (or ``delete``) event whose entries are the ``chunk_size``-token chunks
    of ``tokens``, each keyed by its own hash (world size 1) at its offset."""
    rows = np.asarray(tokens, dtype=np.uint32).reshape(-1, chunk_size)
    entries = []
    for i, row in enumerate(rows):
        key = {**_key(first_hash + i), "model_name": model_name}
        entries.append({"key": key, "size_bytes": 2 << 20, "token_ids": row.tolist(),
                        "token_offset": i * chunk_size})
    batch = {"instance_id": instance_id, "incarnation": 1, "seq": seq, "event_type": event_type, "tier": "l1",
             "backend": "dram", "entries": entries, "shared": False, "ts": 1767225600.0, "capacity_bytes": 0,
             "capacity_revision": 0}
    return json.dumps({"batches": [batch]}, separators=(",", ":")).encode()


#: The settings the scratch service takes from the real one: those that shape the index and
#: the paths the kernels run on. Everything else is the default: nothing that reaches outside
#: the process or its state (checkpoint, broker, sockets, upstream), and the default request
#: limits (a small ``--max-request-tokens`` must not refuse the warm-up's own requests).
_CARRIED = ("chunk_size", "blend_probe_stride", "hash_algorithm", "engine_threads", "max_batch_tokens",
            "max_batch_wait_ms", "kv_events_encoding", "kv_events_int_hashes")


def _scratch_config(config: ServiceConfig) -> ServiceConfig:
    """The scratch service's settings (see :data:`_CARRIED`)."""
    return ServiceConfig(host="127.0.0.1", health_check_interval=0.0,
                         **{name: getattr(config, name) for name in _CARRIED})


def _scratch_directory(config: ServiceConfig, filter_mode: Optional[str]) -> Any:
    from blendmatch.gpu.cpu import CpuEngine
    from blendmatch.index.key_directory import KeyDirectory

    directory = KeyDirectory()
    kwargs = {} if filter_mode is None else {"filter": filter_mode}
    directory.enable_blend_lookup(chunk_size=config.chunk_size, probe_stride=config.blend_probe_stride,
                                  engine=CpuEngine("the warm-up's scratch service"), **kwargs)
    return directory


async def _post(client: Any, path: str, expect: Callable[[Any], bool], **kwargs: Any) -> Any:
    resp = await client.post(path, **kwargs)
    body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else resp.text
    if resp.status_code != 200 or not expect(body):
        raise WarmupFailed(f"warm-up: POST {path} answered {resp.status_code}: {str(body)[:300]}")
    return body


def _found(body: Any) -> bool:
    return bool(body.get("matches"))


async def _drive(config: ServiceConfig, filter_mode: Optional[str], step: Callable[[str], None]) -> None:
    """The scratch service through every path that compiles something (module docstring)."""
    import httpx

    from .access import AccessPolicy
    from .app import create_app

    scratch = _scratch_config(config)
    c = scratch.chunk_size
    app = create_app(scratch, directory=_scratch_directory(scratch, filter_mode),
                     access=AccessPolicy.protected_mode())
    app.state.blendmatch_context.compile_mode = "off"  # it is what compiles
    rng = np.random.default_rng(45)
    # the fewest chunks whose body the split parser takes (one 256-token entry at the default
    # size); token ids of a 150k vocabulary, 6 digits each as in a real body
    sample = rng.integers(100_000, 150_000, size=c, dtype=np.uint32)
    k = next(k for k in range(1, SPLIT_MIN_BYTES + 1)
             if len(store_body(np.tile(sample, k), chunk_size=c)) >= SPLIT_MIN_BYTES)
    tokens = rng.integers(100_000, 150_000, size=2 * k * c, dtype=np.uint32)
    ns = {"model_name": _MODEL, "world_size": 1, "cache_salt": ""}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 45045))
        async with httpx.AsyncClient(transport=transport, base_url="http://warm-up", timeout=None) as client:
            step("numba's start-up and the scratch service")
            applied = lambda body: body.get("applied") == 1  # noqa: E731 - one expectation per call
            # 1. the STORE LMCache sends: one 256-token entry (the entries split parser)
            await _post(client, "/events", applied, content=store_body(tokens[:k * c], seq=1, chunk_size=c),
                        headers={"content-type": "application/json"})
            # 2. a body the entries split gives up on (an escaped character): the token_ids split
            escaped = store_body(tokens[k * c:2 * k * c], seq=2, first_hash=k + 1, chunk_size=c).replace(
                b'"backend":"dram"', b'"backend":"dr\\u0061m"')
            await _post(client, "/events", applied, content=escaped, headers={"content-type": "application/json"})
            # 3. a body split on the prepare thread, growing the index's tables
            big = rng.integers(100_000, 150_000, size=_BIG_ENTRIES * c, dtype=np.uint32)
            await _post(client, "/events", applied,
                        content=store_body(big, seq=3, first_hash=2 * k + 1, chunk_size=c),
                        headers={"content-type": "application/json"})
            step("STORE parsing and indexing")
            # 4. lookups, both token forms, one and batched, with and without placements; at
            # least 1,024 tokens, so that the token_ids lists are split by the parser too
            query = np.tile(tokens[:2 * k * c], -(-1024 // (2 * k * c)))
            ids = {**ns, "token_ids": query.tolist()}
            b64 = {**ns, "tokens_b64": base64.b64encode(query.astype("<u4").tobytes()).decode()}
            for body in (ids, b64):
                await _post(client, "/directory/blend-lookup", _found, json=body)
            # no instance is registered (nothing to log): the placements path drops every match
            await _post(client, "/directory/blend-lookup", lambda b: "matches" in b,
                        json={**ids, "include_placements": True})
            await _post(client, "/directory/blend-lookup/batch", lambda b: all(r.get("matches") for r in b["results"]),
                        json={"queries": [ids, b64]})
            await _post(client, "/route/score", lambda b: isinstance(b, dict), json=ids)
            await _post(client, "/directory/lookup", lambda b: isinstance(b, dict),
                        json={"token_ids": query.tolist(), "model_name": _MODEL})
            await _post(client, "/directory/lookup", lambda b: isinstance(b, dict), json={"keys": [_key(1)]})
            step("lookups")
            # 5. removals: a DELETE of the first entry
            await _post(client, "/events", applied,
                        content=store_body(tokens[:k * c], seq=4, chunk_size=c, event_type="delete"),
                        headers={"content-type": "application/json"})
            step("DELETE")


#: Compiled code stays for the process's life: one warm-up per process is enough (numba
#: specializes on types, never on the chunk size or stride). Later calls wait for the
#: first and return at once.
_once = threading.Lock()
_done: list[WarmupReport] = []


def _not_ours(record: logging.LogRecord) -> bool:
    """httpx logs every request at INFO: the scratch service's stay out of the server's log."""
    return "http://warm-up/" not in str(record.args)


def compile_everything(config: ServiceConfig, *, filter_mode: Optional[str] = None,
                       progress: Optional[Progress] = None) -> WarmupReport:
    """Compile (or load from the compile cache) every kernel the service with ``config``
    runs; see the module docstring. ``filter_mode``: the real index's slot filter (None:
    the default). Runs its own event
    loop: call it from a thread that has none (the service runs it on an executor thread,
    so that the server's loop keeps answering ``/healthz`` and ``/readyz``). Raises
    :class:`WarmupFailed` when a path answers differently than it would a client."""
    with _once:
        if _done:
            return WarmupReport(cache=_done[0].cache, steps=[("already compiled in this process", 0.0)])
        report = _compile(config, filter_mode, progress)
        _done.append(report)
        return report


def _compile(config: ServiceConfig, filter_mode: Optional[str], progress: Optional[Progress]
             ) -> WarmupReport:
    report = WarmupReport(cache=compile_cache().describe())
    t0 = last = time.perf_counter()

    def step(what: str) -> None:
        nonlocal last
        now = time.perf_counter()
        report.steps.append((what, now - last))
        if progress is not None:
            progress(f"{what}: {now - last:.1f} s")
        last = now

    httpx_log = logging.getLogger("httpx")
    httpx_log.addFilter(_not_ours)
    try:
        asyncio.run(_drive(config, filter_mode, step))  # with blend lookup off too: the parser
    finally:
        httpx_log.removeFilter(_not_ours)
    # The CPU engine's parallel probe, which only a batch of PARALLEL_MIN_WINDOWS (2^18)
    # windows or more takes: here forced on a tiny batch (and the serial one once more).
    from blendmatch.gpu.cpu import CpuEngine
    from blendmatch.index.blend_index import BlendIndex

    for cpu in (CpuEngine("warm-up"), CpuEngine("warm-up", item_windows=16, parallel_min_windows=0)):
        BlendIndex(config.chunk_size, config.blend_probe_stride, cpu).warm_up()
    step("the CPU engine's serial and parallel probes")
    from .publish.wire import EventEncoder  # --kv-events-endpoint's (no pyzmq needed to encode)

    EventEncoder(config.kv_events_encoding, config.kv_events_int_hashes).warm_up()
    step("the KV-events encoder")
    report.seconds = time.perf_counter() - t0
    return report
