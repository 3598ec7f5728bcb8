"""The compile cache lives in a per-user folder, never in the installed package (issue 45).

``blendmatch/__init__.py`` points numba's cache (``NUMBA_CACHE_DIR``) at
``$BLENDMATCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/blendmatch``, else ``~/.cache/blendmatch``
(numba's files in ``<it>/numba``); a user's own ``NUMBA_CACHE_DIR`` is honoured; a folder
that cannot be written costs one WARNING and the process runs uncached. Each case runs in
a fresh interpreter: numba picks a function's cache folder when the function is defined.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blendmatch.compile_cache import CACHE_DIR_ENV, cache_root

# Compiles one small kernel (cold: a few seconds) and says where numba put its cache.
_PROBE = """
import json, os, sys
import numpy as np
import blendmatch.gpu.fingerprint as fp
import numba
fp.chunk_fingerprints(np.arange(8, dtype=np.uint32).reshape(2, 4))
from blendmatch.compile_cache import current
s = current()
print(json.dumps({"numba": numba.config.CACHE_DIR, "env": os.environ.get("NUMBA_CACHE_DIR"), "folder": s.folder,
                  "chosen": s.chosen, "source": s.source, "persistent": s.persistent,
                  "package": os.path.dirname(os.path.dirname(fp.__file__))}))
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", CACHE_DIR_ENV, "XDG_CACHE_HOME")}
    env["HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


def _run(code: str, env: dict[str, str]) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _cache_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.suffix in (".nbi", ".nbc")]


def test_the_folder_rule() -> None:
    home = Path.home()
    assert cache_root({}) == home / ".cache" / "blendmatch"
    assert cache_root({"XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/blendmatch")
    assert cache_root({"XDG_CACHE_HOME": "relative/ignored"}) == home / ".cache" / "blendmatch"
    assert cache_root({CACHE_DIR_ENV: "/own", "XDG_CACHE_HOME": "/xdg"}) == Path("/own")


def test_the_default_is_the_users_cache_folder_and_numba_writes_there(tmp_path: Path) -> None:
    got, _ = _run(_PROBE, _env(tmp_path))
    want = tmp_path / "home" / ".cache" / "blendmatch" / "numba"
    assert got["numba"] == got["env"] == got["folder"] == str(want)
    assert got["persistent"]
    assert _cache_files(want), "numba wrote no cache file in the user's folder"


def test_xdg_cache_home_and_blendmatch_cache_dir(tmp_path: Path) -> None:
    got, _ = _run(_PROBE, _env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg")))
    assert got["numba"] == str(tmp_path / "xdg" / "blendmatch" / "numba")
    got, _ = _run(_PROBE, _env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"), **{CACHE_DIR_ENV: str(tmp_path / "own")}))
    assert got["numba"] == str(tmp_path / "own" / "numba")
    assert _cache_files(tmp_path / "own" / "numba")


def test_a_users_numba_cache_dir_is_honoured(tmp_path: Path) -> None:
    got, _ = _run(_PROBE, _env(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "mine")))
    assert got["numba"] == str(tmp_path / "mine") and got["source"] == "$NUMBA_CACHE_DIR"
    assert _cache_files(tmp_path / "mine")


def test_numba_imported_first_still_gets_the_folder(tmp_path: Path) -> None:
    got, _ = _run("import numba\n" + _PROBE, _env(tmp_path, **{CACHE_DIR_ENV: str(tmp_path / "own")}))
    assert got["numba"] == str(tmp_path / "own" / "numba")
    assert _cache_files(tmp_path / "own" / "numba")


def test_an_unwritable_folder_warns_once_and_runs_uncached(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    got, stderr = _run(_PROBE, _env(tmp_path, **{CACHE_DIR_ENV: str(blocker / "cache")}))
    assert not got["persistent"] and got["chosen"] == str(blocker / "cache" / "numba")
    assert got["numba"] == got["folder"] != got["chosen"]  # a private temporary folder
    warnings = [line for line in stderr.splitlines() if "not writable" in line]
    assert len(warnings) == 1, stderr
    assert str(blocker) in warnings[0]
    assert not Path(got["folder"]).exists(), "the temporary folder outlived the process"
