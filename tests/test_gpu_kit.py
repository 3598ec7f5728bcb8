"""The GPU kit's dry run (``scripts/gpu_check.sh --dry-run``), in CI.

It runs ``--prepare`` first (this project's wheel and the wheels the device image lacks into
``.whl/``, and an environment shaped like the device image: Python 3.12 with numpy, numba,
httpx, prometheus-client, pytest, hypothesis, uvloop and tqdm, without pydantic or FastAPI,
kept in ``~/.cache/blendmatch`` and reused), then the dry run, which installs offline from
``.whl/`` and runs every step that needs no GPU: the package's bottom rooms import without
the service's dependencies, the gpu tests collect, the service answers lookups in-process
from the carried wheels. Device steps must be reported ``skipped`` and the summary must
have the shape the device run writes. Skipped (saying why) only when there is no Python 3.12
or ``--prepare`` cannot reach a package index.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
DEVICE_STEPS = {"trial", "gpu-tests", "scale-self-test", "benchmark"}
HOST_STEPS = {"environment", "install", "imports", "collect", "service-smoke"}


def _python312() -> str | None:
    cands = [shutil.which("python3.12")] + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    for c in cands:
        if c and subprocess.run([c, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                capture_output=True).returncode == 0:
            return c
    return None


@pytest.mark.slow
def test_gpu_kit_dry_run_in_an_image_shaped_environment(tmp_path):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("the kit needs bash and coreutils' timeout")
    if _python312() is None:
        pytest.skip("no Python 3.12 on this machine (the device image's Python)")
    prep = subprocess.run(["bash", str(SCRIPT), "--prepare"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if prep.returncode != 0:
        log = prep.stdout[-3000:] + prep.stderr[-3000:]
        if any(s in log for s in ("Could not find a version", "No matching distribution", "Network is unreachable",
                                  "Failed to establish a new connection", "Temporary failure in name resolution")):
            pytest.skip(f"--prepare could not fetch wheels (no package index?):\n{log[-1500:]}")
        pytest.fail(f"--prepare failed:\n{log}")
    assert 'run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)' in prep.stdout
    out = tmp_path / "gpu-results"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env=env)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"device", "dry_run", "steps", "figures"} and summary["dry_run"] is True
    steps = {s["name"]: s for s in summary["steps"]}
    assert set(steps) == DEVICE_STEPS | HOST_STEPS
    for s in summary["steps"]:
        assert set(s) == {"name", "status", "seconds"} and s["seconds"] >= 0
        assert s["status"] == ("skipped" if s["name"] in DEVICE_STEPS else "ok"), s
    figures = summary["figures"]
    assert figures["python"].startswith("3.12.")  # the image-shaped environment ran it
    assert "/site/pkg/blendmatch" in figures["package"]  # the installed wheel, not the checkout
    assert figures["lookup_reference_smoke"]["queries"] == 10
    env_txt = (out / "env.txt").read_text()
    assert "pydantic" not in env_txt.split("--- packages", 1)[1]  # the base environment has none
