"""The layout is the architecture: rooms import one way, only public names, bench apart.

The import-linter contract lives in ``pyproject.toml``. It is checked against the package as a
wheel installs it (``pip install --no-deps --target``): from the repository root the bare
``./blendmatch`` folder would shadow the ``package-dir`` mapping, and an editable install hides
the subpackages from the graph, so either would check an empty graph and pass. The test
therefore also asserts that the graph really holds each room, and that the contract fails on
a deliberate upward import.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a room may import only rooms with a lower rank; `blendmatch.lazy` and `blendmatch.compile_cache`
# are leaf helpers of the top package (they import nothing of the project): the rooms' __init__
# files use the first, the service (start-up log, `blendmatch warmup`) the second
ROOMS = {"lazy": -1, "compile_cache": -1, "gpu": 0, "index": 1, "service": 2}

pytest.importorskip("importlinter")


def _env(target: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "BLENDMATCH_TREE"}
    env["PYTHONPATH"] = str(target)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package as a wheel lays it out, in a folder of its own."""
    target = tmp_path_factory.mktemp("wheel-layout")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "top", "bench", "gpu", "index", "service"):
        path = ROOT / name
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, src / name)
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--target", str(target), str(src)], cwd=src, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return target


def _lint(target: Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports") or "lint-imports"
    return subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=target, env=_env(target),
                          capture_output=True, text=True, timeout=120)


def test_the_graph_holds_every_room(installed):
    code = ("import grimp, json; g = grimp.build_graph('blendmatch');"
            "print(json.dumps(sorted(g.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=installed, env=_env(installed),
                         capture_output=True, text=True, check=True, timeout=120).stdout
    modules = set(__import__("json").loads(out))
    for room in ("gpu", "index", "service", "bench"):
        inside = {m for m in modules if m.startswith(f"blendmatch.{room}.")}
        assert len(inside) >= 3, f"the import graph has no modules of blendmatch.{room}: {sorted(modules)}"
    assert "blendmatch.gpu.fingerprint" in modules and "blendmatch.index.key_directory" in modules


def test_the_rooms_import_from_the_repository_root(installed):
    """No folder at the root shadows the installed package (a root ``blendmatch/`` once did)."""
    assert not (ROOT / "blendmatch").exists()
    code = "import blendmatch, blendmatch.gpu, blendmatch.index, blendmatch.service; print(blendmatch.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(installed),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(installed)), out.stdout


def test_import_linter_contracts_are_kept(installed):
    run = _lint(installed)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "broken" in run.stdout and "0 broken" in run.stdout


def test_an_upward_import_breaks_the_contract(installed, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(installed, broken)
    victim = broken / "blendmatch" / "gpu" / "batch.py"
    victim.write_text(victim.read_text() + "\n\ndef _upward():\n    from blendmatch.index import types  # noqa\n")
    run = _lint(broken)
    assert run.returncode != 0 and "BROKEN" in run.stdout, run.stdout


def _room_imports(room: str):
    """``(file, imported module, names)`` for every import of the project in ``room``."""
    for path in sorted((ROOT / room).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path, node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name, []


@pytest.mark.parametrize("room", ["gpu", "index", "service", "bench"])
def test_rooms_import_only_down_and_only_public_names(room):
    for path, module, names in _room_imports(room):
        parts = module.split(".")
        if parts[0] != "blendmatch" or len(parts) < 2:
            continue
        other = parts[1]
        if other == room:
            continue
        where = f"{path.relative_to(ROOT)} imports {module} {names}"
        if path == ROOT / "service" / "cli.py" and other == "bench":
            continue  # the bench subcommands, imported lazily (the import-linter contract's one exception)
        assert other != "bench", where
        if room != "bench":
            assert ROOMS.get(other, 99) < ROOMS[room], f"upward import: {where}"
        assert not any(p.startswith("_") for p in parts[1:]), f"private module across rooms: {where}"
        assert not any(n.startswith("_") for n in names), f"private name across rooms: {where}"


def test_importing_the_client_loads_no_server_code():
    code = ("import sys, blendmatch.service.client as c; c.BlendClient;"
            "bad = sorted(m for m in ('fastapi', 'starlette', 'numba', 'uvicorn', 'pydantic') if m in sys.modules);"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120).stdout.strip()
    assert out == "", f"importing blendmatch.service.client loaded: {out}"


def test_ci_runs_the_lowest_python_the_metadata_allows():
    """``requires-python`` is a promise: CI runs its floor, so the floor is what is proven."""
    import re
    text = (ROOT / "pyproject.toml").read_text()
    floor = tuple(int(x) for x in re.search(r'requires-python = ">=(\d+)\.(\d+)"', text).groups())
    assert sys.version_info[:2] >= floor
    if os.environ.get("CI"):
        assert sys.version_info[:2] == floor, f"CI runs Python {sys.version_info[:2]}, the metadata says >= {floor}"
