"""``decode_event_json`` equals ``from_json`` (token lists as uint32 arrays), and gives up
(falling back to ``from_json``, same errors) on anything that is not a strict id list."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic_core import from_json

from blendmatch.index.json_tokens import decode_event_json


def _plain(doc):
    """Arrays back to lists, for comparison with from_json's output."""
    if isinstance(doc, dict):
        return {k: _plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_plain(v) for v in doc]
    if isinstance(doc, np.ndarray):
        assert doc.dtype == np.uint32 and not doc.flags.writeable
        return doc.tolist()
    return doc


def _doc(rng, n_batches=3):
    batches = []
    for b in range(n_batches):
        entries = []
        for e in range(int(rng.integers(0, 5))):
            entry = {"key": {"chunk_hash_hex": "ab" * 4, "model_name": rng.choice(['m', 'tok"en_ids', '"token_ids":[1]',
                                                                                  'a\\"token_ids\\":[', 'é']),
                             "kv_rank": 1 << 24}, "size_bytes": 3, "token_offset": 0}
            if rng.random() < 0.8:
                entry["token_ids"] = rng.integers(0, 2**32, int(rng.integers(0, 9)), dtype=np.uint64).tolist()
            entries.append(entry)
        batches.append({"instance_id": "token_ids", "seq": b + 1, "entries": entries})
    return {"batches": batches}


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("compact", [True, False])
def test_equals_from_json(seed, compact):
    doc = _doc(np.random.default_rng(seed))
    raw = json.dumps(doc, separators=(",", ":") if compact else (", ", ": "), ensure_ascii=seed % 2 == 0).encode()
    assert _plain(decode_event_json(raw)) == from_json(raw) == doc


@pytest.mark.parametrize("text", [
    '{"batches":[{"entries":[{"token_ids":[1,-2]}]}]}',
    '{"batches":[{"entries":[{"token_ids":[1,2.5]}]}]}',
    '{"batches":[{"entries":[{"token_ids":[1e3]}]}]}',
    '{"batches":[{"entries":[{"token_ids":[4294967296]}]}]}',
    '{"batches":[{"entries":[{"token_ids":[0, 7]}, {"token_ids":0}]}]}',
    '{"batches":[{"entries":[{"token_ids":[1,2,]}]}]}',
    '{"batches":[{"entries":[{"token_ids":[01]}]}]}',
    '{"batches":[{"entries":[{"token_ids":[1 2]}]}]}',
    '{"batches":[{"entries":[{"token_ids":[1,2]',
    '{"batches":[{"entries":[{"token_ids":"x"}]}], "token_ids":[5]}',
])
def test_falls_back_to_from_json(text):
    raw = text.encode()
    try:
        want = from_json(raw)
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc)[:20]):
            decode_event_json(raw)
        return
    assert _plain(decode_event_json(raw)) == want
