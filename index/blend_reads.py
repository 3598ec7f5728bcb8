"""The blend index's reads: the probe, the re-probe and token-exact verification.

A mixin of :class:`blend_index.BlendIndex` (which holds the state and the locks): the
methods run on the index itself, so a lookup batch pays no call layer beyond the old
single class. ``match_batch`` / ``match_flat``: one engine probe for the whole batch
(outside the lock) -> candidates -> under the write lock: fingerprint map lookup ->
namespace filter -> token-exact verification -> LMCache 0.5.6's per-position rule
(``verify.py``). A probe that raced a slot write (``_slot_writes`` odd or changed) runs
again, the last time with the lock held. Reads change nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from blendmatch.gpu import Candidates, QueryBatch
from blendmatch.gpu.engine import ProbeHandle, probe_async

from .tokens import as_tokens
from .types import BlendMatch, BlendNamespace, check_namespace
from .verify import NO_KEYS, MatchStats, hash_keys, per_position_rule

if TYPE_CHECKING:
    from .blend_index import BlendIndex

__all__ = ["IndexReads", "PendingMatch"]


class IndexReads:
    """Lookups of :class:`blend_index.BlendIndex` (its state: see there)."""

    def match(self, tokens: Any, ns: BlendNamespace) -> list[BlendMatch]:
        """``match_batch([(tokens, ns)])[0]``."""
        return self.match_batch([(tokens, ns)])[0]

    def match_batch(self, queries: Sequence[tuple[Any, BlendNamespace]]) -> list[list[BlendMatch]]:
        """Matches for each query, in order: ascending ``cur_st``, at most one per position and
        one per chunk hash (the per-position rule of the module docstring)."""
        return self.match_batch_detailed(queries)[0]

    def match_batch_detailed(self, queries: Sequence[tuple[Any, BlendNamespace]]
                             ) -> tuple[list[list[BlendMatch]], MatchStats]:
        """``match_batch`` plus what it cost (windows, survivors, rejections, timings)."""
        arrays = []
        namespaces = []
        for i, item in enumerate(queries):
            try:
                tokens, ns = item
            except (TypeError, ValueError):
                raise ValueError(f"query {i}: expected a (tokens, BlendNamespace) pair") from None
            arrays.append(as_tokens(tokens, name=f"query {i} tokens"))
            check_namespace(ns)
            namespaces.append(ns)
        if not arrays:
            return [], MatchStats()
        return self._match(QueryBatch.from_queries(arrays, self.chunk_size, self.probe_stride), namespaces)

    def match_flat(self, tokens: np.ndarray, offsets: np.ndarray, namespaces: Sequence[BlendNamespace]
                   ) -> tuple[list[list[BlendMatch]], MatchStats]:
        """:meth:`match_batch_detailed` of queries already back to back in one uint32 buffer:
        query ``q`` is ``tokens[offsets[q]:offsets[q+1]]`` (``tokens.decode_query_tokens``
        builds them). The engine probes the buffer as it is: no copy."""
        for i, ns in enumerate(namespaces):
            check_namespace(ns)
        if len(namespaces) != offsets.shape[0] - 1:
            raise ValueError(f"{len(namespaces)} namespaces for {offsets.shape[0] - 1} queries")
        if not namespaces:
            return [], MatchStats()
        return self._match(QueryBatch(tokens, offsets, self.chunk_size, self.probe_stride), list(namespaces))

    @property
    def pipelined(self) -> bool:
        """Whether :meth:`match_flat_async` overlaps batches (the engine is a device pipeline):
        only then does a caller gain by submitting the next batch before collecting one."""
        return self._failover.pipelined

    def lend_tokens(self, num_queries: int, num_tokens: int) -> np.ndarray | None:
        """Where to decode the next batch's tokens so the engine uploads them without a host
        copy (``CupyEngine.lend_tokens``: its pinned staging area), or None. For
        ``tokens.decode_query_tokens(..., out=index.lend_tokens)``."""
        return self._failover.lend_tokens(num_queries, num_tokens)

    def match_flat_async(self, tokens: np.ndarray, offsets: np.ndarray, namespaces: Sequence[BlendNamespace]
                         ) -> "PendingMatch":
        """:meth:`match_flat` in two steps: this submits the probe (on a device engine it runs
        while the caller prepares the next batch); ``result()`` of what it returns waits for
        it, verifies and returns what :meth:`match_flat` returns. Bad input raises here."""
        for ns in namespaces:
            check_namespace(ns)
        if len(namespaces) != offsets.shape[0] - 1:
            raise ValueError(f"{len(namespaces)} namespaces for {offsets.shape[0] - 1} queries")
        batch = QueryBatch(tokens, offsets, self.chunk_size, self.probe_stride)
        if not namespaces:
            return PendingMatch(self, batch, [], None)
        t0 = time.perf_counter()
        seen = self._slot_writes
        return PendingMatch(self, batch, list(namespaces), (seen, probe_async(self._failover, batch, self._slots), t0))

    def _match(self, batch: QueryBatch, namespaces: list[BlendNamespace],
               first: tuple[int, ProbeHandle, float] | None = None) -> tuple[list[list[BlendMatch]], MatchStats]:
        """Probe outside the lock, verify under it: one state of the index, so writes held
        under :attr:`write_lock` together are seen all or none. A probe that raced slot
        writes (``_slot_writes`` changed, or odd: one in progress) may have missed new
        slots: it runs again (``reprobes``), the last time with the lock held. ``first``:
        the first probe already submitted (``(slot writes seen, handle, start)``)."""
        stats = MatchStats(queries=batch.num_queries, tokens=batch.num_tokens)
        results: list[list[BlendMatch]] = [[] for _ in namespaces]
        t0 = time.perf_counter() if first is None else first[2]
        found = None
        for attempt in range(self.PROBE_TRIES + 1):
            last = attempt == self.PROBE_TRIES
            if last:
                self._lock.acquire()  # writers held off: the probe and verification see one state
            try:
                if attempt == 0 and first is not None:
                    seen, cands = first[0], first[1].result()
                else:
                    seen = self._slot_writes
                    cands = self._probe(batch)
                t1 = time.perf_counter()
                with self._lock:
                    if last or (seen == self._slot_writes and not seen & 1):
                        if len(cands):
                            found = self._verify_locked(batch, cands, namespaces, stats)
                        break
            finally:
                if last:
                    self._lock.release()
            stats.reprobes += 1
        stats.engine_s = t1 - t0
        stats.engine_name = self.engine.name
        stats.engine_timings = dict(cands.timings)
        stats.windows = cands.windows
        stats.survivors = len(cands)
        if found is not None:
            make = tuple.__new__  # BlendMatch(h, old, st) without the NamedTuple's Python __new__
            for q, st, h, old in zip(*found):
                results[q].append(make(BlendMatch, (h, old, st)))
        stats.verify_s = time.perf_counter() - t1
        return results, stats

    #: Probes of one ``match`` outside the lock before one under it (see ``_match``).
    PROBE_TRIES = 2

    # ------------------------------------------------------------------ internals: reads
    def _probe(self, batch: QueryBatch) -> Candidates:
        return self._failover.probe(batch, self._slots)

    def _verify_locked(self, batch: QueryBatch, cands: Candidates, namespaces: list[BlendNamespace],
                       stats: MatchStats) -> tuple[list[int], list[int], list[bytes], list[int]]:
        """Verification and the per-position rule (``verify.per_position_rule``), lock held:
        time and memory linear in candidates plus occupants. Per match: its query, position,
        chunk hash and stored offset, as columns. Its kernels keep the GIL (a release inside
        the hold kept the lock held for a turn of the event loop)."""
        q_ns = np.fromiter((self._ns.get(ns) for ns in namespaces), dtype=np.int64, count=len(namespaces))
        rows = self._fpmap.lookup_in_hold(cands.fingerprint)
        args = (cands.query_index, cands.cur_st, rows, q_ns, batch.tokens, batch.offsets, self.chunk_size,
                self._tokens.blocks, self._tokens.shift, self._tokens.mask, self._c["occ"], self._o["next"],
                self._o["claim"], self._k["ns"], self._k["next"])
        ci, oi, misses, ns_skip, rejects, steps = per_position_rule(*args, NO_KEYS, False)
        hashes = list(map(self._o_hash.__getitem__, oi.tolist()))
        qidx = cands.query_index[ci].tolist()
        if len(set(zip(qidx, hashes))) != len(hashes):
            # One chunk hash occupies two contents (possible through this class's API, never
            # through the directory's): "taken" must go by hash, not by occupant.
            keys = hash_keys(rows, self._c["occ"], self._o["next"], self._o_hash)
            ci, oi, misses, ns_skip, rejects, steps = per_position_rule(*args, keys, True)
            hashes = list(map(self._o_hash.__getitem__, oi.tolist()))
            qidx = cands.query_index[ci].tolist()
        stats.dict_misses, stats.ns_filtered, stats.token_rejections = int(misses), int(ns_skip), int(rejects)
        stats.occupant_steps = int(steps)
        stats.matches = len(hashes)
        return qidx, cands.cur_st[ci].tolist(), hashes, self._o["offset"][oi].tolist()



class PendingMatch:
    """A batch submitted by :meth:`BlendIndex.match_flat_async`; ``result()`` waits for its
    probe, verifies it and returns ``(results, stats)`` as :meth:`BlendIndex.match_flat`."""

    def __init__(self, index: BlendIndex, batch: QueryBatch, namespaces: list[BlendNamespace],
                 first: tuple[int, ProbeHandle, float] | None) -> None:
        self.index, self.batch, self.namespaces, self._first = index, batch, namespaces, first

    def result(self) -> tuple[list[list[BlendMatch]], MatchStats]:
        if not self.namespaces:
            return [], MatchStats()
        return self.index._match(self.batch, self.namespaces, self._first)