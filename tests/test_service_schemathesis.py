"""Hostile input, generated from the committed contract: schemathesis against the app over a
real loopback socket, with ``docs/openapi.json`` (the file clients read) as the schema.

Every operation gets up to ``EXAMPLES`` examples (25 in CI, so the whole run stays well
under a minute on 2 cores), positive and negative, with every check schemathesis has (not
only its default set): no 5xx, every status code documented, every response body
conforming, schema-valid bodies accepted and schema-invalid ones refused.

Nothing is filtered out: JSON Schema calls ``2.0`` an integer and so does the service (as
LMCache's models do), and the token form of ``/directory/lookup`` is answered here (its
LMCache 400s are expected statuses of that operation: ``LOOKUP_ACCEPTS``).

The deep run (docs/service.md): ``BLENDMATCH_DEEP_SCHEMATHESIS=1`` gives every operation
``DEEP_EXAMPLES`` (1,000), or ``SCHEMATHESIS_EXAMPLES`` any other number. The examples are
derandomized (a fixed seed), so a run is repeatable. Operations with nothing to vary
(``GET /healthz``, ``GET /directory/stats``, ...) run once whatever the setting: there is
one request to make.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import CHECKS, load_all_checks  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402

from blendmatch.service.app import create_app  # noqa: E402
from service_support import config, served  # noqa: E402
from test_service_e2e import ServerThread  # noqa: E402

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"
#: Examples per operation in CI (the whole run well under a minute on 2 cores) and deep.
CI_EXAMPLES, DEEP_EXAMPLES = 25, 1000
EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES")
               or (DEEP_EXAMPLES if os.environ.get("BLENDMATCH_DEEP_SCHEMATHESIS") == "1" else CI_EXAMPLES))

#: The one adjustment of a check, not a filter: schema-valid token-form lookups may be
#: LMCache's 400s, semantic rules JSON Schema does not state (a cache_salt with ``@ / \\
#: NUL`` or over 128 characters, ``@`` in a model name, an id the hash cannot take, the
#: token and resolved-key caps; docs/service.md). The 400 must still be documented and its
#: body conform; every other operation keeps schemathesis's own list.
LOOKUP_ACCEPTS = ["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]
CONFIG = SchemathesisConfig.from_dict({"operations": [{
    "include-path": "/directory/lookup", "include-method": "POST",
    "checks": {"positive_data_acceptance": {"expected-statuses": LOOKUP_ACCEPTS}}}]})
schema = schemathesis.openapi.from_path(str(SCHEMA_FILE), config=CONFIG)
load_all_checks()
#: Every check schemathesis has, not only those its configuration enables by default.
ALL_CHECKS = list(CHECKS.get_all())


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
    case.validate_response(response, checks=ALL_CHECKS)


@pytest.mark.anyio
async def test_whole_floats_are_integers_and_nothing_else_is():
    async with served() as (client, _):
        r = await client.post("/directory/blend-lookup", json={"token_ids": [1.0], "model_name": "m", "world_size": 2.0})
        assert r.status_code == 200
        for bad in ({"world_size": 2.5}, {"world_size": "2"}, {"world_size": True}, {"token_ids": [1.5]},
                    {"token_ids": ["1"]}):
            r = await client.post("/directory/blend-lookup", json={"token_ids": [1], "model_name": "m", **bad})
            assert r.status_code == 422, bad
