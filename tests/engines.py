"""The engines the conformance suite runs against (one registry, one test body per behaviour).

Each entry: ``(id, factory, marks)``. CPU-runnable engines always run; device engines carry
the ``gpu`` mark and skip with a stated reason when no GPU answers a trial launch.

GPU gating (precise on purpose): a test *skips* only when CuPy is missing or no device
answers a trial launch (``cupy_engine.gpu_unavailable_reason``). Once a device answers,
anything else -- a kernel that does not compile, a self-test mismatch -- is a *failure*.
With ``BLENDMATCH_REQUIRE_GPU=1`` (set by ``scripts/gpu_check.sh``) a missing GPU fails too,
so a device validation run can never pass by skipping everything.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import numpy as np
import pytest

from blendmatch.gpu.cpu import CpuEngine
from blendmatch.gpu.engine import Engine
from blendmatch.gpu.reference import ReferenceEngine
from blendmatch.gpu.xp_probe import XpEngine

EngineFactory = Callable[[], Engine]

REQUIRE_GPU_ENV = "BLENDMATCH_REQUIRE_GPU"


@functools.lru_cache(maxsize=1)
def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here (``None`` when a device answered a trial launch)."""
    from blendmatch.gpu.cupy_engine import gpu_unavailable_reason

    return gpu_unavailable_reason()


def gpu_engine_or_skip(kernels: str = "fused") -> Engine:
    """A fresh GPU engine (after its trial launch), or skip the test saying why not."""
    why = gpu_skip_reason()
    if why is not None:
        if os.environ.get(REQUIRE_GPU_ENV) == "1":
            pytest.fail(f"{REQUIRE_GPU_ENV}=1 but no usable GPU: {why}")
        pytest.skip(f"no usable GPU: {why}")
    from blendmatch.gpu.select import create_gpu_engine

    return create_gpu_engine(reason="test", kernels=kernels)


def engine_params() -> list:
    """pytest params for every engine (GPU ones marked ``gpu``)."""
    params = [
        pytest.param(lambda: ReferenceEngine(reason="test"), id="reference"),
        pytest.param(lambda: CpuEngine(reason="test", item_windows=97, parallel_min_windows=0), id="cpu-small-items"),
        pytest.param(lambda: CpuEngine(reason="test"), id="cpu"),
        # The GPU engine's array algorithm and slot mirror, on numpy: always runs.
        pytest.param(lambda: XpEngine(np, reason="test"), id="xp-numpy"),
        pytest.param(lambda: gpu_engine_or_skip("fused"), id="gpu", marks=pytest.mark.gpu),
        pytest.param(lambda: gpu_engine_or_skip("array"), id="gpu-array", marks=pytest.mark.gpu),
    ]
    return params
