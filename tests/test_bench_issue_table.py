"""``blendmatch loadtest`` prints every figure of the service's targets table: lookups/s against LMCache
0.5.6's real coordinator (from its wheel) in the same run, lookup p99 with idle ingest and
under a paced STORE stream, and ``POST /events`` ingest at each batch size with the poster
count stated. Tiny sizes; no timing is asserted, only that every row was measured, with
its batch size and poster count, and that no request failed."""

from __future__ import annotations

import re

import pytest

from test_lmcache_compat import lmcache_site  # noqa: F401 - the fixture

pytestmark = [pytest.mark.compat, pytest.mark.slow]


def test_loadtest_prints_every_row_of_issue_28s_table(lmcache_site, capsys):  # noqa: F811
    from blendmatch.bench import loadtest

    rc = loadtest.main(["--no-compare", "--no-healthz", "--generator", "python", "--chunks", "300",
                        "--tokens", "1024", "--matches-per-query", "2", "--clients", "2", "--duration", "0.5",
                        "--event-rate", "300", "--event-batch", "16", "--posters", "3", "--ingest-batches", "8,40",
                        "--ingest-duration", "0.5", "--vs-lmcache", str(lmcache_site)])
    out = capsys.readouterr().out
    assert rc == 0, out  # no failed request, on either server
    table = out[out.index("The service's targets"):]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 5, table
    expect = [r"vs LMCache 0\.5\.6's coordinator in the same run .*\| [\d,]+ vs [\d,]+: \*\*[\d.]+x\*\* \|",
              r"lookup p99, 2 clients, idle ingest \| [\d.]+ ms",
              r"streams 300 STORE entries/s \(JSON token_ids, 16-entry batches\) \| [\d.]+ ms at [\d,]+ entries/s",
              r"8-entry batches, 3 concurrent posters \| [\d,]+ entries/s, [\d.]+ us server CPU/entry, "
              r"posters [\d.]+ us/entry, [\d.]+ of \d+ cores idle \|",
              r"40-entry batches, 3 concurrent posters \| [\d,]+ entries/s, [\d.]+ us server CPU/entry, "
              r"posters [\d.]+ us/entry, [\d.]+ of \d+ cores idle \|"]
    for row, pattern in zip(rows, expect):
        assert re.search(pattern, row), (pattern, row)
        assert row.rstrip().endswith(("| **met** |", "| missed |")), row  # a verdict, never "not measured"
    # the phase table carries the ingest phases and LMCache's lookups
    for phase in ("| batching | lookup |", "| batching | lookup+events |", "| batching | events 8x3 |",
                  "| batching | events 40x3 |", "| LMCache 0.5.6 | lookup |"):
        assert phase in out, phase
