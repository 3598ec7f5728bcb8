"""blendmatch against LMCache 0.5.6's real coordinator app (``create_app`` from its wheel, in a
subprocess, ``tests/lmcache_driver.py coordinator``): the same requests to both, compared.

1. **Numbers.** One corpus of bodies, every integer field of every endpoint an MP server or
   a tool sends, each given as an integer, an integral float (``870926.0``, ``1e3``), a
   fractional float, ``null``, a negative, a huge integer (``2**64``), a huge float
   (``1e30``, ``1e400``), a string of digits, a boolean, and at and beyond its bounds:
   accept (2xx) / reject (4xx) must agree body for body, on the fast paths (a real uvicorn
   socket, so ``service/fastpath.py`` answers ``/events`` and the blend lookups) as on the
   routes; each blend lookup also goes to our batch endpoint as a one-query batch. The
   deliberate exceptions (docs/lmcache.md) are checked as exceptions: a string or a boolean
   where an integer goes (LMCache's lax pydantic reads ``"5"`` and ``true``; JSON Schema, our
   OpenAPI contract, does not), and integers beyond the width we store (int64; kv_rank
   uint32) are a 422 here. Where LMCache answers 500, we must answer 4xx.
2. **Token-form lookups.** Both fed the same events (keys from LMCache's own token hasher,
   several object groups and world sizes), then the same ``POST /directory/lookup`` token
   bodies (full sequences, short ones, bad names and salts): same status, same resolved keys,
   same placements and token ids.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from blendmatch.index.token_hasher import TokenHasher, vllm_none_hash_seed
from blendmatch.service.config import ServiceConfig
from test_lmcache_compat import DRIVER, ROOT, LiveServer, lmcache_site  # noqa: F401 - the fixture
from test_token_hasher import vllm_site  # noqa: F401 - the fixture

pytestmark = pytest.mark.compat

CHUNK = 8


def _lmcache_answers(site: Path, config: dict, requests: list, tmp_path: Path,
                     extra_path: Sequence[Path] = ()) -> list:
    spec = tmp_path / "requests.json"
    spec.write_text(json.dumps({"config": config, "requests": requests}))
    path = [str(site), *map(str, extra_path), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    got = subprocess.run([sys.executable, str(DRIVER), str(site), "coordinator", str(spec)], capture_output=True,
                         text=True, timeout=600, env=env, cwd=str(ROOT))
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def _our_answers(requests: list, **config: Any) -> list:
    cfg = ServiceConfig(host="127.0.0.1", engine="cpu", health_check_interval=0, **config)
    out = []
    with LiveServer(cfg) as live, httpx.Client(base_url=live.url, timeout=60) as client:
        for method, path, body in requests:
            if isinstance(body, str):
                r = client.request(method, path, content=body.encode(), headers={"content-type": "application/json"})
            else:
                r = client.request(method, path, json=body)
            try:
                parsed = r.json()
            except ValueError:
                parsed = r.text
            out.append([r.status_code, parsed])
    return out


# ----------------------------------------------------------------------------- the numbers corpus
def _kv_rank(ws: int, rank: int = 0) -> int:
    return (ws << 24) | (rank << 16) | (ws << 8) | rank


def _event_body(seq: int = 1, **patch: Any) -> dict:
    entry = {"key": {"chunk_hash_hex": "aa", "model_name": "m", "kv_rank": _kv_rank(1), "object_group_id": 0,
                     "cache_salt": ""}, "size_bytes": 64, "token_ids": [1, 2, 3], "token_offset": 0}
    batch = {"instance_id": "node-a", "incarnation": 1, "seq": seq, "event_type": "store", "tier": "l1",
             "backend": "dram", "entries": [entry], "shared": False, "ts": 0.0, "capacity_bytes": 0,
             "capacity_revision": 0}
    body = {"batches": [batch]}
    for path, value in patch.items():
        _set(body, path, value)
    return body


def _set(body: dict, path: str, value: Any) -> None:
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = body
    for p in parents:
        node = node[p]
    node[last] = value


#: (endpoint, field path, a valid integer value, the smallest valid value or None, the largest
#: valid value or None)
FIELDS = [
    ("events", "batches.0.incarnation", 870926, 0, None),
    ("events", "batches.0.seq", 870926, 1, None),
    ("events", "batches.0.capacity_bytes", 4096, 0, None),
    ("events", "batches.0.capacity_revision", 3, 0, None),
    ("events", "batches.0.entries.0.size_bytes", 64, 0, None),
    ("events", "batches.0.entries.0.token_offset", 256, -1, None),
    ("events", "batches.0.entries.0.token_ids.0", 7, None, None),
    ("events", "batches.0.entries.0.key.kv_rank", _kv_rank(2), None, None),
    ("events", "batches.0.entries.0.key.object_group_id", 1, 0, None),
    ("instances", "http_port", 244, 1, 65535),
    ("instances", "mq_port", 5555, 0, 65535),
    ("lookup-keys", "keys.0.kv_rank", _kv_rank(2), None, None),
    ("lookup-keys", "keys.0.object_group_id", 2, 0, None),
    ("lookup-tokens", "world_size", 2, 1, None),
    ("lookup-tokens", "token_ids.0", 7, None, None),
    ("blend-lookup", "world_size", 2, 1, None),
    ("blend-lookup-ids", "world_size", 2, 1, None),  # token_ids on a blend lookup are ours (batch test below)
]


def _deliberate(case: str) -> str | None:
    """Why a case is a deliberate difference (docs/lmcache.md), or None: then both servers
    must agree. In each, LMCache accepts and we answer 422."""
    endpoint, path, kind = case.split(":")
    token_id = path.startswith("token_ids.") or ".token_ids." in path
    if endpoint == "keys":
        return None  # query strings: both read them the same way
    if kind in ("true", "false") and endpoint == "events" and token_id:
        return None  # an event's ids take booleans as 0/1, as LMCache does (WholeInts: no per-id check)
    if kind in ("string", "string-float", "true", "false"):
        return "JSON Schema calls no string or boolean an integer; LMCache's lax pydantic takes them"
    if token_id:
        return None  # ids of any size are taken by both (an event's fill no binding)
    stored = endpoint in ("events", "lookup-keys")  # fields of a key or a batch (world_size is neither)
    if stored and (kind in ("huge", "huge-negative") or (path.endswith("kv_rank") and kind.startswith("negative"))):
        return "outside the fixed width we store (int64; kv_rank is LMCache's uint32 packing)"
    return None


def _base(endpoint: str) -> tuple[str, dict]:
    if endpoint == "events":
        return "/events", _event_body()
    if endpoint == "instances":
        return "/instances", {"instance_id": "mp-n", "ip": "10.0.0.1", "http_port": 8000, "mq_port": 0}
    if endpoint == "lookup-keys":
        return "/directory/lookup", {"keys": [{"chunk_hash_hex": "aa", "model_name": "m", "kv_rank": _kv_rank(1),
                                               "object_group_id": 0, "cache_salt": ""}]}
    if endpoint == "lookup-tokens":
        return "/directory/lookup", {"token_ids": list(range(1, 2 * CHUNK + 3)), "model_name": "m", "world_size": 1,
                                     "cache_salt": ""}
    if endpoint == "blend-lookup-ids":
        return "/directory/blend-lookup", {"token_ids": list(range(1, CHUNK + 3)), "model_name": "m",
                                           "world_size": 1, "cache_salt": ""}
    return "/directory/blend-lookup", {"tokens_b64": "AQAAAAIAAAA=", "model_name": "m", "world_size": 1,
                                       "cache_salt": ""}


def _variants(value: int, lowest: int | None, highest: int | None) -> list[tuple[str, str]]:
    """``(name, JSON text)``: the value in every form a client might send, and the bounds."""
    out = [("int", str(value)), ("integral-float", f"{value}.0"), ("exponent", f"{value}e0"),
           ("fractional", f"{value}.5"), ("null", "null"), ("negative", str(-value)),
           ("negative-float", f"-{value}.0"), ("huge", str(2**64)), ("huge-negative", str(-(2**63) - 1)),
           ("huge-float", "1e30"), ("beyond-double", "1e400"), ("string", json.dumps(str(value))),
           ("string-float", json.dumps(f"{value}.0")), ("true", "true"), ("false", "false")]
    if lowest is not None:
        out += [("lowest", str(lowest)), ("lowest-float", f"{lowest}.0"), ("below", str(lowest - 1)),
                ("below-float", f"{lowest - 1}.0"),
                ("below-fractional", f"{lowest}.25" if lowest >= 0 else f"{lowest - 1}.5")]
        if lowest == 0:
            out.append(("negative-zero", "-0.0"))
    if highest is not None:
        out += [("highest-float", f"{highest}.0"), ("above", str(highest + 1)), ("above-float", f"{highest + 1}.0")]
    return out


def _corpus() -> list[tuple[str, str, str, str]]:
    """``(case id, method, path, raw JSON body)``."""
    cases = []
    for endpoint, path_in_body, value, lowest, highest in FIELDS:
        url, base = _base(endpoint)
        marker = "__VALUE__"
        body = copy.deepcopy(base)
        _set(body, path_in_body, marker)
        text = json.dumps(body)
        for name, literal in _variants(value, lowest, highest):
            cases.append((f"{endpoint}:{path_in_body}:{name}", "POST", url, text.replace(f'"{marker}"', literal)))
    # query parameters of GET /directory/keys (strings on the wire, read as integers by both)
    for name, query in (("int", "offset=1&limit=2"), ("integral-float", "offset=1.0&limit=2.0"),
                        ("fractional", "offset=1.5"), ("negative", "offset=-1"), ("limit-0", "limit=0"),
                        ("limit-max", "limit=10000"), ("limit-above", "limit=10001"), ("huge", f"offset={2**64}"),
                        ("exponent", "limit=1e2"), ("word", "limit=two"), ("true", "limit=true")):
        cases.append((f"keys:query:{name}", "GET", f"/directory/keys?{query}", ""))
    return cases


def _batch_of(single_body: str) -> str:
    """The same query as the only one of a ``/directory/blend-lookup/batch`` body (ours)."""
    return '{"queries": [%s]}' % single_body


def test_numbers_are_accepted_and_refused_as_lmcache_does(lmcache_site, tmp_path):
    """Every form of every integer field, to both servers; blend lookups also as one-query
    batches to ours (LMCache has no batch endpoint: each query must fare as LMCache's single
    lookup does). The only disagreements allowed are the deliberate ones (``_deliberate``),
    and a 4xx here where LMCache answers 500."""
    cases = _corpus()
    requests = [[method, path, body if method == "POST" else None] for _, method, path, body in cases]
    theirs = _lmcache_answers(lmcache_site, {"chunk_size": CHUNK, "enable_blend_lookup": True}, requests, tmp_path)
    batched = [i for i, (_, _, path, _) in enumerate(cases) if path == "/directory/blend-lookup"]
    ours_all = _our_answers(requests + [["POST", "/directory/blend-lookup/batch", _batch_of(cases[i][3])]
                                        for i in batched], chunk_size=CHUNK)
    ours, ours_batch = ours_all[: len(cases)], dict(zip(batched, ours_all[len(cases):], strict=True))
    disagree, exceptions, their_500s = [], [], []
    for i, ((case, *_), (their_status, their_body), (our_status, our_body)) in enumerate(zip(cases, theirs, ours,
                                                                                            strict=True)):
        assert our_status < 500, (case, our_status, our_body)
        if i in ours_batch:
            batch_status = ours_batch[i][0]
            assert batch_status < 500 and (batch_status < 300) == (our_status < 300), (case, ours_batch[i])
        if their_status >= 500:
            # LMCache fails (1e400 is inf, which its 422 body cannot serialize; a huge
            # world_size or an id blake3 cannot pack breaks its token-form lookup): a 4xx here
            assert our_status in (400, 422), (case, their_status, our_status, our_body)
            their_500s.append(case)
        elif _deliberate(case) is not None:
            assert our_status == 422, (case, our_status, our_body)
            if their_status < 300:
                exceptions.append(case)
        elif (their_status < 300) != (our_status < 300):
            disagree.append((case, their_status, their_body, our_status, our_body))
    assert disagree == [], "\n".join(map(str, disagree))
    assert len(cases) - len(exceptions) - len(their_500s) >= 240 and len(exceptions) >= 70 and len(their_500s) >= 20
    # the whole corpus means something: integral floats accepted, fractional ones refused, by both
    by_case = {case: (t[0], o[0]) for (case, *_), t, o in zip(cases, theirs, ours, strict=True)}
    assert by_case["events:batches.0.seq:integral-float"] == (200, 200)
    assert by_case["instances:http_port:integral-float"][1] == 200
    assert by_case["blend-lookup:world_size:integral-float"] == (200, 200)
    assert by_case["events:batches.0.seq:fractional"] == (422, 422)
    assert by_case["events:batches.0.seq:below-float"] == (422, 422)
    assert by_case["instances:http_port:above-float"] == (422, 422)
    assert by_case["blend-lookup:world_size:huge-float"] == (422, 422)  # 1e30: beyond int64 as a float
    assert by_case["events:batches.0.entries.0.token_ids.0:huge-float"] == (422, 422)
    assert by_case["events:batches.0.entries.0.token_ids.0:huge"] == (200, 200)  # an integer literal: any size


def test_the_batch_endpoint_takes_numbers_as_the_single_one_does():
    """Ours only (LMCache has no batch endpoint): each query of a batch accepts and refuses
    exactly what the single endpoint does, and token_ids items follow LMCache's token_ids."""
    # (JSON text of world_size, of token_ids, accepted)
    queries = [(w, "[1, 2]", ok) for w, ok in (('"2"', False), ("2.0", True), ("2.5", False), ("0.0", False),
                                                ("1e0", True), ("true", False))]
    queries += [(w, "[1, 2]", False) for w in ("null", "-2", "1e30", "1e400", "false")]
    queries += [("18446744073709551616", "[1, 2]", True)]  # an integer literal: any size, as in LMCache
    queries += [("1", ids, ok) for ids, ok in (("[1.0, 2]", True), ("[1.5]", False), ("[true]", False),
                                               ('["1"]', False), ("[4294967295.0]", True),
                                               ("[4294967296.0]", False), ("[-1.0]", False), ("[null]", False),
                                               ("[-1]", False), ("[18446744073709551616]", False),
                                               ("[1e30]", False), ("[1e400]", False), ("[false]", False))]
    requests = []
    for world_size, token_ids, _ in queries:
        text = '{"token_ids": %s, "model_name": "m", "world_size": %s}' % (token_ids, world_size)
        requests.append(["POST", "/directory/blend-lookup", text])
        requests.append(["POST", "/directory/blend-lookup/batch", '{"queries": [%s]}' % text])
    ours = _our_answers(requests, chunk_size=CHUNK)
    for i, (*q, ok) in enumerate(queries):
        single, batch = ours[2 * i][0], ours[2 * i + 1][0]
        assert (single == 200) == ok and (batch == 200) == ok, (q, single, batch, ours[2 * i][1])
        assert single in (200, 422) and batch in (200, 422)


