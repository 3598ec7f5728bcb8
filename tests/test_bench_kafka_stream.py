"""bench/kafka_stream.py: the compose fleet's event generator writes records that blendmatch
applies as LMCache's own sink's (parsed by the one event parser; applied by a real replica
from a real broker, tansu)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest

from blendmatch.bench.kafka_stream import records
from blendmatch.index.wire import parse_event_body
from kafka_support import ROOT, Replica, create_topic, kafka_bootstrap  # noqa: F401


def test_records_are_lmcache_store_batches_with_consecutive_seqs_per_instance():
    seen: dict[str, list[int]] = {}
    hashes = set()
    for key, value in itertools.islice(records(entries=3, instances=2, chunk_size=16, model="m", repeat=0.5, seed=7), 6):
        req = parse_event_body(value)  # the POST /events parser: LMCache's record value is that body
        (batch,) = json.loads(value)["batches"]
        assert key.decode() == batch["instance_id"]
        assert batch["event_type"] == "store" and len(batch["entries"]) == 3
        assert all(len(e["token_ids"]) == 16 for e in batch["entries"])
        seen.setdefault(batch["instance_id"], []).append(batch["seq"])
        hashes.update(e["key"]["chunk_hash_hex"] for e in batch["entries"])
        assert req is not None
    assert seen == {"mp-0": [1, 2, 3], "mp-1": [1, 2, 3]}
    assert len(hashes) == 18  # never a hash twice


@pytest.mark.kafka
def test_a_replica_applies_every_record_the_generator_wrote(kafka_bootstrap, tmp_path):  # noqa: F811
    topic = create_topic(kafka_bootstrap)
    gen = subprocess.run([sys.executable, "-m", "blendmatch.bench.kafka_stream", "--bootstrap", kafka_bootstrap,
                          "--topic", topic, "--records", "8", "--entries", "3", "--chunk-size", "16",
                          "--instances", "2", "--rate", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    assert "done, 8 records, 24 entries" in gen.stderr
    r = Replica(kafka_bootstrap, topic, "gen-r1", "g-gen", str(tmp_path / "r1.ckpt"), log_path=tmp_path / "r1.log")
    try:
        r.wait_up()
        r.wait_position({"0": 8})
        stats = r.log_stats()
        assert stats["records_applied"] == 8 and stats["records_skipped"] == 0, stats
    finally:
        r.stop()
