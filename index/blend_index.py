"""BlendIndex: which stored chunks does a token sequence contain, where, for whom?

The content-fingerprint index (``docs/architecture.md`` walks a lookup through it).
Contents are keyed by THE fingerprint (``gpu/fingerprint.py``) of their ``chunk_size``
tokens; each content has *occupants* (the chunk hashes stored with exactly those tokens, in
first-indexed order), each with its ``token_offset`` and the set of namespaces that *claim*
it. The slot array (``slots.py``) sits in front of the exact map so that an engine
(``gpu/``) can reject almost every query window without touching the host structures.

``match_batch`` / ``match_flat``: one engine probe for the whole batch (outside the lock) ->
candidates ``(query, cur_st, fingerprint)`` ascending -> under the lock: fingerprint map
lookup -> namespace filter (before tokens are compared) -> token-exact verification ->
LMCache 0.5.6's per-position rule (``verify.py``: at most one match per position and no
chunk hash twice in a query; content C stored under A then B, query ``C..C`` -> A at the
first copy, B at the second; a hash removed and re-added goes last; a chunk is taken only
after it verified), in time linear in candidates plus occupants.

Invariants:
- A chunk whose ``token_offset`` is unknown (-1) is never indexed as a new occupant, and a
  later -1 never downgrades a known offset.
- Content of the wrong length is not indexed (logged at debug, not an error).
- Two fingerprints that collide with different content stay apart: the later content is
  not indexed (counted as ``collisions``) and never attached to the earlier entry.
- Every content in the map has at least one occupant; every occupant at least one claim.

Thread safety: a writer lock keeps writers one at a time and a write lock keeps readers
out; bulk adds stage new contents under the first and publish them under the second (see
``__init__``). The engine probe runs outside both (the slot array tolerates concurrent
readers). Lock order: directory -> index writer -> index; the index never calls back.

Where each part lives: this module holds the state (the private columns: contents,
occupants, claims, the hash list, the map and the slot table), the two locks, the
checkpoint state and the counts; the reads (probe, re-probe, verification) are the mixin
``blend_reads.IndexReads``, the writes (adds, stages, publishes, removals, growth, the
write session) the mixin ``blend_writes.IndexWrites``. Mixins, not parts called through:
a lookup batch runs the same methods on the same object as one class did, no extra call
layer. The parts that stand alone live apart (``storage.py`` the containers, ``slots.py``
the filter, ``verify.py`` the per-position rule, ``namespace_ids.py``, ``tokens.py``).

Memory: see ``storage.py``; about 100-200 bytes per chunk beyond its 1 KiB of tokens.
Token rows handed out by ``add``/``add_many`` are shared, read-only views: a row is never
reused while its content still has an occupant (hence a claim), so the key directory keeps
these views as its only copy of a binding's tokens. ``memory_bytes`` counts the chunk-hash
bytes objects, which the directory shares; do not add them twice.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from blendmatch.gpu import Engine, FailoverEngine, select_engine

from .blend_reads import IndexReads, PendingMatch
from .blend_writes import IndexWrites, SessionState, WriteSession
from .namespace_ids import NamespaceIds
from .slots import FilterMode, SlotArray
from .storage import Columns, FingerprintMap, TokenStore, split_hashes
from .types import BlendNamespace
from .verify import MatchStats

__all__ = ["BlendIndex", "MatchStats", "PendingMatch", "WriteSession"]

_EMPTY_LIST_BYTES = sys.getsizeof([])


class BlendIndex(IndexReads, IndexWrites):
    """The host truth of blend lookups. See the module docstring for semantics."""

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1, engine: str | Engine = "auto",
                 filter: FilterMode = "tagged") -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        if not isinstance(probe_stride, int) or probe_stride < 1:
            raise ValueError(f"probe_stride must be an integer >= 1, got {probe_stride!r}")
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        self._slots = SlotArray(filter)
        self.filter = filter
        chosen = select_engine(engine) if isinstance(engine, str) else engine
        # What probes go through: the chosen engine until it fails at run time, then the CPU
        # engine (``gpu.select.FailoverEngine``: logged and counted there).
        self._failover = chosen if isinstance(chosen, FailoverEngine) else FailoverEngine(chosen)
        # Two locks, always taken in this order: ``_writer`` keeps writers one at a time (the
        # key directory's lock already does for the service), ``_lock`` keeps readers out
        # (verification waits for it). A bulk add stages its new contents under ``_writer``
        # alone, in rows no reader can reach until the fingerprint map and the slot array
        # name them, then publishes them under ``_lock``: the hold lookups wait for is the
        # publish, not the copy (``_stage_new``; docs/architecture.md, "Locks and threads").
        self._writer = threading.RLock()
        self._lock = threading.RLock()
        self._session = SessionState()  # this index's write sessions, per thread (blend_writes.py)
        self._fpmap = FingerprintMap()
        self._tokens = TokenStore(chunk_size)
        # contents: fingerprint and first occupant
        self._c = Columns({"fp": np.uint64, "occ": np.int32})
        # occupants: content row, next occupant, token offset, first claim
        self._o = Columns({"content": np.int32, "next": np.int32, "offset": np.int64, "claim": np.int32})
        self._o_hash: list[bytes | None] = []
        self._hash_bytes = 0  # sum of sys.getsizeof over live chunk hashes (kept, not walked)
        # claims: namespace id, next claim
        self._k = Columns({"ns": np.int32, "next": np.int32})
        self._ns = NamespaceIds()
        self._collisions = 0
        self._rebuilds = 0
        self._slot_writes = 0  # odd while a slot-table write runs (see _match)

    @property
    def write_lock(self) -> threading.RLock:
        """The lock every write takes to change what lookups see; writes under one hold are
        seen by lookups at once. Take :attr:`writer_lock` first (lock order)."""
        return self._lock

    @property
    def writer_lock(self) -> threading.RLock:
        """The lock that keeps writers one at a time, taken before :attr:`write_lock`.
        A run of writes that lookups must see whole takes both through
        :meth:`write_session`, which lets ``add_many`` stage before the hold."""
        return self._writer

    @property
    def engine(self) -> Engine:
        """The engine answering now (the chosen one, or the CPU engine after a GPU failover)."""
        return self._failover.active

    def warm_up(self) -> None:
        """Run every compiled path once on a private throw-away index with this engine and
        chunk size (bulk and single adds, a probe with a hit, verification, removals), so the
        first real request pays no JIT compilation or cache load. State of ``self`` is
        untouched; safe to call at start-up from the thread that will serve lookups."""
        scratch = BlendIndex(self.chunk_size, self.probe_stride, self._failover, self.filter)
        ns = BlendNamespace("blendmatch-warm-up")
        rows = np.arange(2 * self.chunk_size, dtype=np.uint32).reshape(2, self.chunk_size)
        scratch.add_many(rows, [b"warm-0", b"warm-1"], [0, self.chunk_size], ns)
        scratch.add(rows[0], b"warm-2", 0, ns)
        scratch.match_batch([(rows.reshape(-1), ns), (rows[1], BlendNamespace("other"))])
        scratch.remove_claim(rows[0], b"warm-0", ns)
        scratch.remove_chunk(rows[1], b"warm-1")

    def stats(self) -> dict[str, Any]:
        """Counts and sizes (cheap; safe to call from a metrics scrape). Waits for a
        writer: staged contents are counted once published."""
        with self._writer, self._lock:
            out: dict[str, Any] = {
                "chunk_size": self.chunk_size,
                "probe_stride": self.probe_stride,
                "num_contents": self._c.live,
                "num_chunks": self._o.live,
                "num_claims": self._k.live,
                "num_namespaces": self._ns.live(),
                "collisions": self._collisions,
                "rebuilds": self._rebuilds,
                "engine": self.engine.name,
                "engine_reason": self.engine.reason,
                "engine_failovers": self._failover.failovers,
                "memory_bytes": self._memory_bytes_locked(),
            }
            out.update(self._slots.stats())
            return out

    def memory_bytes(self) -> int:
        """Resident bytes of the index's structures, tokens included (capacity, not just use)."""
        with self._writer, self._lock:
            return self._memory_bytes_locked()

    @property
    def slots(self) -> SlotArray:
        """The slot array (engines read it; do not mutate)."""
        return self._slots

    # ------------------------------------------------------------------ checkpoints
    def export_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Everything that decides an answer, as ``(doc, arrays)``: a JSON-able document and
        raw buffers (views, not copies). Call with the owner's (directory's) lock held so no
        write runs, or in a forked copy of the process (``checkpoint.py``). Occupant and
        claim lists are exported as the linked columns they are, so first-indexed order
        (LMCache's per-position rule) survives a restore exactly; so do the free lists, so
        later adds reuse the same rows."""
        c_cols, c_free = self._c.export()
        o_cols, o_free = self._o.export()
        k_cols, k_free = self._k.export()
        hashes = self._o_hash
        lengths = np.fromiter((-1 if h is None else len(h) for h in hashes), dtype=np.int32, count=len(hashes))
        blob = b"".join(h for h in hashes if h is not None)
        doc = {"chunk_size": self.chunk_size, "probe_stride": self.probe_stride, "filter": self.filter,
               "collisions": self._collisions, "rebuilds": self._rebuilds, **self._ns.export(),
               "sizes": {"c": self._c.size, "o": self._o.size, "k": self._k.size},
               "fpmap": {"live": self._fpmap.live, "tombstones": self._fpmap.tombstones},
               "slots": {"size": self._slots.size, "floor_size": self._slots.floor_size}}
        arrays: dict[str, Any] = {f"c_{k}": v for k, v in c_cols.items()}
        arrays.update({f"o_{k}": v for k, v in o_cols.items()})
        arrays.update({f"k_{k}": v for k, v in k_cols.items()})
        arrays.update({"c_free": np.asarray(c_free, dtype=np.int64), "o_free": np.asarray(o_free, dtype=np.int64),
                       "k_free": np.asarray(k_free, dtype=np.int64), "fp_keys": self._fpmap.keys,
                       "fp_vals": self._fpmap.vals, "o_hash_len": lengths,
                       "o_hash_blob": np.frombuffer(blob, dtype=np.uint8),
                       "tokens": self._tokens.export_parts(self._c.size)})
        return doc, arrays

    def restore_state(self, doc: dict[str, Any], read: Any) -> None:
        """Replace this (empty) index's state by an :meth:`export_state` of an index with
        the same chunk size, stride and filter. ``read(name, out=None) -> ndarray`` returns a
        verified buffer (``out``: read into it). The slot array is rebuilt from the live
        fingerprints at the saved size (a new generation: engines upload it whole); it may
        then hold fewer stale shared slots than before, which changes no answer. Raises
        ``ValueError`` when the parameters differ or the state is inconsistent."""
        for name, mine in (("chunk_size", self.chunk_size), ("probe_stride", self.probe_stride),
                           ("filter", self.filter)):
            if doc[name] != mine:
                raise ValueError(f"checkpoint has {name} {doc[name]!r}, this server {mine!r}")
        sizes = doc["sizes"]
        c_size, o_size, k_size = int(sizes["c"]), int(sizes["o"]), int(sizes["k"])
        with self._writer, self._lock:
            if self._c.live or self._o.live:
                raise ValueError("restore_state needs an empty index")
            # read (and so verify) everything before changing anything
            tokens = self._tokens.restore_buffer(c_size)
            read("tokens", tokens)
            got = {name: read(name) for name in ("c_fp", "c_occ", "c_free", "o_content", "o_next", "o_offset",
                                                 "o_claim", "o_free", "k_ns", "k_next", "k_free", "fp_keys",
                                                 "fp_vals", "o_hash_len", "o_hash_blob")}
            lengths = got["o_hash_len"]
            blob = got["o_hash_blob"].tobytes()
            if lengths.shape[0] > o_size or int(lengths[lengths > 0].sum()) != len(blob):
                raise ValueError("occupant chunk hashes do not match their lengths")
            self._c.restore({k: got[f"c_{k}"] for k in ("fp", "occ")}, c_size, got["c_free"].tolist())
            self._o.restore({k: got[f"o_{k}"] for k in ("content", "next", "offset", "claim")}, o_size,
                            got["o_free"].tolist())
            self._k.restore({k: got[f"k_{k}"] for k in ("ns", "next")}, k_size, got["k_free"].tolist())
            self._fpmap.restore(got["fp_keys"], got["fp_vals"], doc["fpmap"]["live"], doc["fpmap"]["tombstones"])
            self._o_hash = split_hashes(blob, lengths)
            live_hashes = [h for h in self._o_hash if h is not None]
            same = live_hashes and int(lengths.min()) == int(lengths.max())
            self._hash_bytes = (len(live_hashes) * sys.getsizeof(live_hashes[0]) if same
                                else sum(map(sys.getsizeof, live_hashes)))
            self._tokens.adopt(tokens)
            self._ns.restore(doc)
            self._collisions = int(doc["collisions"])
            self._rebuilds = int(doc["rebuilds"])
            self._slots.floor_size = int(doc["slots"]["floor_size"])
            self._slots_write(self._slots.rebuild, self._live_fps(), size=int(doc["slots"]["size"]))

    def token_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        """Read-only views of content rows ``rows`` (what ``add`` returned for them); used
        to re-attach a restored directory's bindings to the index's own rows."""
        return self._tokens.rows(np.asarray(rows, dtype=np.int64))

    def locate_rows(self, views: list) -> np.ndarray:
        """For each array: the content row it is a view of, or -1 (see ``TokenStore.locate``)."""
        return self._tokens.locate(views)

    def _memory_bytes_locked(self) -> int:
        # O(1): scraped by /metrics. The hash list by its length, not its capacity: the
        # capacity depends on how the list grew (one insert of 5,000 or 200 of 25), and
        # replicas that applied the same log in different runs must report the same state.
        hashes = _EMPTY_LIST_BYTES + 8 * len(self._o_hash) + self._hash_bytes
        return (self._tokens.nbytes() + self._fpmap.nbytes() + self._c.nbytes() + self._o.nbytes()
                + self._k.nbytes() + self._slots.nbytes + hashes)
