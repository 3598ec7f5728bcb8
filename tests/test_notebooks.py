"""The profiling notebooks.

CI executes every notebook top to bottom on tiny parameters into a temporary copy (the
committed notebooks are never touched) and checks that it produced its figures, inline and
as PNG files. The committed notebooks must carry the outputs of a full run
(``scripts/run_notebooks.sh``): every code cell executed, figures embedded, the machine
named, and their main figures exported under ``docs/figures/`` and shown in the README.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "scripts" / "run_notebooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Tiny parameters per notebook (a few seconds each on 2 cores) and the figures each must produce:
#: (inline images at least, PNG files written to FIGURE_DIR).
TINY: dict[str, tuple[dict, int, list[str]]] = {
    "engine_batching.ipynb": (
        {"N_CHUNKS": 2000, "QUERY_TOKENS": [1024, 4096], "QUERIES_PER_BATCH": [1, 4, 16],
         "REFERENCE_MAX_BATCH_TOKENS": 4096, "SECONDS_PER_POINT": 0.01, "MIN_REPS": 5, "MAX_REPS": 20},
        1, ["engine_batching.png"]),
    "service_batching.ipynb": (
        # each `blendmatch loadtest` call (the fallback without wrk) costs ~4 s of start-up and
        # phases besides the measurement, so without wrk: fewer, shorter runs
        {"CHUNKS": 2000, "QUERY_TOKENS": 2048, "QUERY_POOL": 8, "MAX_BATCH_WAIT_MS": [0.0, 1.0],
         "EVENT_RATE": 400.0, "EVENT_BATCH": 20,
         **({"CONCURRENCIES": [1, 4], "DURATION_S": 1} if shutil.which("wrk") else
            {"CONCURRENCIES": [2], "DURATION_S": 0.5})},
        2, ["service_batching.png"]),
    "filter_tradeoffs.ipynb": (
        {"N_CHUNKS": 2000, "LOADS": [1 / 64, 1 / 16, 1 / 4], "QUERIES": 2, "QUERY_TOKENS": 4096, "VERIFY_REPS": 2},
        1, ["filter_tradeoffs.png"]),
}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _images(nb) -> int:
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))


def _text(nb) -> str:
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            parts.append(o.get("text", ""))
            parts.append(o.get("data", {}).get("text/plain", ""))
            parts.append(o.get("data", {}).get("text/markdown", ""))
    return "".join(parts)


def _execute_tiny(name: str, tmp_path: Path, **extra):
    params, n_images, pngs = TINY[name]
    src = REPO / "notebooks" / name
    committed = [src, *sorted((REPO / "docs" / "figures").glob("*.png"))]
    before = [_digest(p) for p in committed]
    figures = tmp_path / "figures"
    nb = _runner().execute(src, tmp_path / name, {**params, **extra, "FIGURE_DIR": str(figures)}, timeout=300)
    assert [_digest(p) for p in committed] == before, "a CI run must leave the committed notebook and figures alone"
    assert _images(nb) >= n_images, f"{name}: {_images(nb)} inline figures, expected at least {n_images}"
    for png in pngs:
        data = (figures / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, f"{name}: {png} is not a real figure"
    return nb


def test_every_notebook_has_tiny_parameters():
    assert NOTEBOOKS, "notebooks/ holds the profiling notebooks"
    assert sorted(p.name for p in NOTEBOOKS) == sorted(TINY), "each notebook needs tiny CI parameters here"
    runner = _runner()
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        names = runner.parameter_names(nb)
        assert set(TINY[path.name][0]) | {"FIGURE_DIR"} <= set(names), path.name


@pytest.mark.parametrize("name", sorted(TINY))
def test_notebook_executes_on_tiny_inputs(name, tmp_path):
    nb = _execute_tiny(name, tmp_path)
    text = _text(nb)
    assert "CPU " in text, "the notebook names the machine"
    if name == "engine_batching.ipynb":
        assert "recommended for this machine: --max-batch-tokens" in text
    if name == "service_batching.ipynb":
        assert "load generator:" in text
    if name == "filter_tradeoffs.ipynb":
        assert "occupancy filter passed" in text


@pytest.mark.skipif(shutil.which("wrk") is None,
                    reason="wrk is not installed, so the tiny run above already used the project's own load test")
def test_service_notebook_with_the_projects_own_load_test(tmp_path):
    """The fallback for machines without wrk, forced here because this one has it."""
    nb = _execute_tiny("service_batching.ipynb", tmp_path, LOAD_GENERATOR="loadtest", CONCURRENCIES=[2],
                       MAX_BATCH_WAIT_MS=[0.0], DURATION_S=0.5)
    assert "load generator: blendmatch loadtest" in _text(nb)


def test_bad_parameter_names_are_refused():
    runner = _runner()
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    with pytest.raises(ValueError, match="not parameters of this notebook"):
        runner.inject_parameters(nb, {"NO_SUCH_PARAMETER": 1})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_notebook_carries_a_full_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and "parameters" in code[0].metadata.get("tags", []), "first code cell tagged 'parameters'"
    assert not any("injected-parameters" in c.metadata.get("tags", []) for c in code), \
        "committed notebooks run at their defaults (no injected parameters)"
    assert all(c.execution_count is not None for c in code), "every code cell executed (scripts/run_notebooks.sh)"
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", []))
    assert _images(nb) >= TINY[path.name][1], "figures embedded"
    text = _text(nb)
    assert "run at" in text and "CPU " in text, "the machine is named in a cell"
    assert _runner().strip_progress(nb) == 0, "no progress-bar redraws in the committed outputs"
    readme = (REPO / "README.md").read_text()
    for png in TINY[path.name][2]:
        assert (REPO / "docs" / "figures" / png).stat().st_size > 10_000
        assert f"docs/figures/{png}" in readme, f"README shows {png}"


def test_strip_progress_drops_the_bars_and_keeps_the_rest():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("run()")
    bar = "\rsweep:  43%|####3     | 12/28 [00:03<00:04,  3.73point/s]"
    cell.outputs = [nbformat.v4.new_output("stream", name="stderr", text="\rsweep:   0%|          | 0/28 [00:00<?, ?point/s]"),
                    nbformat.v4.new_output("stream", name="stderr", text=bar + bar),
                    nbformat.v4.new_output("stream", name="stdout", text="engine  Mwindows/s\ncpu  120.0\n"),
                    nbformat.v4.new_output("stream", name="stderr", text="\n"),
                    nbformat.v4.new_output("stream", name="stderr", text="UserWarning: 12% of the runs failed\n")]
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), cell]
    assert _runner().strip_progress(nb) == 3
    assert [(o.name, o.text) for o in cell.outputs] == [("stdout", "engine  Mwindows/s\ncpu  120.0\n"),
                                                         ("stderr", "UserWarning: 12% of the runs failed\n")]
