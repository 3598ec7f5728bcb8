"""Write the request bodies the README's curl examples send (``python examples/make_examples.py``).

One LMCache STORE of one indexable chunk, and the requests that find it. What makes the
STORE indexable (docs/lmcache.md, "The wire"):

- ``token_ids`` holds exactly ``--chunk-size`` (256) tokens: an entry of any other length is
  applied (its placement is kept) but never indexed (``entries_not_indexable: wrong_length``);
- ``kv_rank`` packs LMCache's rank fields, ``world_size << 24 | global_rank << 16 |
  local_world_size << 8 | local_rank``: one GPU is ``16777472`` (``0x01000100``). Blend
  lookups read the world size from bits 24-31, so ``kv_rank: 0`` means world size 0 and is
  never indexed (``world_size_0``); the token form of ``/directory/lookup`` builds LMCache's
  whole key, so it needs the whole packing;
- ``token_offset`` is known (here 0: the chunk opened its sequence): with ``-1`` (unknown)
  it is applied, but offered to blend lookups only once a STORE says where the chunk sat
  (``token_offset_unknown``);
- ``chunk_hash_hex`` is the hash LMCache's servers give that chunk (``blake3``, chained from
  the start of the sequence), so that the token form of ``/directory/lookup`` finds it too.

The blend-lookup query holds the chunk after 100 other tokens, so the match says
``cur_st: 100`` (where it is in the query) and ``old_st: 0`` (where it was stored).
Deterministic: the same files on every run (``tests/test_readme_examples.py`` checks them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from blendmatch.index.token_hasher import TokenHasher
from blendmatch.index.types import pack_kv_rank

MODEL = "meta-llama/Llama-3.1-8B"
CHUNK = 256
#: 256 tokens x 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes (bf16): one Llama-3.1-8B chunk.
CHUNK_BYTES = 256 * 32 * 2 * 8 * 128 * 2


def bodies() -> dict[str, object]:
    """File name -> JSON body."""
    rng = np.random.default_rng(2026)
    chunk = rng.integers(0, 128_000, size=CHUNK).tolist()
    before, after = rng.integers(0, 128_000, size=100).tolist(), rng.integers(0, 128_000, size=60).tolist()
    key = {"chunk_hash_hex": TokenHasher("blake3", CHUNK).chunk_hashes(chunk)[0].hex(), "model_name": MODEL,
           "kv_rank": pack_kv_rank(world_size=1), "object_group_id": 0, "cache_salt": ""}
    store = {"batches": [{"instance_id": "demo-0", "incarnation": 1, "seq": 1, "event_type": "store",
                          "tier": "l1", "backend": "dram", "shared": False, "ts": 1767225600.0,
                          "entries": [{"key": key, "size_bytes": CHUNK_BYTES, "token_ids": chunk,
                                       "token_offset": 0}]}]}
    namespace = {"model_name": MODEL, "world_size": 1, "cache_salt": ""}
    return {
        "store.json": store,
        "blend_lookup.json": {**namespace, "token_ids": before + chunk + after},
        "directory_lookup_keys.json": {"keys": [key]},
        "directory_lookup_tokens.json": {**namespace, "token_ids": chunk},
    }


def write(out: Path) -> list[Path]:
    paths = []
    for name, body in bodies().items():
        path = out / name
        path.write_text(json.dumps(body) + "\n")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="folder (default: here)")
    for path in write(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
