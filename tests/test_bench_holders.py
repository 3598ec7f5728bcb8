"""``python -m blendmatch.bench.holders`` runs end to end on a small fleet (the figures are
printed, not asserted: timings are the machine's)."""

from __future__ import annotations

import json

from blendmatch.bench.holders import main


def test_holders_bench_runs_small(tmp_path, capsys):
    out = tmp_path / "h.json"
    assert main(["--instances", "30", "--chunks", "3", "--chunk-size", "16", "--marks", "20,30", "--latency",
                 "--rounds", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["per_add_us"]) == {"20", "30"} and got["placed_answer_bytes"] > 0
    assert "per holder added" in capsys.readouterr().out