# ----------------------------------------------------------------------------- token-form lookups
def _lookup_cases(rng: np.random.Generator, hasher: TokenHasher) -> tuple[list, list]:
    """Events storing keys LMCache's servers would name (the hasher's chunk hashes), and the
    token-form lookups to compare."""
    seqs = [rng.integers(0, 150_000, size=n).tolist() for n in (3 * CHUNK + 5, 2 * CHUNK, 4 * CHUNK)]
    events = []
    seq_no = 0
    for i, tokens in enumerate(seqs):
        ws = 1 if i != 1 else 2
        hashes = hasher.chunk_hashes(tokens)
        entries = []
        for k, h in enumerate(hashes[: len(hashes) - (i == 2)]):  # the last sequence: its last chunk not stored
            for rank in range(ws):
                for group in ((0, 1) if i == 0 and k == 0 else (0,)):
                    entries.append({"key": {"chunk_hash_hex": h.hex(), "model_name": "m", "kv_rank": _kv_rank(ws, rank),
                                            "object_group_id": group, "cache_salt": "s" if i == 2 else ""},
                                    "size_bytes": 100 + k, "token_ids": tokens[k * CHUNK:(k + 1) * CHUNK],
                                    "token_offset": k * CHUNK})
        seq_no += 1
        events.append(["POST", "/events", {"batches": [{"instance_id": "node-a", "incarnation": 1, "seq": seq_no,
                                                         "event_type": "store", "tier": "l1", "backend": "dram",
                                                         "entries": entries}]}])
    # an L2 copy of the first sequence's second chunk, and a deleted key
    h1 = hasher.chunk_hashes(seqs[0])[1].hex()
    key1 = {"chunk_hash_hex": h1, "model_name": "m", "kv_rank": _kv_rank(1), "object_group_id": 0, "cache_salt": ""}
    events.append(["POST", "/events", {"batches": [{"instance_id": "node-b", "incarnation": 3, "seq": 1,
                                                     "event_type": "store", "tier": "l2", "backend": "fs",
                                                     "entries": [{"key": key1, "size_bytes": 9}]}]}])
    seq_no += 1
    h2 = hasher.chunk_hashes(seqs[0])[2].hex()
    events.append(["POST", "/events", {"batches": [{"instance_id": "node-a", "incarnation": 1, "seq": seq_no,
                                                     "event_type": "delete", "tier": "l1", "backend": "dram",
                                                     "entries": [{"key": dict(key1, chunk_hash_hex=h2)}]}]}])
    # ACCESS batches: a key accessed twice in one batch and again later, a key of object
    # group 1, an unknown key (a no-op), and the deleted key (gone: a no-op as well)
    h0 = hasher.chunk_hashes(seqs[0])[0].hex()
    key0 = dict(key1, chunk_hash_hex=h0)
    for ts, accessed in ((5.0, [key0, key0, key1, dict(key0, object_group_id=1)]),
                         (7.5, [key0, dict(key0, chunk_hash_hex="ab" * 32), dict(key1, chunk_hash_hex=h2)])):
        seq_no += 1
        events.append(["POST", "/events", {"batches": [{"instance_id": "node-a", "incarnation": 1, "seq": seq_no,
                                                         "event_type": "access", "tier": "l1", "backend": "dram",
                                                         "ts": ts, "entries": [{"key": k} for k in accessed]}]}])

    def body(tokens: list, **kw: Any) -> dict:
        return {"token_ids": tokens, "model_name": "m", "world_size": 1, "cache_salt": "", **kw}

    lookups = [body(seqs[0]), body(seqs[0][: 2 * CHUNK]), body(seqs[0] + [5, 6]), body(seqs[1], world_size=2),
               body(seqs[1]), body(seqs[2], cache_salt="s"), body(seqs[2]), body(seqs[0][: CHUNK - 1]),
               body([9] + seqs[0]), body(seqs[0], model_name="other"), body(seqs[0], model_name="a@b"),
               body(seqs[0][:3], model_name="a@b"), body(seqs[0], cache_salt="a/b"), body(seqs[0][:3], cache_salt="a@b"),
               body(seqs[0], world_size=3), body(list(range(5 * CHUNK)), world_size=2, cache_salt="t")]
    return events, [["POST", "/directory/lookup", b] for b in lookups]


