"""``service/fast_histogram.py``: the same exposition as prometheus-client's ``Histogram`` for
the same observations (the oracle), every observation counted by the next scrape even while
other threads observe, and pending values folded without a scrape (bounded memory)."""

from __future__ import annotations

import random
import sys
import threading

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from blendmatch.service import fast_histogram
from blendmatch.service.fast_histogram import FastHistogram

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def _lines(registry: CollectorRegistry) -> list:
    """The exposition without ``_created`` samples (FastHistogram has none) and comments;
    sums as rounded floats (ours adds a fold's values pairwise, theirs one by one)."""
    out: list = []
    for ln in generate_latest(registry).decode().splitlines():
        if not ln or ln.startswith("#") or "_created" in ln:
            continue
        name, value = ln.rsplit(" ", 1)
        out.append((name, float(f"{float(value):.12g}")) if "_sum" in name else ln)
    return out


@pytest.mark.parametrize("labelled", [False, True])
def test_exposition_equals_prometheus_clients_histogram(labelled: bool) -> None:
    rng = random.Random(7)
    values = [rng.choice([0.0, 0.0001, 0.00010000001, 0.001, 10.0, 11.0, 1e9, -1.0, rng.random()])
              for _ in range(500)] + [rng.expovariate(200) for _ in range(3000)]
    ours_r, theirs_r = CollectorRegistry(), CollectorRegistry()
    names = ["endpoint", "kind"] if labelled else []
    ours = FastHistogram("x_seconds", "doc", names, buckets=BUCKETS, registry=ours_r)
    theirs = Histogram("x_seconds", "doc", names, buckets=BUCKETS, registry=theirs_r)
    for i, v in enumerate(values):
        if labelled:
            ours.labels("single" if i % 3 else "batch", i % 2).observe(v)
            theirs.labels("single" if i % 3 else "batch", i % 2).observe(v)
        else:
            ours.observe(v)
            theirs.observe(v)
    assert _lines(ours_r) == _lines(theirs_r)
    assert any("_bucket" in ln for ln in _lines(ours_r))
    for h in (ours, theirs):  # a second scrape sees what came since the first
        (h.labels("a", "b") if labelled else h).observe(0.5)
    assert _lines(ours_r) == _lines(theirs_r)


def test_every_observation_is_in_the_next_scrape_while_threads_observe(monkeypatch) -> None:
    monkeypatch.setattr(fast_histogram, "FOLD_AT", 5)  # observers fold all the time, beside the scrapes
    r = CollectorRegistry()
    h = FastHistogram("y", "doc", buckets=(1.0, 2.0), registry=r)
    per_thread, threads = 60_000, 4
    stop = threading.Event()
    scrapes: list[float] = []

    def scrape() -> None:
        while not stop.is_set():
            scrapes.append(_count(r))

    def observe() -> None:
        for i in range(per_thread):
            h.observe(i % 3)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost any two bytecodes
    try:
        scraper = threading.Thread(target=scrape)
        scraper.start()
        workers = [threading.Thread(target=observe) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        scraper.join()
    finally:
        sys.setswitchinterval(old)
    assert _count(r) == per_thread * threads  # nothing lost or doubled across folds
    assert scrapes == sorted(scrapes)  # counts only grow
    low = sum(1 for i in range(per_thread) if i % 3 <= 1) * threads
    assert f'y_bucket{{le="1.0"}} {float(low)}' in generate_latest(r).decode()


def _count(r: CollectorRegistry) -> float:
    for ln in generate_latest(r).decode().splitlines():
        if ln.startswith("y_count"):
            return float(ln.split()[-1])
    return 0.0


def test_pending_values_fold_without_a_scrape(monkeypatch) -> None:
    monkeypatch.setattr(fast_histogram, "FOLD_AT", 100)
    h = FastHistogram("z", "doc", buckets=(1.0,), registry=CollectorRegistry())
    series = h._plain
    for _ in range(250):
        h.observe(0.5)
    assert len(series._pending) < 100  # folded twice on the way, no scrape
    assert series.snapshot() == ([250, 250], 125.0)
    with pytest.raises(ValueError, match="labels"):
        FastHistogram("w", "doc", ["a"], buckets=(1.0,), registry=CollectorRegistry()).observe(1.0)
