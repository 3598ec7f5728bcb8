"""``RunTally`` (``service/sources/instance_bound.py``): what the Kafka source sums over the
records of a fetched stretch of the log, by name (it was an untyped 6-slot list)."""

from __future__ import annotations

from blendmatch.index.key_directory import ApplyCounts, ApplyReport
from blendmatch.service.sources.instance_bound import RunTally


def test_a_tally_sums_reports_by_field():
    tally = RunTally()
    assert (tally.applied, tally.duplicates, tally.stale, tally.entries, tally.requests, tally.not_indexable) == \
        (0, 0, 0, 0, 0, {})
    tally.add(ApplyReport(ApplyCounts(2, 1, 0), 130, {"wrong_length": 3}))
    tally.add(ApplyReport(ApplyCounts(1, 0, 4), 64, {"wrong_length": 1, "world_size_0": 2}))
    tally.add(ApplyReport(ApplyCounts(0, 1, 0), 0, {}))
    assert (tally.applied, tally.duplicates, tally.stale, tally.entries, tally.requests) == (3, 2, 4, 194, 3)
    assert tally.not_indexable == {"wrong_length": 4, "world_size_0": 2}
    assert RunTally().not_indexable is not tally.not_indexable  # one dict per tally
