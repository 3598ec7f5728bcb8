"""What crosses the engine boundary: a batch of queries in, candidate windows out.

Engines see arrays only (no namespaces, no chunk hashes): ``QueryBatch`` is every query's
tokens concatenated into one uint32 array with ``offsets`` (query ``i`` is
``tokens[offsets[i]:offsets[i+1]]``), plus the window length and the probe stride.

A window is *valid* iff it lies inside one query and its start is a multiple of ``stride``
from that query's start; engines probe exactly the valid windows. ``Candidates`` are the
windows that survived the slot-array probe, as ``(query_index, cur_st, fingerprint)`` with
``cur_st`` relative to the query's start, in ascending ``(query_index, cur_st)`` order.
Every engine returns bit-identical candidates for the same batch and slot table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["QueryBatch", "Candidates", "count_windows"]


@dataclass(frozen=True)
class QueryBatch:
    """Concatenated query tokens. Build with :meth:`from_queries`; arrays are read-only."""

    tokens: np.ndarray  # uint32, all queries back to back
    offsets: np.ndarray  # int64, len = num_queries + 1, offsets[0] == 0
    window: int  # chunk size C
    stride: int = 1

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if self.tokens.dtype != np.uint32 or self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D uint32, got {self.tokens.dtype} {self.tokens.shape}")
        if self.offsets.dtype != np.int64 or self.offsets.ndim != 1 or self.offsets.size < 1:
            raise ValueError("offsets must be a non-empty 1-D int64 array")
        offsets = self.offsets
        if offsets[0] != 0 or offsets[-1] != self.tokens.size or (offsets[1:] < offsets[:-1]).any():
            raise ValueError("offsets must start at 0, end at len(tokens) and never decrease")

    @classmethod
    def from_queries(cls, queries: Sequence[np.ndarray], window: int, stride: int = 1) -> "QueryBatch":
        """Concatenate uint32 query arrays (already validated by the caller)."""
        lengths = np.fromiter((q.shape[0] for q in queries), dtype=np.int64, count=len(queries))
        offsets = np.zeros(len(queries) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(queries).astype(np.uint32, copy=False) if queries else np.zeros(0, np.uint32)
        tokens.setflags(write=False)
        offsets.setflags(write=False)
        return cls(tokens, offsets, window, stride)

    @property
    def num_queries(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def num_windows(self) -> int:
        """How many valid windows the batch holds (what an engine probes)."""
        return count_windows(self.offsets, self.window, self.stride)


def count_windows(offsets: np.ndarray, window: int, stride: int) -> int:
    """Number of valid windows: per query ``ceil((len - C + 1) / stride)`` when len >= C."""
    lengths = np.diff(offsets)
    span = lengths - window + 1
    return int(np.sum(np.where(span > 0, (span + stride - 1) // stride, 0)))


@dataclass(frozen=True)
class Candidates:
    """Windows that survived the probe, ascending by ``(query_index, cur_st)``."""

    query_index: np.ndarray  # int64
    cur_st: np.ndarray  # int64, relative to the query's start
    fingerprint: np.ndarray  # uint64
    windows: int = 0  # valid windows probed (for survivor-rate metrics)
    timings: dict[str, float] = field(default_factory=dict)  # engine-specific phase seconds

    @classmethod
    def empty(cls, windows: int = 0) -> "Candidates":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), np.zeros(0, dtype=np.uint64), windows)

    def __len__(self) -> int:
        return int(self.query_index.size)

    def same_as(self, other: "Candidates") -> bool:
        """Bit-identical candidates (what the conformance suite asserts across engines)."""
        return (
            np.array_equal(self.query_index, other.query_index)
            and np.array_equal(self.cur_st, other.cur_st)
            and np.array_equal(self.fingerprint, other.fingerprint)
        )
