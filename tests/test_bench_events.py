"""The ingest benchmark runs end to end on tiny inputs and reports both input forms."""

from __future__ import annotations

import numpy as np

from blendmatch.bench import events as bench_events


def test_both_input_forms_carry_the_same_batches():
    lists = bench_events.make_requests(30, 10, 8)
    packed = bench_events.make_requests(30, 10, 8, packed=True)
    assert len(lists) == len(packed) == 3
    for a, b in zip(lists, packed):
        for ea, eb in zip(a["batches"][0]["entries"], b["batches"][0]["entries"]):
            assert type(ea["token_ids"]) is list and isinstance(eb["token_ids"], np.ndarray)
            assert eb["token_ids"].dtype == np.uint32 and eb["token_ids"].tolist() == ea["token_ids"]
            assert {**ea, "token_ids": None} == {**eb, "token_ids": None}


def test_run_reports_both_forms(capsys):
    out = bench_events.run(num_entries=40, batch_entries=10, chunk_size=8, repeats=1, memory=False)
    for form in ("json", "packed"):
        assert out[f"{form}_entries_per_s"] > 0 and out[f"{form}_entries_per_cpu_s"] > 0
        assert out[f"{form}_parse_s"] + out[f"{form}_apply_s"] > 0
    assert bench_events.main(["--entries", "20", "--batch", "10", "--chunk-size", "8", "--repeats", "1",
                              "--no-memory"]) == 0
    assert "entries/s from decoded JSON" in capsys.readouterr().out
