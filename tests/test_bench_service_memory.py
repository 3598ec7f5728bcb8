"""``bench/service_memory.py``: real ``blendmatch serve`` processes filled through ``POST
/events`` by real posters; each row's figure counts only if every entry was indexed."""

from __future__ import annotations

import pytest

from blendmatch.bench import service_memory


def test_each_configuration_is_filled_and_measured():
    rows = service_memory.measure(chunks=1_500, batch=500, posters=2, rounds=1)
    assert [r["config"] for r in rows] == ["on", "off"]
    for r in rows:
        assert r["chunks"] == 1_500 and r["batch"] == 500 and r["posters"] == 2
        assert r["rss_after_mib"] > r["rss_before_mib"] > 50  # a server with numba and FastAPI loaded
        # at least the chunk's tokens (1,024 B), far from a runaway figure
        assert 1_024 < r["bytes_per_chunk"] < 200_000
        assert r["entries_per_s"] > 0


def test_cli_refuses_unknown_configurations_and_bad_counts(capsys):
    with pytest.raises(SystemExit) as ei:
        service_memory.main(["--configs", "on,fast"])
    assert ei.value.code == 2 and "unknown ['fast']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        service_memory.main(["--chunks", "0"])
    assert ei.value.code == 2 and "must be >= 1" in capsys.readouterr().err
