"""Reuse metrics: how much of the lookup traffic is reusable, and how much only as fragments.

Question answered: "how much of my traffic is reusable, and how much of it is non-prefix?"
Per blend lookup (single, batch, with or without placements; not the routing
score, which a router sends for requests the engine also looks up), on the lookup thread:

- ``prefix``: the leading full chunks whose prefix-chained hashes (the fleet's token hasher)
  the namespace holds anywhere in the directory, counted while the lookup's non-overlapping
  matches cover them from position 0 (a chunk stored without its tokens is invisible to blend
  lookups, so to these metrics too). Hashing only runs over that leading run: a lookup whose
  first chunk is not matched costs no hash;
- ``non_prefix``: the tokens after that prefix covered by non-overlapping matches
  (``route_score.reuse_split``: the routing score's rule with every holder counted).

Series (labelled by model, never by salt: a salt is a tenant's secret and unbounded; at most
:data:`MAX_MODELS` model labels, later models count under :data:`OTHER_MODEL`):
``blendmatch_reuse_query_tokens_total{model}``, ``blendmatch_reuse_tokens_total{model,kind}``
and the per-lookup histogram ``blendmatch_reuse_tokens_per_lookup{model,kind}``
(``kind``: ``prefix`` | ``non_prefix``). The same totals appear under ``blendmatch.reuse`` in
``GET /directory/stats``. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.placement_rank import resolve_overlaps
from blendmatch.index.route_score import leading_held, reuse_split
from blendmatch.index.token_hasher import TokenHasher
from blendmatch.index.types import BlendMatch, BlendNamespace

from .fast_histogram import FastHistogram

__all__ = ["KINDS", "MAX_MODELS", "OTHER_MODEL", "ReuseMetrics"]

log = logging.getLogger(__name__)

#: Distinct model labels kept; a model name is client input, so the label set is bounded.
MAX_MODELS = 64
#: The label past :data:`MAX_MODELS` models.
OTHER_MODEL = "__other__"
KINDS = ("prefix", "non_prefix")
_TOKEN_BUCKETS = (0.0,) + tuple(float(1 << i) for i in range(8, 21))  # 0, 256 .. 1M tokens

#: Chained hashes remembered at most (each entry keeps its chunk's tokens: 1 KiB at 256
#: tokens, so about 4 MiB); past it the memo starts over.
CHAIN_MEMO_MAX = 4096

#: One observed lookup: its namespace, its tokens, the matches it was answered.
Observed = tuple[BlendNamespace, np.ndarray, Sequence[BlendMatch]]


class ReuseMetrics:
    """The reuse series and totals of one app (module docstring)."""

    def __init__(self, registry: CollectorRegistry, directory: KeyDirectory, hasher: TokenHasher
                 ) -> None:
        self._directory = directory
        self._hasher = hasher
        self._lock = threading.Lock()
        self._totals: dict[str, list[int]] = {}  # model -> [lookups, query_tokens, prefix, non_prefix]
        self._series: dict[str, tuple[Any, ...]] = {}  # model label -> its resolved children
        self._failed = False
        #: (previous chained hash or None, the match's chunk hash) -> (the chunk's tokens as
        #: bytes, its chained hash): recurring prefixes (system prompts) are hashed once.
        self._chain: dict[tuple[bytes | None, bytes], tuple[bytes, bytes]] = {}
        self.query_tokens = Counter("blendmatch_reuse_query_tokens", "tokens of the blend lookups observed",
                                    ["model"], registry=registry)
        self.tokens = Counter("blendmatch_reuse_tokens", "lookup tokens covered by non-overlapping matches, "
                              "prefix (a prefix cache holds them) or non_prefix (fragments)",
                              ["model", "kind"], registry=registry)
        self.per_lookup = FastHistogram("blendmatch_reuse_tokens_per_lookup", "covered tokens per lookup, by kind",
                                    ["model", "kind"], buckets=_TOKEN_BUCKETS, registry=registry)

    def _label(self, model: str) -> str:
        """The model's label (call with the lock held)."""
        if model in self._totals or len(self._totals) < MAX_MODELS:
            return model
        return OTHER_MODEL

    def prefix_chunks(self, ns: BlendNamespace, tokens: np.ndarray, resolved: Sequence[BlendMatch]) -> int:
        """Leading chunks the namespace holds under the request's chained hashes, within the
        matches' leading run from position 0 (module docstring)."""
        c = self._hasher.chunk_size
        run = 0
        for m in resolved:
            if m.cur_st != run * c:
                break
            run += 1
        if run == 0:
            return 0
        return leading_held(self._directory.namespace_holds(self._chained(tokens, resolved[:run]), ns))

    def _chained(self, tokens: np.ndarray, run: Sequence[BlendMatch]) -> list[bytes]:
        """The request's chained hashes of the chunks under ``run`` (the matches at 0, C, ...),
        as :meth:`TokenHasher.hash_chunk` gives them, remembered per (previous hash, matched
        chunk hash) with the chunk's tokens: a remembered hash is used only for the very same
        tokens, so the memo is exact (a chunk hash whose content changed is hashed again)."""
        c = self._hasher.chunk_size
        memo = self._chain
        prev: bytes | None = None
        out: list[bytes] = []
        for j, m in enumerate(run):
            window = tokens[j * c:(j + 1) * c]
            raw = window.tobytes()
            key = (prev, m.chunk_hash)
            got = memo.get(key)
            if got is None or got[0] != raw:
                if len(memo) >= CHAIN_MEMO_MAX:
                    memo.clear()
                got = memo[key] = (raw, self._hasher.hash_chunk(window, prev))
            prev = got[1]
            out.append(prev)
        return out

    def observe(self, lookups: Sequence[Observed]) -> None:
        """Count a batch of answered lookups (on the lookup thread, after their answers are
        built: a thread of its own measured slower, the GIL handing over on the answers'
        path). Never raises into the batch: a failure is logged once and that batch
        uncounted."""
        try:
            self._observe(lookups)
        except Exception:  # noqa: BLE001 - a metric must not fail the lookups it measures
            if not self._failed:
                self._failed = True
                log.exception("reuse metrics: a batch could not be counted (logged once)")

    def _observe(self, lookups: Sequence[Observed]) -> None:
        c = self._hasher.chunk_size
        rows = []
        for ns, tokens, matches in lookups:
            resolved = resolve_overlaps(matches, c) if matches else []
            try:
                chunks = self.prefix_chunks(ns, tokens, resolved) if resolved else 0
            except ValueError:
                chunks = 0
            prefix, rest = reuse_split(resolved, chunks, c, resolved=True)
            rows.append((ns.model_name, int(tokens.shape[0]), prefix, rest))
        with self._lock:
            labelled = []
            for model, n, prefix, rest in rows:
                label = self._label(model)
                t = self._totals.setdefault(label, [0, 0, 0, 0])
                t[0] += 1
                t[1] += n
                t[2] += prefix
                t[3] += rest
                labelled.append((label, n, prefix, rest))
        sums: dict[str, list[int]] = {}
        for label, n, prefix, rest in labelled:
            s = sums.setdefault(label, [0, 0, 0])
            s[0] += n
            s[1] += prefix
            s[2] += rest
            hist = self._children(label)[3:]
            hist[0].observe(prefix)
            hist[1].observe(rest)
        for label, (n, prefix, rest) in sums.items():  # counters once per model and batch
            queried, prefix_c, rest_c = self._children(label)[:3]
            queried.inc(n)
            prefix_c.inc(prefix)
            rest_c.inc(rest)

    def _children(self, label: str) -> tuple[Any, ...]:
        """The label's series (``labels()`` takes a lock and a dict lookup per call: resolved
        once per model; the label set is bounded by :data:`MAX_MODELS`)."""
        got = self._series.get(label)
        if got is None:
            got = self._series[label] = (
                self.query_tokens.labels(label), *(self.tokens.labels(label, k) for k in KINDS),
                *(self.per_lookup.labels(label, k) for k in KINDS))
        return got

    def stats(self) -> dict[str, Any]:
        """``GET /directory/stats`` ``blendmatch.reuse``: totals, and the same per model."""
        with self._lock:
            by_model = {m: {"lookups": t[0], "query_tokens": t[1], "prefix_tokens": t[2], "non_prefix_tokens": t[3]}
                        for m, t in sorted(self._totals.items())}
        total = {k: sum(row[k] for row in by_model.values())
                 for k in ("lookups", "query_tokens", "prefix_tokens", "non_prefix_tokens")}
        return {**total, "by_model": by_model}
