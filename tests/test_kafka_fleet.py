"""The fleet transport against a real broker (tansu): two ``blendmatch serve`` replicas
follow one topic written by an LMCache-configured producer, answer identically at the same
position, survive a SIGKILL (restart from the checkpoint: nothing lost, nothing applied
twice), share the registry through the log and hand the reaper role over when its holder
dies. Marked ``kafka``; skipped only when the broker cannot start.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest

from blendmatch.index.key_directory import KeyDirectory
from blendmatch.index.types import pack_kv_rank
from blendmatch.index.wire_models import wire_batch, wire_entry
from blendmatch.service.sources.records import (ControlRecordError, control_value, decode_control, is_control,
                                                lmcache_record_value)
from kafka_support import Replica, create_topic, end_offsets, kafka_bootstrap, lmcache_producer, wait_for  # noqa: F401
from service_support import C, MODEL, b64, hash_of, metric_samples, store
from test_lmcache_compat import lmcache_site  # noqa: F401 - the fixture

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "lmcache"


# ---------------------------------------------------------------------- records (no broker)
def test_lmcache_record_value_is_lmcache_form():
    """A fixture batch re-emitted is byte-identical to LMCache's record (key order, compact)."""
    body = json.loads((FIXTURES / "store.json").read_text())
    batch = body["batches"][0]
    assert lmcache_record_value(batch) == json.dumps({"batches": [batch]}, separators=(",", ":")).encode()
    # omitted defaults are filled in, tokens_b64 becomes token_ids
    short = {"instance_id": "i", "incarnation": 1, "seq": 2, "event_type": "store", "tier": "l1", "backend": "d",
             "entries": [{"key": {"chunk_hash_hex": "ab", "model_name": "m", "kv_rank": 1 << 24},
                          "tokens_b64": b64([1, 2, 3]), "token_offset": 0}]}
    got = json.loads(lmcache_record_value(short))["batches"][0]
    assert list(got) == list(batch)
    assert got["entries"][0] == {"key": {"chunk_hash_hex": "ab", "model_name": "m", "kv_rank": 1 << 24,
                                         "object_group_id": 0, "cache_salt": ""},
                                 "size_bytes": 0, "token_ids": [1, 2, 3], "token_offset": 0}


def test_control_records_decode_and_reject():
    v = control_value("expire", "mp-1", ts=5.0, last=[0, 7])
    assert decode_control(v) == {"op": "expire", "instance_id": "mp-1", "ts": 5.0, "last": [0, 7]}
    assert is_control([("blendmatch", b"registry")]) and not is_control(None) and not is_control([("x", b"y")])
    for bad in (b"", b"[1]", b'{"op":"nope","instance_id":"i","ts":1}', b'{"op":"heartbeat","instance_id":"","ts":1}',
                b'{"op":"register","instance_id":"i","ts":1}', b'{"op":"expire","instance_id":"i","ts":1,"last":[0]}'):
        with pytest.raises(ControlRecordError):
            decode_control(bad)


# ---------------------------------------------------------------------- the fleet scenario
INSTANCES = [f"mp-{i}" for i in range(4)]


