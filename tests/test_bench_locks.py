"""``bench/locks.py``: the timing proxy records one sample per outermost hold (a re-entrant
acquire inside it is not a hold of its own), by thread, and the summary groups samples by
phase window, lock and thread kind. No timing is asserted."""

from __future__ import annotations

import threading
import time

from blendmatch.bench.locks import TimedLock, summarize, table


def test_timed_lock_counts_outermost_holds_and_groups_them():
    samples: list = []
    lock = TimedLock(threading.RLock(), "index", samples)
    t0 = time.perf_counter()
    with lock:
        with lock:  # re-entrant: part of the outer hold
            pass
    other = threading.Thread(target=lambda: [lock.acquire(), lock.release()], name="blendmatch-events_0")
    other.start()
    other.join()
    t1 = time.perf_counter()
    assert [(s[0], s[2]) for s in samples] == [("index", threading.current_thread().name),
                                               ("index", "blendmatch-events_0")]
    assert all(s[3] >= 0 and s[4] >= 0 and s[5] >= 0 for s in samples)  # wait, hold, CPU in hold
    rows = summarize(samples, {"phase A": (t0, t1), "before": (0.0, t0 - 1e-9)})
    assert [(r["phase"], r["lock"], r["thread"], r["count"]) for r in rows] == [
        ("phase A", "index", "events thread", 1), ("phase A", "index", "other", 1)]
    assert "| phase A | index | events thread | 1 |" in table(rows)
