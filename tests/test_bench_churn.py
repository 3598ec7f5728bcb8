"""``bench/churn.py``: an instance evicting as it stores; its L1 log stays bounded and the
fence at the end drops every live key (the bench raises otherwise)."""

from __future__ import annotations

import pytest

from blendmatch.bench import churn
from blendmatch.index.bindings import _L1_LOG_SLACK


def test_churn_compacts_the_log_and_keeps_it_bounded():
    r = churn.measure(keys=5_000, rounds=30, batch=500)
    assert r["churn_entries"] == 30_000 and r["entries_per_s"] > 0
    # 30 rounds append 15,000 entries to a log of 5,000 live keys: past 2 x 5,000 + the slack
    assert r["compactions"] >= 1 and r["compaction_s"] > 0
    assert 5_000 < r["longest_log"] <= 2 * 5_000 + _L1_LOG_SLACK


def test_cli_refuses_bad_counts(capsys):
    with pytest.raises(SystemExit) as ei:
        churn.main(["--keys", "0"])
    assert ei.value.code == 2 and "--keys must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        churn.main(["--keys", "10", "--batch", "100"])
    assert ei.value.code == 2 and "--keys must be >= --batch" in capsys.readouterr().err
