"""The committed OpenAPI schema (docs/openapi.json) is the HTTP contract: no silent drift."""

from __future__ import annotations

import json
from pathlib import Path

from blendmatch.service.openapi import REGENERATE, current_schema, render

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"


def test_committed_schema_matches_the_app():
    assert SCHEMA_FILE.exists(), f"docs/openapi.json is missing; create it with: {REGENERATE}"
    committed = SCHEMA_FILE.read_text()
    current = render(current_schema())
    assert committed == current, (
        f"the app's OpenAPI schema drifted from docs/openapi.json; if the change is intended, "
        f"regenerate it with: {REGENERATE}")


def test_schema_documents_every_endpoint():
    paths = json.loads(SCHEMA_FILE.read_text())["paths"]
    want = {("post", "/events"), ("post", "/directory/blend-lookup"), ("post", "/directory/blend-lookup/batch"),
            ("post", "/directory/lookup"), ("get", "/directory/keys"), ("get", "/directory/stats"),
            ("delete", "/instances/{instance_id}"), ("get", "/healthz"), ("get", "/metrics")}
    have = {(m, p) for p, ops in paths.items() for m in ops}
    assert want <= have, want - have
    body = paths["/events"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/EventRequestModel"}
