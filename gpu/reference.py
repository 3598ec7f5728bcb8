"""The reference engine: numpy, written for clarity, the oracle of the conformance suite.

It enumerates the valid windows of each query explicitly, fingerprints each with the chunk
form of THE hash (``fingerprint.chunk_fingerprints``' numpy twin: multiply by the powers and
sum), and probes the slot table with the survival rule. Slow, obviously correct.
"""

from __future__ import annotations

import numpy as np

from .fingerprint import TAG_SHARED, base_powers, slots_and_tags

from .batch import Candidates, QueryBatch
from .engine import ReadyProbe, SlotSource

__all__ = ["ReferenceEngine"]

_BLOCK = 2048  # windows fingerprinted per numpy step (bounds memory to BLOCK * C * 8 bytes)


class ReferenceEngine:
    name = "reference"

    def __init__(self, reason: str = "") -> None:
        self.reason = reason

    def probe(self, batch: QueryBatch, slots: SlotSource) -> Candidates:
        table = slots.table
        mask = table.shape[0] - 1
        c, s = batch.window, batch.stride
        pows = base_powers(c)
        qi_out, st_out, fp_out = [], [], []
        windows = 0
        for qi in range(batch.num_queries):
            q = batch.tokens[batch.offsets[qi]:batch.offsets[qi + 1]].astype(np.uint64)
            starts = np.arange(0, q.size - c + 1, s, dtype=np.int64)
            windows += starts.size
            for b in range(0, starts.size, _BLOCK):
                st = starts[b:b + _BLOCK]
                win = q[st[:, None] + np.arange(c)]  # (n, C) explicit windows
                with np.errstate(over="ignore"):
                    fps = (win * pows).sum(axis=1, dtype=np.uint64)
                slot, tag = slots_and_tags(fps, mask)
                val = table[slot]
                keep = (val == tag) | (val == TAG_SHARED)
                qi_out.append(np.full(int(keep.sum()), qi, dtype=np.int64))
                st_out.append(st[keep])
                fp_out.append(fps[keep])
        if not qi_out:
            return Candidates.empty(windows)
        return Candidates(np.concatenate(qi_out), np.concatenate(st_out), np.concatenate(fp_out), windows)

    #: no device pipeline: :meth:`probe_async` answers at submit
    pipelined = False

    def probe_async(self, batch: QueryBatch, slots: SlotSource) -> ReadyProbe:
        """The pipelined API (``gpu/engine.py``) on the host: the batch is answered now."""
        return ReadyProbe(self.probe(batch, slots))

    def close(self) -> None:
        pass
