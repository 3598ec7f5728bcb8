"""A Prometheus histogram whose ``observe`` is a list append.

Question answered: "why not prometheus-client's ``Histogram`` on the lookup path?" Its
``observe`` takes two locks and searches the buckets in Python: ~1.3-1.6 us with the GIL
held, four or five times per lookup (latency, queue wait, the two reuse series, the batch
series shared by a batch), about 5% of all GIL time under wrk's lookups (py-spy ``--gil``,
docs/performance.md, "Why the lookup lane"). :class:`FastHistogram` keeps the same series
(name, help, labels, buckets: ``_bucket``, ``_count`` and ``_sum`` samples, rendered by the
same registry) and costs ~0.1 us per observation: a value is appended to its series' pending
list, and pending values are folded into the bucket counts (one NumPy pass) when a scrape
collects them or when :data:`FOLD_AT` are pending, so memory stays bounded without scrapes.
Every observation is counted by the scrape that follows it. One difference: no ``_created``
sample (the series' start time), which nothing here reads.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Iterable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["FOLD_AT", "FastHistogram"]

#: Pending observations of one series that make the observer fold them.
FOLD_AT = 4096


class _Series:
    """One label set's buckets: pending values, then counts (non-cumulative) and sum."""

    __slots__ = ("_pending", "_bounds", "_counts", "_sum", "_lock")

    def __init__(self, bounds: np.ndarray) -> None:
        self._pending: list[float] = []
        self._bounds = bounds
        self._counts = np.zeros(bounds.shape[0], dtype=np.int64)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        pending = self._pending
        pending.append(value)  # atomic under the GIL: no lock on the hot path
        if len(pending) >= FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Move the pending values into the counts. Values appended meanwhile stay pending
        (taken by count, then deleted by count: both single C calls)."""
        with self._lock:
            pending = self._pending
            n = len(pending)
            if not n:
                return
            values = np.asarray(pending[:n], dtype=np.float64)
            del pending[:n]
            # bucket i holds the values v with bounds[i-1] < v <= bounds[i] (Prometheus' "le")
            self._counts += np.bincount(np.searchsorted(self._bounds, values, side="left"),
                                        minlength=self._bounds.shape[0])[:self._bounds.shape[0]]
            self._sum += float(values.sum())

    def snapshot(self) -> tuple[list[int], float]:
        """Cumulative bucket counts and the sum, pending values included."""
        self.fold()
        with self._lock:
            return np.cumsum(self._counts).tolist(), self._sum


class FastHistogram(Collector):
    """A histogram series family registered in ``registry`` (see the module docstring);
    ``labels(*values)`` returns a series with ``observe``, as prometheus-client's does."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = np.asarray(bounds, dtype=np.float64)
        self._le = [floatToGoString(b) for b in bounds]
        self._series: dict[tuple[str, ...], _Series] = {}
        self._lock = threading.Lock()
        self._plain = None if self._labelnames else self._child(())
        if self._plain is not None:
            self.observe = self._plain.observe  # type: ignore[method-assign] - one call less on the hot path
        registry.register(self)

    def _child(self, values: tuple[str, ...]) -> _Series:
        got = self._series.get(values)
        if got is None:
            with self._lock:
                got = self._series.setdefault(values, _Series(self._bounds))
        return got

    def labels(self, *values: Any) -> _Series:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected {len(self._labelnames)} label values, got {len(values)}")
        return self._child(tuple(str(v) for v in values))

    def observe(self, value: float) -> None:
        if self._plain is None:
            raise ValueError(f"{self._name} has labels: observe through labels(...)")
        self._plain.observe(value)

    def collect(self) -> Iterable[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        with self._lock:
            series = list(self._series.items())  # creation order, as prometheus-client lists them
        for values, s in series:
            cumulative, total = s.snapshot()
            family.add_metric(list(values), list(zip(self._le, cumulative)), total)
        yield family
