"""A small router-side indexer for the KV-events tests, the directory's expected holder set,
and a seeded workload that exercises every way a holder set changes.

:class:`Subscriber` is what a router does with vLLM's stream: a SUB socket for live
messages, a DEALER on the replay socket to fill gaps (a seq it has not seen follows a
missing one) and to catch up when it joins late; every payload is decoded by vLLM's own
``KVEventBatch`` (strict) and applied to ``holders``: ``(topic, medium, block hash) ->
token ids``. Seqs it already applied are skipped, so a replica that re-publishes from its
checkpoint changes nothing.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import zmq

from blendmatch.index import KeyDirectory
from blendmatch.index.holders import Spot
from blendmatch.service.publish import END_SEQ, medium_of, topic_of
from vllm_events_support import decode_batch

#: bound on any single wait for a socket: guards against a hang, never decides a result
WAIT_MS = 30_000


class Subscriber:
    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: Optional[str], encoding: str, *,
                 legacy: bool = False) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.req = None
        if replay_endpoint:
            self.req = ctx.socket(zmq.DEALER)
            self.req.setsockopt(zmq.LINGER, 0)
            self.req.connect(replay_endpoint)
        self.encoding = encoding
        self.legacy = legacy
        self.last = -1
        self.holders: dict[tuple[str, str, Any], tuple[int, ...]] = {}
        self.stream: list[tuple[bytes, int, bytes]] = []  # what was applied, in order
        self.live = 0
        self.replayed = 0

    def close(self) -> None:
        self.sub.close(0)
        if self.req is not None:
            self.req.close(0)

    def apply(self, topic: bytes, seq: int, payload: bytes, *, live: bool) -> None:
        if seq <= self.last:
            return  # seen (a replay overlap, or a replica re-publishing after a restart)
        assert seq == self.last + 1, f"gap: seq {seq} after {self.last}"
        batch = decode_batch(self.encoding, payload)  # vLLM's own classes, strict
        t = topic.decode()
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                bs = ev.block_size
                assert len(ev.token_ids) == bs * len(ev.block_hashes)
                for k, h in enumerate(ev.block_hashes):
                    key = (t, ev.medium, h)
                    assert key not in self.holders, f"stored twice: {key}"
                    self.holders[key] = tuple(ev.token_ids[k * bs:(k + 1) * bs])
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    del self.holders[(t, ev.medium, h)]  # KeyError: removed what was never stored
            else:
                for key in [k for k in self.holders if k[0] == t]:
                    del self.holders[key]
        self.last = seq
        self.stream.append((topic, seq, payload))
        if live:
            self.live += 1
        else:
            self.replayed += 1

    def replay_from(self, start: int) -> None:
        assert self.req is not None, "no replay endpoint"
        self.req.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert self.req.poll(WAIT_MS), "no replay answer"
            frames = self.req.recv_multipart()
            assert frames[0] == b""
            if self.legacy:
                seq_b, payload = frames[1:]
                topic = None
            else:
                topic, seq_b, payload = frames[1:]
            if seq_b == END_SEQ:
                assert payload == b""
                return
            self.apply(topic, int.from_bytes(seq_b, "big"), payload, live=False)

    def catch_up(self, until_seq: int) -> None:
        """Apply live messages, filling gaps by replay, until ``until_seq`` was applied."""
        while self.last < until_seq:
            if self.sub.poll(200):
                topic, seq_b, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big")
                if seq > self.last + 1:
                    self.replay_from(self.last + 1)
                self.apply(topic, seq, payload, live=True)
            else:  # nothing live (not subscribed yet, or all sent before we joined): ask
                self.replay_from(self.last + 1)


def wire_hash(h: bytes, int_hashes: bool) -> Any:
    return int.from_bytes(h, "big") & 0xFFFFFFFFFFFFFFFF if int_hashes else h


def expected_holders(d: KeyDirectory, int_hashes: bool = False) -> dict[tuple[str, str, Any], tuple[int, ...]]:
    """The directory's holder set through its public reads: every placement of every key
    whose chunk has tokens, as (topic, medium, block hash) -> tokens."""
    out: dict[tuple[str, str, Any], tuple[int, ...]] = {}
    for kp in d.list_keys(limit=None):
        h = kp.key.chunk_hash
        tokens = d.get_token_ids([h])[0]
        if tokens is None:
            continue
        for p in kp.placements:
            spot = Spot(p.instance_id, kp.key.model_name, p.tier, p.backend, p.shared)
            out[(topic_of(spot), medium_of(spot), wire_hash(h, int_hashes))] = tuple(tokens.tolist())
    return out


class Workload:
    """A seeded stream of event requests (and out-of-band fences) over a few instances:
    stores with and without tokens, wrong-length content, re-stores with other content,
    deletes, several ranks (world size 0 too: never claimed), models and salts per chunk, private L1 and L2, shared L2 pools,
    restarts (incarnation bumps), deregistrations and fences."""

    def __init__(self, seed: int, chunk_size: int, *, instances=("gpu-a", "gpu-b", "gpu-c"), n_hashes: int = 40):
        self.rng = random.Random(seed)
        self.chunk = chunk_size
        self.instances = instances
        self.hashes = [self.rng.randbytes(16) for _ in range(n_hashes)]
        self.seq: dict[str, int] = {}
        self.inc: dict[str, int] = {}
        self.step = 0

    def content(self, h: bytes, variant: int) -> list[int]:
        r = random.Random(h + bytes([variant]))
        return [r.randrange(0, 1 << 32) if k % 7 == 0 else r.randrange(0, 60_000) for k in range(self.chunk)]

    def batch(self, inst: str) -> dict[str, Any]:
        rng = self.rng
        self.step += 1
        if rng.random() < 0.05:  # a restart: the next batch fences the instance's L1
            self.inc[inst] = self.inc.get(inst, 0) + 1
            self.seq[inst] = 0
        self.seq[inst] = self.seq.get(inst, 0) + 1
        kind = rng.choice(("store", "store", "store", "delete"))
        tier, shared, backend = rng.choice((("l1", False, "cpu"), ("l1", False, "cpu"), ("l2", True, "redis"),
                                            ("l2", True, "s3"), ("l2", False, "disk")))
        entries = []
        fresh = rng.random() < 0.3
        for k in range(rng.randint(1, 6)):
            h = rng.randbytes(16) if fresh else rng.choice(self.hashes)
            e: dict[str, Any] = {"key": {"chunk_hash_hex": h.hex(), "model_name": rng.choice(("llama", "qwen")),
                                         "kv_rank": rng.choice((1 << 24, (2 << 24) | 1, (2 << 24), 0)),
                                         "cache_salt": rng.choice(("", "", "tenant-x"))}}
            if kind == "store":
                r = rng.random()
                if fresh or r < 0.7:
                    e["token_ids"] = self.content(h, 1 if rng.random() < 0.08 else 0)
                    e["token_offset"] = self.chunk * k
                elif r < 0.8:
                    e["token_ids"] = self.content(h, 0)[: self.chunk // 2]  # wrong length: kept, not indexed
                e["size_bytes"] = 1000 + k
            entries.append(e)
        return {"instance_id": inst, "incarnation": self.inc.get(inst, 0), "seq": self.seq[inst],
                "event_type": kind, "tier": tier, "backend": backend, "shared": shared, "ts": 1_700_000_000.0 + self.step,
                "entries": entries}

    def run(self, d: KeyDirectory, requests: int) -> None:
        """Apply ``requests`` requests (some several at once through ``apply_many``) and the
        occasional deregistration or fence."""
        from blendmatch.index import parse_event_request

        rng = self.rng
        for _ in range(requests):
            r = rng.random()
            if r < 0.03:
                inst = rng.choice(self.instances)
                d.drop_instance(inst)
                self.seq.pop(inst, None)
                self.inc.pop(inst, None)
            elif r < 0.05:
                d.fence_instance(rng.choice(self.instances))
            elif r < 0.25:
                reqs = [parse_event_request({"batches": [self.batch(rng.choice(self.instances))
                                                         for _ in range(rng.randint(1, 3))]}) for _ in range(3)]
                for got in d.apply_many(reqs):
                    assert not isinstance(got, Exception), got
            else:
                d.apply({"batches": [self.batch(rng.choice(self.instances))]})