def _workload(seed: int, n_batches: int) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Seeded batches per instance (store, then some deletes and accesses), distinct content
    per instance, and queries made of stored chunks."""
    rng = np.random.default_rng(seed)
    batches, contents = [], []
    seqs = dict.fromkeys(INSTANCES, 0)
    for b in range(n_batches):
        inst = INSTANCES[b % len(INSTANCES)]
        seqs[inst] += 1
        first = INSTANCES.index(inst) * 100_000 + b * 10
        kind = "store" if b % 5 else ("delete" if b % 10 == 0 and b else "access")
        if kind == "store" or b == 0:
            rows = rng.integers(0, 50_000, size=(4, C), dtype=np.uint32)
            contents.extend(rows)
            batches.append(store(inst, seqs[inst], rows, first_hash=first, incarnation=100,
                                 offsets=[C * (j + 1) for j in range(4)]))
        else:
            prev = INSTANCES.index(inst) * 100_000 + (b - len(INSTANCES)) * 10
            entries = [wire_entry(hash_of(prev + j), MODEL, pack_kv_rank(1)) for j in range(2)]
            batches.append(wire_batch(inst, seqs[inst], kind, entries, incarnation=100, ts=float(b)))
    queries = [np.concatenate([contents[i] for i in rng.choice(len(contents), 5, replace=False)])
               for _ in range(12)]
    return batches, queries


def _answers(r: Replica, queries: list[np.ndarray]) -> list[Any]:
    body = {"queries": [{"token_ids": q.tolist(), "model_name": MODEL} for q in queries]}
    got = r.client.post("/directory/blend-lookup/batch", json=body)
    assert got.status_code == 200, got.text
    return got.json()["results"]


def _state(r: Replica) -> dict[str, Any]:
    s = r.client.get("/directory/stats").json()
    for volatile in ("batcher", "engine", "registry", "log", "reuse"):  # reuse: this replica's lookups
        s["blendmatch"].pop(volatile, None)
    # the slot table's history counters (rebuilds, mutations) differ after a restore; the
    # table itself, the contents and every answer do not
    for history in ("table_generation", "table_version"):
        s["blendmatch"]["blend"].pop(history, None)
    # every key's access count (ACCESS batches are in the workload): derived from the log
    keys = r.client.get("/directory/keys", params={"limit": 10000}).json()["keys"]
    s["access_counts"] = sorted((repr(sorted(k["key"].items())), k["access_count"]) for k in keys)
    return s


def _reference_answers(batches: list[dict[str, Any]], queries: list[np.ndarray]) -> list[Any]:
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, engine="reference")
    for b in batches:
        d.apply({"batches": [b]})
    from blendmatch.index.types import BlendNamespace

    ns = BlendNamespace(MODEL, "", 1)
    return [{"matches": [{"chunk_hash": m.chunk_hash.hex(), "old_st": m.old_st, "cur_st": m.cur_st}
                         for m in d.blend_match(q, ns)]} for q in queries]


def _produce(producer, topic: str, records: list[tuple[bytes, bytes]], positions: list, pace_s: float = 0.0) -> None:
    def done(err, msg):
        assert err is None, err
        positions.append((msg.partition(), msg.offset()))

    for key, value in records:
        producer.produce(topic, key=key, value=value, on_delivery=done)
        producer.poll(0)
        if pace_s:
            time.sleep(pace_s)
    assert producer.flush(10) == 0


def _wait(cond, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _instances(r: Replica) -> list[str]:
    return sorted(i["instance_id"] for i in r.client.get("/instances").json()["instances"])


@pytest.mark.kafka
def test_two_replicas_agree_survive_sigkill_and_share_the_registry(kafka_bootstrap, tmp_path):
    topic = create_topic(kafka_bootstrap, partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    extra = ("--checkpoint-interval", "0.3", "--health-check-interval", "0.3", "--instance-timeout", "2")
    reps = [Replica(kafka_bootstrap, topic, name, group, str(tmp_path / f"{name}.ckpt"), *extra,
                    log_path=tmp_path / f"{name}.log") for name in ("a", "b")]
    try:
        batches, queries = _workload(7, 160)
        first, second = batches[:80], batches[80:]
        producer = lmcache_producer(kafka_bootstrap)
        positions: list = []
        poison = [(b"mp-0", b"\x00not json"), (b"mp-1", b'{"batches":[{"instance_id":""}]}')]
        _produce(producer, topic, [(b["instance_id"].encode(), lmcache_record_value(b)) for b in first[:40]]
                 + poison + [(b["instance_id"].encode(), lmcache_record_value(b)) for b in first[40:]], positions)
        for r in reps:
            r.wait_up()
        # HTTP in Kafka mode: a bad body is a 422 and appends nothing; a good one is appended
        bad = reps[0].client.post("/events", json={"batches": [{"instance_id": "x"}]})
        assert bad.status_code == 422, bad.text
        extra_batch = store("mp-http", 1, np.random.default_rng(1).integers(0, 50_000, (2, C), dtype=np.uint32),
                            first_hash=900_000, incarnation=5)
        got = reps[0].client.post("/events", json={"batches": [extra_batch]})
        assert got.status_code == 200 and got.json()["published"] == 1, got.text
        rec = got.json()["records"][0]
        positions.append((rec["partition"], rec["offset"]))
        want = end_offsets(positions)
        for r in reps:
            r.wait_position(want)
        all_batches = first + [extra_batch]
        assert _answers(reps[0], queries) == _answers(reps[1], queries) == _reference_answers(all_batches, queries)
        assert _state(reps[0]) == _state(reps[1])
        for r in reps:
            ls = r.log_stats()
            assert ls["records_skipped"] == 2 and ls["records_applied"] == len(all_batches)
            assert r.client.get("/readyz").status_code == 200

        # the registry through the log: register via a, visible on b; expiry by the reaper
        assert reps[0].client.post("/instances", json={"instance_id": "mp-x", "ip": "10.0.0.1",
                                                       "http_port": 8080}).status_code == 200
        _wait(lambda: _instances(reps[1]) == ["mp-x"], 10, "b to see mp-x")
        holder = _wait(lambda: next((r for r in reps if r.log_stats()["reaper_role"]), None), 20, "a reaper")
        other = reps[1 - reps.index(holder)]
        assert other.client.put("/instances/mp-x/heartbeat").status_code == 200
        _wait(lambda: _instances(reps[0]) == _instances(reps[1]) == [], 10, "mp-x to expire everywhere")

        # SIGKILL the reaper holder mid-stream; the other takes the role and keeps consuming
        feeder = threading.Thread(target=_produce, args=(producer, topic, [
            (b["instance_id"].encode(), lmcache_record_value(b)) for b in second], positions, 0.01))
        feeder.start()
        time.sleep(0.4)
        holder.kill()
        feeder.join()
        _wait(lambda: other.log_stats()["reaper_role"], 15, "the reaper role to move")
        assert other.client.post("/instances", json={"instance_id": "mp-y", "ip": "10.0.0.2",
                                                     "http_port": 8080}).status_code == 200
        _wait(lambda: "mp-y" not in _instances(other), 10, "mp-y to expire (new reaper)")
        revived = holder.restart()
        reps[reps.index(holder)] = revived
        revived.wait_up()
        want = end_offsets(positions)
        for r in reps:
            r.wait_position(want)
        _wait(lambda: revived.client.get("/readyz").status_code == 200, 10, "the revived replica to be ready")
        all_batches = first + [extra_batch] + second
        assert _answers(reps[0], queries) == _answers(reps[1], queries) == _reference_answers(all_batches, queries)
        sa, sb = _state(reps[0]), _state(reps[1])
        assert sa == sb
        assert sa["blendmatch"]["events"]["applied"] == len(all_batches) and sa["blendmatch"]["events"]["duplicates"] == 0  # none twice
        assert _instances(reps[0]) == _instances(reps[1]) == []
        # it resumed from its checkpoint, not from the start of the topic
        assert revived.log_stats()["records_applied"] < len(all_batches)
        assert revived.log_stats()["records_skipped"] == 0
    finally:
        for r in reps:
            r.stop()


@pytest.mark.kafka
def test_resume_from_committed_offsets_without_checkpoint(kafka_bootstrap, tmp_path):
    """No checkpoint: a restart resumes at this replica's committed offsets (committed after
    apply), not at the earliest; a fresh replica id starts from the earliest."""
    topic = create_topic(kafka_bootstrap, partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    producer = lmcache_producer(kafka_bootstrap)
    positions: list = []
    rows = np.random.default_rng(3).integers(0, 50_000, (1, C), dtype=np.uint32)
    recs = [(b"mp-0", lmcache_record_value(store("mp-0", s, rows, first_hash=s, incarnation=1))) for s in range(1, 11)]
    _produce(producer, topic, recs[:5], positions)
    r = Replica(kafka_bootstrap, topic, "solo", group, "", log_path=tmp_path / "solo.log")
    try:
        r.wait_up()
        r.wait_position(end_offsets(positions))
        time.sleep(1.3)  # one commit period
        assert r.stop() == 0
        _produce(producer, topic, recs[5:], positions)
        r = r.restart()
        r.wait_up()
        r.wait_position(end_offsets(positions))
        # only the new ones (the count follows the position by a moment: wait, do not race it)
        wait_for(lambda: r.log_stats()["records_applied"] >= 5, 10, "the applied count")
        assert r.log_stats()["records_applied"] == 5
        fresh = Replica(kafka_bootstrap, topic, "fresh", group, "", log_path=tmp_path / "fresh.log")
        try:
            fresh.wait_up()
            fresh.wait_position(end_offsets(positions))
            wait_for(lambda: fresh.log_stats()["records_applied"] >= 10, 10, "the applied count")
            assert fresh.log_stats()["records_applied"] == 10
        finally:
            fresh.stop()
    finally:
        r.stop()


@pytest.mark.kafka
def test_kafka_mode_counts_not_indexable_like_http_mode(kafka_bootstrap, tmp_path):
    """Entries that feed nothing to the blend index reach the same metric, by reason, when
    they come through the log as when they are pushed over HTTP (``POST /events``'s
    ``entries_not_indexable``, here from the directory the HTTP route applies with)."""
    topic = create_topic(kafka_bootstrap, partitions=1)
    rows = np.random.default_rng(11).integers(0, 50_000, (3, C), dtype=np.uint32)
    short = wire_entry(hash_of(50), MODEL, pack_kv_rank(1), size_bytes=8, token_ids=[1, 2, 3], token_offset=0)
    batches = [store("mp-0", 1, rows, incarnation=1, offsets=[0, -1, C]),  # one offset unknown
               store("mp-0", 2, rows[:2], first_hash=20, incarnation=1, world_size=0),  # world size 0
               wire_batch("mp-0", 3, "store", [short], incarnation=1)]  # not a chunk long
    d = KeyDirectory()
    d.enable_blend_lookup(chunk_size=C, engine="reference")
    want: dict[str, int] = {}
    for b in batches:
        for reason, n in d.apply_detailed({"batches": [b]}).not_indexable.items():
            want[reason] = want.get(reason, 0) + n
    assert {k for k, n in want.items() if n} == {"token_offset_unknown", "world_size_0", "wrong_length"}
    positions: list = []
    _produce(lmcache_producer(kafka_bootstrap), topic, [(b"mp-0", lmcache_record_value(b)) for b in batches],
             positions)
    r = Replica(kafka_bootstrap, topic, "ni", f"g-{uuid.uuid4().hex[:8]}", "", log_path=tmp_path / "ni.log")
    try:
        r.wait_up()
        r.wait_position(end_offsets(positions))
        samples = metric_samples(r.client.get("/metrics").text)
        got = {reason: samples.get(f'blendmatch_event_entries_not_indexable_total{{reason="{reason}"}}', 0.0)
               for reason in want}
        assert got == {k: float(n) for k, n in want.items()}, r.tail()
    finally:
        r.stop()


def test_http_mode_needs_no_kafka_client_and_kafka_mode_says_what_is_missing(monkeypatch):
    import subprocess
    import sys

    code = ("import sys; sys.modules['confluent_kafka'] = None\n"
            "from blendmatch.service.app import create_app\n"
            "from blendmatch.service.config import ServiceConfig\n"
            "create_app(ServiceConfig(engine='reference'))\n"
            "from blendmatch.service.sources import KafkaUnavailable\n"
            "try:\n"
            "    create_app(ServiceConfig(engine='reference', event_transport='kafka', kafka_bootstrap_servers='k:1'))\n"
            "except KafkaUnavailable as exc:\n"
            "    print('unavailable:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'blendmatch[kafka]'" in out.stdout
    with pytest.raises(ValueError, match="needs --kafka-bootstrap-servers"):
        from blendmatch.service.config import ServiceConfig

        ServiceConfig(event_transport="kafka")


@pytest.mark.kafka
@pytest.mark.compat
def test_lmcache_kafka_sink_feeds_a_replica(kafka_bootstrap, tmp_path, lmcache_site):
    """LMCache 0.5.6's own KafkaCacheEventSink (its subscriber, its serializer, a real
    producer) writes the fixture workload; a replica applies every record, skips none, and
    answers the blend lookup LMCache's content asks for."""
    from test_lmcache_compat import _drive

    topic = create_topic(kafka_bootstrap, partitions=1)
    got = _drive(lmcache_site, "kafka", f"{kafka_bootstrap}/{topic}")
    assert got["sink_calls"] and all(c == "ok" for c in got["sink_calls"]), got
    r = Replica(kafka_bootstrap, topic, "lm", f"g-{uuid.uuid4().hex[:8]}", "", chunk_size=4,
                log_path=tmp_path / "lm.log")
    try:
        r.wait_up()
        # the subscriber's flushes: config (2 batches), store, access, delete, multi_l2 (3), store again
        _wait(lambda: r.log_stats()["records_applied"] >= 9, 20, "LMCache's records to be applied")
        stats = r.client.get("/directory/stats").json()
        assert stats["blendmatch"]["log"]["records_skipped"] == 0
        assert stats["blendmatch"]["events"]["applied"] == 9 and stats["blendmatch"]["events"]["duplicates"] == 0
        lookup = r.client.post("/directory/blend-lookup", json={"model_name": "Qwen/Qwen3-8B",
                                                                 "token_ids": [7, 101, 102, 103, 104]})
        assert [m["cur_st"] for m in lookup.json()["matches"]] == [1], lookup.text
    finally:
        r.stop()


