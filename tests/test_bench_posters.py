"""``bench/posters.py``: the posters' bodies joined from pre-encoded parts are, byte for
byte, the formatter's (``events_body`` over ``entry_text``), and the server takes them."""

from __future__ import annotations

import json

from blendmatch.bench.loadgen import post_request
from blendmatch.bench.posters import StoreBodies, entry_text, events_body


def _reference(maker: StoreBodies, first: int, seq: int, batch: int) -> bytes:
    entries = [entry_text(n, "%d,%s" % (n % 4_000_000_000, maker.tails[n % 1024]), 0) for n in range(first, first + batch)]
    return post_request(maker.host, "/events", events_body(maker.instance, seq, entries))


def test_bodies_are_the_formatters_bytes_and_valid_json() -> None:
    first = (7 << 36) + 1020  # crosses the 1,024 tails' wrap
    maker = StoreBodies("127.0.0.1:9", "poster-0", 16, first, seed=5)
    n, seq = first, 1
    for batch in (1, 64, 3, 1000):
        got = maker.next(batch)
        assert got == _reference(maker, n, seq, batch)
        body = json.loads(got.split(b"\r\n\r\n", 1)[1])
        entries = body["batches"][0]["entries"]
        assert len(entries) == batch and len(entries[0]["token_ids"]) == 16
        assert entries[0]["key"]["chunk_hash_hex"] == "%032x" % n
        n, seq = n + batch, seq + 1
