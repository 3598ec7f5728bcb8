"""Execute the profiling notebooks: in place at their default sizes, or into copies with
overridden parameters (what CI does).

    python scripts/run_notebooks.py                       # every notebooks/*.ipynb, in place
    python scripts/run_notebooks.py notebooks/x.ipynb     # just these
    python scripts/run_notebooks.py --out /tmp/nb -p N_CHUNKS=2000 -p FIGURE_DIR='"/tmp/nb"'

Parameters follow papermill's convention: each notebook's first code cell is tagged
``parameters`` and holds the defaults; overrides go into a cell tagged
``injected-parameters`` inserted right after it (``papermill -p`` does the same, so either
tool can run these notebooks). ``-p NAME=VALUE`` takes a Python literal; a name the
notebook's parameters cell does not assign is an error, so a renamed parameter cannot be
overridden silently. A notebook runs with its own folder as the working directory (it
imports its helpers from there), wherever its executed copy is written. Any cell error
stops that notebook and makes the command fail (exit status 1).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"

__all__ = ["NOTEBOOKS", "execute", "inject_parameters", "parameter_names", "strip_progress"]

#: One tqdm progress-bar state as tqdm writes it to stderr: ``label:  43%|####  | 12/28 [00:03<00:04, 3.7it/s]``.
_PROGRESS_BAR = re.compile(r"^[^\r\n]*\d+%\|[^\r\n]*\| *\d+/\d+ \[[^\r\n]*\]$")


def _parameters_index(nb: Any) -> int:
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            return i
    raise ValueError("the notebook has no code cell tagged 'parameters'")


def parameter_names(nb: Any) -> list[str]:
    """Names the ``parameters`` cell assigns, in order."""
    tree = ast.parse(nb.cells[_parameters_index(nb)].source)
    names: list[str] = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    names.append(n.id)
    return names


def inject_parameters(nb: Any, params: dict[str, Any]) -> None:
    """Put ``params`` in an ``injected-parameters`` cell after the ``parameters`` cell
    (replacing an earlier injected cell). Raises ``ValueError`` for unknown names."""
    known = set(parameter_names(nb))
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"not parameters of this notebook: {', '.join(unknown)} (it has {', '.join(sorted(known))})")
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    if not params:
        return
    src = "# Injected parameters\n" + "".join(f"{k} = {v!r}\n" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(src)
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(_parameters_index(nb) + 1, cell)


def strip_progress(nb: Any) -> int:
    """Drop the progress bars (tqdm's stderr redraws, one output per redraw) from ``nb``'s
    outputs: in a saved notebook they are dozens of stale bar states, not results. Other
    stderr output (a warning) is kept. Returns how many outputs were dropped."""
    dropped = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr" and _only_progress(out.text):
                dropped += 1
            else:
                kept.append(out)
        cell["outputs"] = kept
    return dropped


def _only_progress(text: str) -> bool:
    return all(not part.strip() or _PROGRESS_BAR.match(part.strip()) for part in re.split(r"[\r\n]", text))


def execute(src: Path, dest: Path | None = None, params: dict[str, Any] | None = None,
            timeout: int = 1800) -> Any:
    """Run ``src`` top to bottom (working directory: its folder); write it to ``dest``
    (default: ``src`` itself) and return the executed notebook. A cell error raises
    ``nbclient.exceptions.CellExecutionError`` and nothing is written."""
    src = Path(src).resolve()
    nb = nbformat.read(src, as_version=4)
    inject_parameters(nb, params or {})
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(src.parent)}})
    client.execute()
    strip_progress(nb)
    out = Path(dest) if dest is not None else src
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return nb


def _literal(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{name}: not a Python literal: {value!r} (quote strings)") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    p.add_argument("-p", "--param", action="append", type=_literal, default=[], metavar="NAME=VALUE",
                   help="override a parameter (a Python literal); repeatable")
    p.add_argument("--out", type=Path, help="write executed copies into this folder instead of in place")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default %(default)s)")
    a = p.parse_args(argv)
    paths = a.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    params = dict(a.param)
    failed = 0
    for path in paths:
        dest = (a.out / path.name) if a.out else None
        t0 = time.perf_counter()
        print(f"{path.name}: running{' with ' + str(params) if params else ''} ...", flush=True)
        try:
            execute(path, dest, params, a.timeout)
        except Exception as exc:  # noqa: BLE001 - report every notebook, fail at the end
            failed += 1
            print(f"{path.name}: FAILED after {time.perf_counter() - t0:.0f} s: {type(exc).__name__}: {exc}",
                  flush=True)
            continue
        print(f"{path.name}: done in {time.perf_counter() - t0:.0f} s -> {dest or path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
