"""vLLM's KV-events wire, byte for byte: msgpack ``EventBatch`` and its tagged events.

Question answered: "which bytes does a router that speaks vLLM's KV events expect?" The
layout is vLLM's ``vllm/distributed/kv_events.py``, encoded as its msgspec encoder writes
it (tests compare our bytes with msgspec's encoding of vLLM's own classes, and decode them
with vLLM's ``KVEventBatch``, strict):

- ``EventBatch`` is array-like: ``[ts (float64), [events...], data_parallel_rank]``.
- Events are tagged structs; fields without defaults are always written, fields at their
  default are left out (``omit_defaults``). Two encodings exist:
  ``map`` (vLLM since PR #42892, e.g. 0.30 and 0.33): ``{"type": "BlockStored", ...}``;
  ``array`` (older releases, e.g. 0.20): ``["BlockStored", ...]`` in field order, every
  field written (msgspec omits no default in array form).
- ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name}``, ``BlockRemoved{block_hashes, medium}``, ``AllBlocksCleared{}``.
- Block hashes are msgpack ``bin`` (vLLM's bytes hashes) or, with ``int_hashes`` (vLLM's
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), the low 64 bits of the big-endian integer.

Integers use the shortest msgpack form, as msgspec does. Token ids are encoded in one
vector pass per message (numpy), never one Python call per token: this runs beside ingest.

Topics and mediums (LMCache's convention for its republisher): an instance's private copies
are on ``kv@<instance_id>@<model_name>`` (medium ``lmcache-l1`` for its L1, ``lmcache-l2-
<backend>`` for a private L2), a shared pool's on ``kv@pool:<backend>@<model_name>``
(medium ``lmcache-<tier>-<backend>``, i.e. ``lmcache-l2-<backend>`` for an L2 pool).
"""

from __future__ import annotations

import struct
from typing import Sequence, Union

import numpy as np

from blendmatch.index.holders import Spot

__all__ = ["ENCODINGS", "END_SEQ", "EventEncoder", "medium_of", "topic_of", "seq_bytes"]

ENCODINGS = ("map", "array")
#: The replay answer's end marker: seq -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
NIL = b"\xc0"
_F64 = struct.Struct(">Bd")


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def topic_of(spot: Spot) -> str:
    if spot.shared:
        return f"kv@pool:{spot.backend}@{spot.model_name}"
    return f"kv@{spot.holder}@{spot.model_name}"


def medium_of(spot: Spot) -> str:
    if spot.private_l1:
        return "lmcache-l1"
    return f"lmcache-{spot.tier}-{spot.backend}"


# ---------------------------------------------------------------------- msgpack pieces
def uint(v: int) -> bytes:
    if v < 0x80:
        return bytes((v,))
    if v < 0x100:
        return b"\xcc" + bytes((v,))
    if v < 0x10000:
        return b"\xcd" + v.to_bytes(2, "big")
    if v < 0x100000000:
        return b"\xce" + v.to_bytes(4, "big")
    return b"\xcf" + v.to_bytes(8, "big")


def text(s: str) -> bytes:
    b = s.encode("utf-8")
    n = len(b)
    if n < 32:
        return bytes((0xA0 | n,)) + b
    if n < 0x100:
        return b"\xd9" + bytes((n,)) + b
    if n < 0x10000:
        return b"\xda" + n.to_bytes(2, "big") + b
    return b"\xdb" + n.to_bytes(4, "big") + b


def binary(b: bytes) -> bytes:
    n = len(b)
    if n < 0x100:
        return b"\xc4" + bytes((n,)) + b
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big") + b
    return b"\xc6" + n.to_bytes(4, "big") + b


def array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def map_header(n: int) -> bytes:
    return bytes((0x80 | n,))  # our maps have at most 8 fields


def float64(x: float) -> bytes:
    return _F64.pack(0xCB, x)


