"""Shared helpers of the service tests: an in-process app + client, and event builders."""

from __future__ import annotations

import base64
import contextlib
from typing import Any, AsyncIterator, Sequence

import httpx
import numpy as np

from blendmatch.index.wire_models import wire_batch, wire_entry
from blendmatch.index.types import pack_kv_rank
from blendmatch.service.app import create_app
from blendmatch.service.config import ServiceConfig

#: Small chunks keep payloads small; the service does not care about the size.
C = 16
MODEL = "llama"


def config(**overrides: Any) -> ServiceConfig:
    base: dict[str, Any] = {"chunk_size": C, "engine": "cpu", "host": "127.0.0.1"}
    base.update(overrides)
    return ServiceConfig(**base)


@contextlib.asynccontextmanager
async def served(cfg: ServiceConfig | None = None, **kw: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """``(client, app)`` for an app running in-process (lifespan included)."""
    app = create_app(cfg or config(), **kw)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, app


def b64(tokens: Any) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<u4").tobytes()).decode()


def chunks(n: int, seed: int = 0, c: int = C) -> np.ndarray:
    """``n`` distinct random chunks of ``c`` tokens (ids < 50,000)."""
    return np.random.default_rng(seed).integers(0, 50_000, size=(n, c), dtype=np.uint32)


def store(instance: str, seq: int, rows: np.ndarray, *, first_hash: int = 0, model: str = MODEL,
          world_size: int = 1, salt: str = "", offsets: Sequence[int] | None = None,
          incarnation: int = 0, **batch_kw: Any) -> dict[str, Any]:
    """One STORE batch of ``rows``; chunk ``i`` gets hash ``hash_of(first_hash + i)`` and
    offset ``offsets[i]`` (default ``i * C``)."""
    entries = [wire_entry(hash_of(first_hash + i), model, pack_kv_rank(world_size), cache_salt=salt,
                          size_bytes=1024, token_ids=row.tolist(),
                          token_offset=(offsets[i] if offsets is not None else i * rows.shape[1]))
               for i, row in enumerate(rows)]
    return wire_batch(instance, seq, "store", entries, incarnation=incarnation, **batch_kw)


def hash_of(i: int) -> bytes:
    return b"\xab" + i.to_bytes(8, "big")


def events(*batches: dict[str, Any]) -> dict[str, Any]:
    return {"batches": list(batches)}


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text -> ``{'name{k="v",...}': value}`` (labels sorted; no braces when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