@pytest.mark.kafka
def test_workers_share_one_port_and_each_follows_the_topic(kafka_bootstrap, tmp_path):
    """``--workers 2``: two replica processes on one port (SO_REUSEPORT). Connections land on
    both; each answers every lookup from its own index, equal to the reference; a batch too
    large for one record is a 413 with nothing appended; SIGTERM stops both, exit 0."""
    import signal
    import subprocess
    import sys

    import httpx

    from kafka_support import ROOT, free_port

    import socket

    topic = create_topic(kafka_bootstrap)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "workers.log"
    for own in range(31_000, 32_000, 2):  # two free consecutive ports for --worker-ports-from
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", own))
                b.bind(("127.0.0.1", own + 1))
            break
        except OSError:
            continue
    ckpt = tmp_path / "node.ckpt"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "blendmatch", "serve", "--workers", "2", "--host", "127.0.0.1", "--port", str(port),
             "--engine", "cpu", "--chunk-size", str(C), "--event-transport", "kafka",
             "--kafka-bootstrap-servers", kafka_bootstrap, "--kafka-topic", topic, "--kafka-group-id", "g",
             "--replica-id", "node", "--kafka-session-timeout-ms", "2000", "--checkpoint-path", str(ckpt),
             "--worker-ports-from", str(own), "--log-level", "info"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        _wait(up, 60, "the workers to listen")
        batches, queries = _workload(5, 15)
        want = _reference_answers(batches, queries)
        assert httpx.post(f"{url}/events", json={"batches": batches}, timeout=30).status_code == 200

        seen: dict[str, int] = {}

        def both_answer() -> bool:
            with httpx.Client(base_url=url, timeout=30) as c:  # a new connection: the kernel picks a worker
                rid = c.get("/directory/stats").json()["blendmatch"]["log"]["replica_id"]
                body = {"queries": [{"token_ids": q.tolist(), "model_name": MODEL} for q in queries]}
                got = c.post("/directory/blend-lookup/batch", json=body)
                if got.status_code == 503:  # this worker has not caught up yet: it says so
                    assert "not ready yet" in got.json()["detail"]
                    return False
                if got.json()["results"] == want:
                    seen[rid] = seen.get(rid, 0) + 1
            return set(seen) == {"node-w0", "node-w1"}

        _wait(both_answer, 60, f"both workers to answer (seen {seen})")
        for i in range(2):  # each worker alone on its own port: per-worker scrapes and probes
            st = httpx.get(f"http://127.0.0.1:{own + i}/directory/stats", timeout=10).json()
            assert st["blendmatch"]["log"]["replica_id"] == f"node-w{i}"
            assert httpx.get(f"http://127.0.0.1:{own + i}/readyz", timeout=10).status_code == 200

        big = store("i-big", 1, np.full((4000, C), 4_000_000_000, dtype=np.uint32), first_hash=900_000,
                    incarnation=100)
        with httpx.Client(base_url=url, timeout=30) as c:
            before = c.get("/directory/stats").json()["blendmatch"]["log"]["position"]
            got = c.post("/events", json={"batches": [batches[0], big]})
            assert got.status_code == 413 and "batch 1" in got.json()["detail"], got.text
            time.sleep(0.5)
            assert c.get("/directory/stats").json()["blendmatch"]["log"]["position"] == before  # nothing appended
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log_path.read_text()[-3000:]
    assert (tmp_path / "node.ckpt.w0").exists() and (tmp_path / "node.ckpt.w1").exists()


@pytest.mark.kafka
def test_workers_stop_when_their_parent_is_killed(kafka_bootstrap, tmp_path):
    """SIGKILL of the parent (no chance to forward anything): the workers get SIGTERM from
    the kernel (PR_SET_PDEATHSIG) and stop, so none is left holding the port."""
    import subprocess
    import sys

    import httpx

    from kafka_support import ROOT, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "blendmatch", "serve", "--workers", "2", "--host", "127.0.0.1",
                             "--port", str(port), "--engine", "cpu", "--event-transport", "kafka",
                             "--kafka-bootstrap-servers", kafka_bootstrap, "--kafka-topic", create_topic(kafka_bootstrap),
                             "--replica-id", "k"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    _wait(up, 60, "the workers to listen")
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                               text=True).stdout.split()]
    assert len(children) == 2
    proc.kill()
    proc.wait()

    def gone() -> bool:
        alive = []
        for pid in children:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":  # a zombie has stopped; who reaps it is not the point here
                alive.append(pid)
        return not alive

    _wait(gone, 40, "the workers to stop after their parent died")
    assert not up()
