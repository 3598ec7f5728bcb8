"""The Grafana dashboard (deploy/grafana/blendmatch.json) queries only metrics that exist.

A real ``blendmatch serve`` (a subprocess on loopback, checkpoints on) gets some traffic
(registration, events, lookups, a routing score, a checkpoint, a rejected request), then
``/metrics`` is scraped and every ``blendmatch_*`` name in every panel's and variable's query
must be a sample name there. Over HTTP push, the ``blendmatch_kafka_*`` names are left for
the second run: a replica in Kafka mode on a real broker (tansu), which must have all of them.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blendmatch.bench.loadtest import spawn_server, stop_server
from kafka_support import Replica, create_topic, kafka_bootstrap  # noqa: F401
from service_support import C, MODEL, b64, chunks, events, store

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "blendmatch.json"
_NAME = re.compile(r"\bblendmatch_[a-z0-9_]+")


def _queries(node: Any) -> Iterator[str]:
    """Every PromQL text in the dashboard: targets' ``expr`` and variables' queries."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str):
                yield v
            elif k == "query" and isinstance(v, str) and "blendmatch_" in v:
                yield v
            else:
                yield from _queries(v)
    elif isinstance(node, list):
        for v in node:
            yield from _queries(v)


def dashboard_names() -> set[str]:
    return {name for q in _queries(json.loads(DASHBOARD.read_text())) for name in _NAME.findall(q)}


def _traffic(client: httpx.Client, wait_applied: bool) -> None:
    rows = chunks(4, seed=42)
    assert client.post("/instances", json={"instance_id": "g1", "ip": "127.0.0.1", "http_port": 1}).status_code == 200
    assert client.post("/events", json=events(store("g1", 1, rows))).status_code == 200
    query = {"tokens_b64": b64(rows.reshape(-1)), "model_name": MODEL}
    deadline = time.monotonic() + 30
    while True:  # Kafka mode applies from the topic: wait until the lookup sees the chunks
        got = client.post("/directory/blend-lookup", json=query).json()["matches"]
        if len(got) == 4 or not wait_applied or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(got) == 4
    assert client.post("/directory/blend-lookup/batch", json={"queries": [query, query]}).status_code == 200
    assert client.post("/route/score", json=query).status_code == 200
    assert client.post("/directory/blend-lookup", json={"model_name": MODEL}).status_code == 422
    assert client.post("/admin/checkpoint").status_code == 200


def _scrape(client: httpx.Client) -> set[str]:
    text = client.get("/metrics").text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_dashboard_is_grafana_json_with_panels():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "blendmatch" and dash["panels"]
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("lookups/s", "p50 / p99", "batch size", "ingest rate", "ingest lag", "duplicates", "prefix",
                  "failovers", "checkpoint age", "readiness"):
        assert topic in titles or topic.replace("lookups/s", "requests/s") in titles, topic
    assert len(dashboard_names()) > 20


def test_every_dashboard_metric_exists_on_a_running_server(tmp_path):
    proc, url = spawn_server(["--engine", "cpu", "--chunk-size", str(C), "--checkpoint-path",
                              str(tmp_path / "ckpt")], log_path=tmp_path / "server.log")
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            _traffic(client, wait_applied=False)
            have = _scrape(client)
    finally:
        stop_server(proc)
    missing = sorted(n for n in dashboard_names() - have if not n.startswith("blendmatch_kafka_"))
    assert not missing, f"dashboard queries metrics the server does not expose: {missing}"


def test_every_kafka_metric_of_the_dashboard_exists_on_a_replica(kafka_bootstrap, tmp_path):  # noqa: F811
    topic = create_topic(kafka_bootstrap, partitions=1)
    replica = Replica(kafka_bootstrap, topic, "dash", f"g-{topic}", str(tmp_path / "ckpt"),
                      log_path=tmp_path / "replica.log")
    try:
        replica.wait_up()
        deadline = time.monotonic() + 60
        while replica.client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        _traffic(replica.client, wait_applied=True)
        have = _scrape(replica.client)
    finally:
        replica.proc.terminate()
        replica.proc.wait(30)
        replica.client.close()
    missing = sorted(dashboard_names() - have)
    assert not missing, f"dashboard queries metrics a Kafka replica does not expose: {missing}"
