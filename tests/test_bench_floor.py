"""``bench/floor.py``: the bare server answers the loadtest posters' real bodies over a real
socket, every request counted, and the CPU split is reported. No timing is asserted."""

from __future__ import annotations

from blendmatch.bench import floor


def test_bare_server_takes_the_posters_bodies():
    (row,) = floor.measure([8], posters=2, duration=0.3)
    assert row["batch"] == 8 and row["posters"] == 2 and row["errors"] == 0
    assert row["entries_per_s"] > 0
    assert all(row[k] >= 0 for k in ("server_user_us", "server_sys_us", "posters_user_us", "posters_sys_us"))


def test_cli_rejects_bad_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit):
        floor.main(["--posters", "0"])
    assert "must be positive" in capsys.readouterr().err