def uint_array(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """msgpack encodings of uint32 ``values`` (any shape, C order), shortest form each, in
    one vector pass: ``(bytes as uint8, end offset of each value)``."""
    v = np.ascontiguousarray(values, dtype=np.uint32).ravel()
    size = np.ones(v.shape[0], dtype=np.int64)
    size[v >= 0x80] = 2
    size[v >= 0x100] = 3
    size[v >= 0x10000] = 5
    ends = np.cumsum(size)
    out = np.empty(int(ends[-1]) if v.shape[0] else 0, dtype=np.uint8)
    starts = ends - size
    small = size == 1
    out[starts[small]] = v[small]
    for nbytes, marker in ((2, 0xCC), (3, 0xCD), (5, 0xCE)):
        sel = size == nbytes
        if not sel.any():
            continue
        at = starts[sel]
        vals = v[sel]
        out[at] = marker
        for k in range(1, nbytes):  # big-endian payload bytes
            out[at + k] = (vals >> np.uint32(8 * (nbytes - 1 - k))).astype(np.uint8)
    return out, ends


# ---------------------------------------------------------------------- events
class EventEncoder:
    """Encodes events for one ``encoding`` (``map`` | ``array``) and hash form."""

    def __init__(self, encoding: str = "map", int_hashes: bool = False) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        self.encoding = encoding
        self.int_hashes = int_hashes
        as_map = encoding == "map"
        self._as_map = as_map

        def fields(names: Sequence[str]) -> list[bytes]:
            """Per field, what precedes its value (the key in map form)."""
            if as_map:
                return [text(n) for n in names]
            return [b""] * len(names)

        stored = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
        k = fields(stored)
        # msgspec sizes a struct's map header by its declared fields: vLLM 0.33's BlockStored
        # has 16, so its header is the 3-byte map16 form (same bytes as msgspec writes)
        # In array form msgspec writes every field (the defaulted extra_keys and group_idx as
        # nil), as vLLM 0.20 does.
        head = (b"\xde\x00\x08" + text("type") if as_map else array_header(10)) + text("BlockStored")
        self._stored_head = head + k[0]                    # then the hashes
        self._stored_mid = k[1] + NIL + k[2]               # parent None, then token_ids
        self._stored_size_key = k[3]
        self._stored_tail_key = k[4] + NIL + k[5]          # lora_id None, then the medium
        self._stored_end = k[6] + NIL + (b"" if as_map else NIL + NIL)  # lora_name (extra_keys, group_idx) None
        self._head_arr = np.frombuffer(self._stored_head, dtype=np.uint8)
        self._mid_arr = np.frombuffer(self._stored_mid, dtype=np.uint8)
        k = fields(("block_hashes", "medium"))
        self._removed_head = (map_header(3) + text("type") if as_map else array_header(4)) + text("BlockRemoved") + k[0]
        self._removed_medium_key = k[1]
        self._removed_end = b"" if as_map else NIL  # group_idx None (array form)
        self._cleared = (map_header(1) + text("type") if as_map else array_header(1)) + text("AllBlocksCleared")

    def block_hash(self, h: bytes) -> bytes:
        if self.int_hashes:
            return uint(int.from_bytes(h, "big") & 0xFFFFFFFFFFFFFFFF)
        return binary(h)

    def stored(self, hashes: Sequence[bytes], tokens: Union[np.ndarray, Sequence[np.ndarray]], medium: str) -> list[bytes]:
        """One ``BlockStored`` per chunk (``parent_block_hash`` None, ``block_size`` = the
        chunk's length, ``token_ids`` its tokens)."""
        if isinstance(tokens, np.ndarray) and tokens.ndim == 2:
            lengths = [tokens.shape[1]] * tokens.shape[0]
        else:
            lengths = [len(t) for t in tokens]
            tokens = np.concatenate([np.asarray(t, dtype=np.uint32) for t in tokens]) if lengths else \
                np.zeros(0, dtype=np.uint32)
        blob, ends = uint_array(tokens)
        raw = blob.tobytes()
        row_end = np.cumsum(lengths)
        byte_end = [0] + ends[row_end - 1].tolist() if len(lengths) else [0]
        tail = self._stored_tail_key + text(medium) + self._stored_end
        head, mid, size_key = self._stored_head, self._stored_mid, self._stored_size_key
        one = array_header(1)
        out = []
        for k, (h, n) in enumerate(zip(hashes, lengths)):
            out.append(b"".join((head, one, self.block_hash(h), mid, array_header(n), raw[byte_end[k]:byte_end[k + 1]],
                                 size_key, uint(n), tail)))
        return out

    def stored_concat(self, hashes: Sequence[bytes], tokens: Union[np.ndarray, Sequence[np.ndarray]],
                      medium: str) -> tuple[int, bytes]:
        """:meth:`stored`'s events concatenated, with their count: a block of one chunk
        length (the norm) in one kernel call without the GIL (``_kernels.py``)."""
        n = len(hashes)
        if (not isinstance(tokens, np.ndarray) or tokens.ndim != 2 or not n
                or (not self.int_hashes and (len(set(map(len, hashes))) != 1 or len(hashes[0]) > 255))):
            return n, b"".join(self.stored(hashes, tokens, medium))
        from ._kernels import encode_stored_block

        length = tokens.shape[1]
        tail = np.frombuffer(self._stored_size_key + uint(length) + self._stored_tail_key + text(medium)
                             + self._stored_end, dtype=np.uint8)
        if self.int_hashes:
            ints = np.array([int.from_bytes(h, "big") & 0xFFFFFFFFFFFFFFFF for h in hashes], dtype=np.uint64)
            rows = np.zeros((n, 0), dtype=np.uint8)
        else:
            ints = np.zeros(0, dtype=np.uint64)
            rows = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(n, len(hashes[0]))
        blob = encode_stored_block(np.ascontiguousarray(tokens, dtype=np.uint32), rows, ints, self.int_hashes,
                                   self._head_arr, self._mid_arr, tail)
        return n, blob.tobytes()

    def removed(self, hashes: Sequence[bytes], medium: str) -> bytes:
        return b"".join((self._removed_head, array_header(len(hashes)), *map(self.block_hash, hashes),
                         self._removed_medium_key, text(medium), self._removed_end))

    def cleared(self) -> bytes:
        return self._cleared

    @staticmethod
    def batch(ts: float, events: Sequence[bytes], data_parallel_rank: int = 0, *, count: int = -1) -> bytes:
        """The ``EventBatch`` payload ``[ts, events, data_parallel_rank]``; ``count``: how
        many events ``events`` hold when some are concatenations (:meth:`stored_concat`)."""
        n = len(events) if count < 0 else count
        return b"".join((array_header(3), float64(ts), array_header(n), *events, uint(data_parallel_rank)))

    def warm_up(self) -> None:
        """Compile (or load) the kernel before the first message."""
        self.stored_concat([b"\x00" * 8], np.zeros((1, 16), dtype=np.uint32), "warm-up")