def _comparable(answer: list) -> list:
    status, body = answer
    if status != 200:
        return [status]
    # placements carry our "shared" flag, compared where LMCache has it
    return [status, body["chunks"], [[r["key"], sorted((p["instance_id"], p["incarnation"], p["tier"], p["backend"],
                                                         p["size_bytes"]) for p in r["placements"]), r["token_ids"],
                                      r["access_count"]]
                                      for r in body["results"]]]


@pytest.mark.parametrize("algorithm", ["blake3", "sha256_cbor"])
def test_token_form_lookups_answer_as_the_real_coordinator(lmcache_site, vllm_site, tmp_path, algorithm):
    """Keys named as the servers name them (our hasher, itself checked bit for bit against
    LMCache's in test_token_hasher.py), with LMCache's default hash and vLLM's (loaded from
    vLLM's wheel by LMCache's coordinator, as in a fleet)."""
    seed = vllm_none_hash_seed(os.environ)
    events, lookups = _lookup_cases(np.random.default_rng(11), TokenHasher(algorithm, CHUNK, none_hash_seed=seed))
    requests = events + lookups + [["GET", "/directory/keys", None]]
    theirs = _lmcache_answers(lmcache_site, {"chunk_size": CHUNK, "hash_algorithm": algorithm}, requests, tmp_path,
                              extra_path=[vllm_site])
    ours = _our_answers(requests, chunk_size=CHUNK, hash_algorithm=algorithm)
    assert [a[0] for a in theirs[: len(events)]] == [a[0] for a in ours[: len(events)]] == [200] * len(events)
    # GET /directory/keys: every key with its access count and token count, as LMCache lists them
    (our_status, our_keys), (their_status, their_keys) = ours.pop(), theirs.pop()
    assert our_status == their_status == 200

    def listed(page: dict) -> list:
        return sorted((json.dumps(k["key"], sort_keys=True), k["num_tokens"], k["access_count"]) for k in page["keys"])

    assert listed(our_keys) == listed(their_keys) and {k[2] for k in listed(our_keys)} == {0, 1, 3}
    got = [_comparable(a) for a in ours[len(events):]]
    want = [_comparable(a) for a in theirs[len(events):]]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, (i, lookups[i][2].get("model_name"), g, w)
    # the comparison is not vacuous: some lookups found placements in several groups and tiers
    found = [r for a in ours[len(events):] if a[0] == 200 for r in a[1]["results"] if r["placements"]]
    assert len(found) >= 6 and {r["key"]["object_group_id"] for r in found} == {0, 1}
    assert sorted({a[0] for a in ours[len(events):]}) == [200, 400]
    # ... and some keys were accessed (3 for the key accessed twice, then once more)
    counts = {r["access_count"] for a in ours[len(events):] if a[0] == 200 for r in a[1]["results"]}
    assert {0, 1, 3} <= counts
