"""Hostile input, generated from the committed contract: schemathesis against the app over a
real loopback socket, with ``docs/openapi.json`` (the file clients read) as the schema.

Every operation gets up to ``SCHEMATHESIS_EXAMPLES`` examples (environment variable; 25 by
default, so the whole run stays well under a minute on 2 cores), positive and negative, with
schemathesis' default checks: no 5xx, every status code documented, every response body
conforming, schema-valid bodies accepted and schema-invalid ones refused.

One deliberate deviation, filtered out and tested on its own below: JSON Schema calls ``2.0``
an integer, and schemathesis sends whole floats for integer fields to check that; the service
is strict (``2.0`` is not a world size, a rank or a token id: docs/service.md), which a
JSON Schema cannot say. ``test_whole_floats_are_not_integers`` pins that choice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from blendmatch.service.app import create_app  # noqa: E402
from service_support import config, served  # noqa: E402
from test_service_e2e import ServerThread  # noqa: E402

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"
EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "25"))

schema = schemathesis.openapi.from_path(str(SCHEMA_FILE))


def _has_whole_float(value: Any) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(_has_whole_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_whole_float(v) for v in value)
    return False


@schema.hook
def filter_body(context, body):  # noqa: ANN001 - schemathesis' hook signature
    return not _has_whole_float(body)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def base_url():
    # reference engine: no numba compilation in the loop; the contract does not depend on it
    with ServerThread(create_app(config(engine="reference"))) as url:
        yield url


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_contract_holds_under_generated_input(case, base_url):
    response = case.call(base_url=base_url)
    # The one designed 5xx: the token_ids form of /directory/lookup is 501 (documented; no
    # token hasher here, docs/lmcache.md). Every other check still applies to it.
    excluded = [not_a_server_error] if case.path == "/directory/lookup" and response.status_code == 501 else []
    case.validate_response(response, excluded_checks=excluded)


@pytest.mark.anyio
async def test_whole_floats_are_not_integers():
    async with served() as (client, _):
        r = await client.post("/directory/blend-lookup", json={"token_ids": [1], "model_name": "m", "world_size": 2.0})
        assert r.status_code == 422 and "world_size" in r.json()["detail"]
        r = await client.post("/directory/blend-lookup", json={"token_ids": [1.0], "model_name": "m"})
        assert r.status_code == 422
