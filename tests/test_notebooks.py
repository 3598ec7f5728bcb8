"""The profiling notebooks run top to bottom (on tiny inputs) so they never rot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("BM_NB_CHUNKS", "2000")
    monkeypatch.setenv("BM_NB_QUERY_TOKENS", "4096")
    monkeypatch.setenv("BM_NB_ENGINE", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "windows/s" in outputs


def test_there_is_a_notebook():
    assert NOTEBOOKS, "notebooks/ must hold the batching profile"
