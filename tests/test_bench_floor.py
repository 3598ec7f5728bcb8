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


def test_stages_cut_the_real_server_short_and_count_every_post():
    """``bench/floor_stages.py``: the spawned servers answer the posters' real bodies, every
    post counted, at the stages that replace the events thread's work (``full`` is the real
    server, which the service tests cover)."""
    from blendmatch.bench import floor_stages

    rows = floor_stages.measure([8], posters=2, duration=0.3, rounds=1, stages=("http", "decode"))
    assert [r["stage"] for r in rows] == ["http", "decode"]
    for r in rows:
        assert r["errors"] == 0 and r["entries_per_s"] > 0 and r["batch"] == 8
        assert r["loop_us"] > 0 and r["rest_us"] >= 0 and r["posters_us"] > 0


def test_stages_cli_rejects_bad_arguments(capsys):
    import pytest

    from blendmatch.bench import floor_stages

    with pytest.raises(SystemExit):
        floor_stages.main(["--stages", "http,nothing"])
    assert "--stages takes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        floor_stages.main(["--serve-stage", "nothing"])
