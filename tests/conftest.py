"""Shared fixtures: the engine registry (tests/engines.py) and deterministic seeds."""

from __future__ import annotations

import numpy as np
import pytest

from engines import engine_params


@pytest.fixture(params=engine_params())
def engine(request):
    """Every engine the conformance suite covers; one test body runs under each."""
    eng = request.param()
    yield eng
    eng.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)
