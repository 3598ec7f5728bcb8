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
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
DEVICE_STEPS = {"trial", "gpu-tests", "scale-self-test"}
FAKE_STEPS = {"engine-bench", "service-bench", "notebook"}  # on the fake device in a dry run
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
    assert 'run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=570)' in prep.stdout
    out = tmp_path / "gpu-results"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env=env)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"device", "dry_run", "date", "steps", "figures", "targets"} and summary["dry_run"] is True
    steps = {s["name"]: s for s in summary["steps"]}
    assert set(steps) == DEVICE_STEPS | FAKE_STEPS | HOST_STEPS
    for s in summary["steps"]:
        assert set(s) == {"name", "status", "seconds"} and s["seconds"] >= 0
        assert s["status"] == ("skipped" if s["name"] in DEVICE_STEPS else "ok"), s
    figures = summary["figures"]
    assert figures["python"].startswith("3.12.")  # the image-shaped environment ran it
    assert "/site/pkg/blendmatch" in figures["package"]  # the installed wheel, not the checkout
    assert figures["lookup_reference_smoke"]["lookups"] == 10
    assert figures["fake"] is True and summary["targets"]["judged"] is False
    assert_measures_everything(summary)
    env_txt = (out / "env.txt").read_text()
    assert "pydantic" not in env_txt.split("--- packages", 1)[1]  # the base environment has none


def assert_measures_everything(summary: dict) -> None:
    """The GPU engine's figures and the targets that name them are all in one summary."""
    f = summary["figures"]
    assert set(f["engine_bench"]) == {"4x1024", "8x1024"} if f.get("fake") else {"64x32768", "256x32768"}
    for row in f["engine_bench"].values():
        for key in ("cpu_windows_per_s", "gpu_device_only_windows_per_s", "gpu_serial_windows_per_s",
                    "gpu_pipelined_windows_per_s", "gpu_pipelined_lent_windows_per_s",
                    "gpu_pipelined_prestaged_windows_per_s", "pipelined_over_device_only"):
            assert isinstance(row[key], (int, float)) and row[key] > 0, key
        for mode in ("serial", "pipelined", "pipelined_lent", "pipelined_prestaged"):
            assert {"stage_s", "upload_s", "kernels_s", "copyback_s", "wait_s", "total_s"} <= set(row[f"gpu_{mode}_timings_s"])
    sb = f["service_bench"]
    for engine in ("gpu", "cpu"):
        shapes = {k: v for k, v in sb[engine].items() if k.isdigit()}
        assert len(shapes) == 2 and sb[engine]["engine"] == engine
        for fig in shapes.values():
            assert fig["lookups_per_s"] > 0 and fig["p50_ms"] > 0 and fig["p99_ms"] >= fig["p50_ms"]
            assert fig["pipelined"] is (engine == "gpu")
    rows = f["notebook_engine_batching"]["rows"]
    assert {r["engine"] for r in rows} == {"cpu", "gpu"} and all(r["windows_per_s"] for r in rows)
    t = summary["targets"]
    assert set(t) == {"e2e_windows_per_s_at_64x32768", "e2e_over_device_only", "service_32k_lookups_per_s_gpu_over_cpu",
                      "service_32k_p50_gpu_over_cpu", "all_pass", "judged"}
    for name in ("e2e_windows_per_s_at_64x32768", "e2e_over_device_only", "service_32k_lookups_per_s_gpu_over_cpu",
                 "service_32k_p50_gpu_over_cpu"):
        assert t[name]["measured"] is not None and t[name]["pass"] is (None if f.get("fake") else t[name]["pass"])


def test_gpu_kit_measuring_steps_on_the_fake_device(tmp_path):
    """The measuring steps and the summary, on the fake device (what the dry run runs), from
    this checkout: every figure item 5 names, the targets computed but not judged."""
    cuda_host = pytest.importorskip("cuda_host")
    if cuda_host.cxx() is None:
        pytest.skip("no C++ compiler: the fake device builds the kernel source as host C++")
    kit = ROOT / "scripts" / "gpu_kit.py"
    env = {**os.environ, "PYTHONPATH": ""}
    steps = []
    for step in ("engine-bench", "service-bench", "notebook", "service-smoke"):
        res = subprocess.run([sys.executable, str(kit), step, str(tmp_path), "--fake"], capture_output=True, text=True,
                             timeout=600, env=env)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        steps.append(f"{step}\tok\t1")
    (tmp_path / "steps.tsv").write_text("\n".join(steps) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run([sys.executable, str(kit), "summary", str(tmp_path), str(out), "--dry-run"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["figures"]["fake"] is True and summary["targets"]["judged"] is False
    assert_measures_everything(summary)
