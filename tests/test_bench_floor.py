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


def test_stage_alone_runs_the_events_threads_work_without_a_server():
    """Stage ``alone``: a fresh interpreter applies the posters' bodies in runs, no server; its
    CPU per entry is the events thread's alone (no loop, no posters)."""
    from blendmatch.bench import floor_stages

    (row,) = floor_stages.measure([64], posters=4, duration=0.5, rounds=1, stages=("alone",))
    assert row["stage"] == "alone" and row["batch"] == 64 and row["errors"] == 0
    assert row["entries_per_s"] > 0 and row["rest_us"] > 0
    assert row["loop_us"] == 0 and row["posters_us"] == 0


def test_stage_alone_applies_every_posters_bodies_in_order(monkeypatch):
    """A body that does not fit a run opens the next one: every poster's bodies are applied,
    in order (before, at 1,000-entry bodies, every other poster's were made and dropped)."""
    import re

    from blendmatch.bench import floor_stages
    from blendmatch.service import event_source, events_thread

    real, seen = event_source.decode_and_apply_run, []

    def recording(directory, run, *args, **kwargs):
        for body, _ in run:
            m = re.search(rb'"instance_id":"([^"]+)","incarnation":0,"seq":(\d+)', body)
            seen.append((m.group(1).decode(), int(m.group(2))))
        return real(directory, run, *args, **kwargs)

    monkeypatch.setattr(event_source, "decode_and_apply_run", recording)
    monkeypatch.setattr(events_thread, "MAX_RUN_BYTES", 150_000)  # one 64-entry body (~107 KB) per run
    floor_stages._run_alone(64, 4, 0.3, 1 << 44)
    assert len(seen) >= 8
    for k, (instance, seq) in enumerate(seen):
        assert (instance, seq) == (f"alone-{k % 4}", k // 4 + 1), seen[:k + 1]


def test_stage_alone_probe_notes_a_long_gil_hold_with_the_keys_by_then(monkeypatch):
    """``--probe-gil``: a hold of the GIL in one piece (a C loop that never lets it go) during
    the third run is noted, over 10 ms, with the keys the runs before it stored; that run is
    among the longest runs reported."""
    from blendmatch.bench import floor_stages
    from blendmatch.service import event_source

    real, calls = event_source.decode_and_apply_run, [0]

    def holding(directory, run, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            sum(range(20_000_000))  # keeps the GIL throughout (no eval-loop check inside)
        return real(directory, run, *args, **kwargs)

    monkeypatch.setattr(event_source, "decode_and_apply_run", holding)
    row = floor_stages._run_alone(64, 4, 0.3, 1 << 44, probe=True)
    holds = row["gil_holds"]
    assert [ms for ms, _ in holds] == sorted((ms for ms, _ in holds), reverse=True)
    # (the first runs may hold it too: compiling or loading the kernels)
    assert any(ms > 10 and keys in (2 * 4 * 64, 3 * 4 * 64) for ms, keys in holds), holds
    longest = row["longest_runs"]  # the run that held it is among the longest, with the keys before it
    assert [ms for ms, _ in longest] == sorted((ms for ms, _ in longest), reverse=True)
    assert any(k == 2 * 4 * 64 and ms > 10 for ms, k in longest), longest
    assert "gil_holds" not in floor_stages._run_alone(64, 4, 0.1, 2 << 44)


def test_stages_cli_rejects_bad_arguments(capsys):
    import pytest

    from blendmatch.bench import floor_stages

    with pytest.raises(SystemExit):
        floor_stages.main(["--stages", "http,nothing"])
    assert "--stages takes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        floor_stages.main(["--serve-stage", "nothing"])
    with pytest.raises(SystemExit):
        floor_stages.main(["--serve-stage", "alone"])  # not a server
    with pytest.raises(SystemExit, match="at most 'probe'"):
        floor_stages.main(["--alone", "64", "4", "1", "0", "other"])


_needs_wrk = __import__("pytest").mark.skipif(__import__("shutil").which("wrk") is None,
                                               reason="bench/floor_lookups.py drives wrk (apt-get install -y wrk)")


@_needs_wrk
def test_lookup_stages_answer_every_lookup_and_split_the_cpu():
    """``bench/floor_lookups.py``: wrk's lookups reach each stage and every one is answered
    200; the real servers' CPU is split into the loop and the rest. No timing is asserted."""
    from blendmatch.bench import floor_lookups

    rows = floor_lookups.measure(rounds=1, duration=0.5, chunks=500, tokens=1024, clients=4)
    assert [r["stage"] for r in rows] == list(floor_lookups.STAGES)
    for r in rows:
        assert r["errors"] == 0 and r["lookups_per_s"] > 0 and r["server_us"] > 0 and r["wrk_us"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        assert ("loop_us" in r) == (r["stage"] != "bare")


def test_lookup_http_stage_answers_without_looking_up_and_full_looks_up():
    """The ``http`` stage's lookup thread answers the canned answer (no decoding, no probe),
    whatever the tokens; ``full`` is the real server (nothing stored: no match)."""
    import base64
    import json

    import httpx
    import numpy as np

    from blendmatch.bench import floor_lookups
    from blendmatch.bench.loadgen import free_port, stop_server

    tokens = base64.b64encode(np.arange(1024, dtype="<u4").tobytes()).decode()
    answers = {}
    for stage in ("http", "full"):
        port = free_port()
        server = floor_lookups.spawn_stage(stage, port)
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/directory/blend-lookup",
                           json={"tokens_b64": tokens, "model_name": "m"}, timeout=30)
            assert r.status_code == 200
            answers[stage] = r.content
        finally:
            stop_server(server)
    assert answers["http"] == floor_lookups.ANSWER and len(json.loads(answers["http"])["matches"]) == 4
    assert json.loads(answers["full"]) == {"matches": []}


def test_lookup_stages_cli_rejects_bad_arguments(capsys):
    import pytest

    from blendmatch.bench import floor_lookups

    with pytest.raises(SystemExit):
        floor_lookups.main(["--stages", "bare,nothing"])
    assert "--stages takes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        floor_lookups.main(["--serve-stage", "bare"])
    with pytest.raises(ValueError):
        floor_lookups.spawn_stage("bare", 1)
