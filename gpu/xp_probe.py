"""The GPU engine's algorithm in backend-neutral array code: numpy in CI, CuPy on a GPU.

Question answered: "which valid windows of this batch survive the slot-array probe?", with
the exact steps the device runs, written once against an array module ``xp`` so that CI
(no GPU) executes the same lines the GPU engine executes.

The batch algorithm (one batch, a constant number of array operations, no per-query loop):

1. **Plan** (host, O(queries)): ``wbase[q]`` is the number of valid windows in queries
   ``< q`` (an exclusive scan of the per-query window counts; ``wbase[Q] = W``) and
   ``qstart[q]`` the query's first token in the concatenated batch. :func:`plan_windows`.
2. **Fingerprints**: ``H = fingerprint.prefix_fingerprints(tokens)`` at every global token
   position (THE hash, prefix form; windows that straddle two queries are computed and never
   read). Power tables stay resident per ``xp`` (:meth:`ArrayProbe.powers`).
3. **Window coordinates**: window ``w`` (``0 <= w < W``) belongs to query
   ``q = searchsorted(wbase[:Q], w, "right") - 1`` (the *last* query whose first window is
   ``<= w``, which skips queries without windows); ``cur_st = (w - wbase[q]) * stride`` and
   its global start is ``qstart[q] + cur_st``. Enumerating ``w`` in order enumerates
   ``(query, cur_st)`` in ascending order, which is the order the contract asks for.
4. **Probe**: ``fp = H[start]``; ``slot, tag = fingerprint.slots_and_tags(fp)``;
   ``v = table[slot]``; ``keep = (v == tag) | (v == 255)`` (the slot byte rule of ``index/slots.py``; a
   window survives on its own tag or on a shared slot).
5. **Compaction without nonzero**: ``pos = cumsum(keep)``; ``n = pos[-1]`` is read back (the
   one synchronisation of the batch). Survivor ``r`` is the window where ``pos`` first
   reaches ``r + 1``: ``searchsorted(pos, arange(1, n + 1), "left")`` -- a gather, so no
   scatter contention and no data-dependent launch sizes before the count is known. The
   fused CUDA path (``cupy_engine``) instead scatters survivor ``w`` to row ``pos[w] - 1``;
   both place survivors in ascending ``w``, i.e. the same rows.
6. **Pack**: ``(n, 3)`` uint64 rows ``[query, cur_st, fingerprint]``, so the device returns
   candidates with one device-to-host copy (:func:`rows_to_candidates` unpacks them).

Also here, because both engines share it: :class:`SlotMirror` (the device copy of the slot
array, patched from the change log), :func:`dedupe_last_write`, the staging layout of one
upload (:func:`staging_layout`, :func:`stage_upload`, :func:`staging_views`), the engine base
class (:class:`MirroredEngine`: input checks, lock, error wrapping, timings) and
:class:`XpEngine`, the algorithm above as an engine over any ``xp`` (``XpEngine(numpy)`` is
the ``"xp-numpy"`` engine of the conformance suite and the benchmark).

Import rule: numpy and ``blendmatch.index.fingerprint`` only; nothing here imports CuPy.

Why one module of about 800 lines: CI proves the GPU engine by running *these* lines on
numpy, so the planning, the array kernels, the slot mirror and :class:`XpEngine`'s adaptive
passes and failure rules (which ``CupyEngine`` inherits) must stay the very code the device
runs. The next split along that seam is the adaptive-pass driver (``_run_adaptive`` and the
memory-pressure retries) into a module of its own.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, NoReturn

import numpy as np

from .fingerprint import TAG_SHARED, power_tables, prefix_fingerprints, slots_and_tags
from .occupancy import occupancy_words

from .batch import Candidates, QueryBatch
from .engine import EngineError, EngineFailure, EngineOutOfMemory, ProbeHandle, ReadyProbe, SlotChanges, SlotSource

log = logging.getLogger(__name__)

__all__ = [
    "STAGING_PIECE",
    "TIMING_KEYS",
    "ArrayProbe",
    "MirroredEngine",
    "SlotMirror",
    "TrialSlots",
    "MIN_PASS_TOKENS",
    "SCAN_LIMIT",
    "WindowPlan",
    "XpEngine",
    "check_table",
    "create_xp_engine",
    "dedupe_last_write",
    "plan_windows",
    "rows_to_candidates",
    "split_batch",
    "stage_upload",
    "staging_layout",
    "staging_views",
]


#: Keys of ``Candidates.timings`` filled by the mirrored engines (seconds): host mirror sync
#: (change-log dedupe and its scatter or full upload), upload of plan and tokens, device
#: kernels (hash + probe + compaction), the count read-back and survivor copy, whole probe.
TIMING_KEYS = ("sync_s", "upload_s", "kernels_s", "copyback_s", "total_s")


# --------------------------------------------------------------------------------------
# 1. plan (host)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WindowPlan:
    """Where each query's valid windows sit in the batch's window numbering (host arrays)."""

    wbase: np.ndarray  # int64 (Q+1,): first window number of query q; wbase[Q] == windows
    qstart: np.ndarray  # int64 (Q,): first token of query q in the concatenated batch
    windows: int  # W, valid windows in the batch
    window: int  # C
    stride: int

    @property
    def num_queries(self) -> int:
        return int(self.qstart.size)


def plan_windows(batch: QueryBatch) -> WindowPlan:
    """The window plan of ``batch`` (O(queries), host). ``windows == batch.num_windows()``."""
    offsets = np.asarray(batch.offsets, dtype=np.int64)
    c, s = batch.window, batch.stride
    span = np.diff(offsets) - c + 1
    counts = np.where(span > 0, (span + s - 1) // s, 0).astype(np.int64)
    wbase = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=wbase[1:])
    qstart = np.array(offsets[:-1], dtype=np.int64)  # a copy: staging writes it as is
    return WindowPlan(wbase, qstart, int(wbase[-1]), c, s)


def check_table(table: Any) -> np.ndarray:
    """The host slot table, or ``ValueError`` naming what is wrong with it."""
    if not isinstance(table, np.ndarray) or table.ndim != 1 or table.dtype != np.uint8:
        desc = f"{type(table).__name__} {getattr(table, 'dtype', '')} {getattr(table, 'shape', '')}"
        raise ValueError(f"slot table must be a 1-D uint8 numpy array, got {desc.strip()}")
    n = int(table.shape[0])
    if n < 1 or n & (n - 1):
        raise ValueError(f"slot table length must be a power of two, got {n}")
    return table


#: The most tokens (and so windows) one device pass may hold. CuPy's scans (``cumsum``, used
#: by the prefix hash and the compaction) take the length as a C ``int``: a longer array
#: gives wrong answers without an error. Engines split larger batches (:func:`split_batch`).
SCAN_LIMIT = 2**31 - 1
#: The smallest pass an engine splits down to when device memory runs out.
MIN_PASS_TOKENS = 1 << 12


def split_batch(batch: QueryBatch, max_tokens: int) -> list[tuple[QueryBatch, np.ndarray, np.ndarray]]:
    """``batch`` as passes of at most ``max_tokens`` tokens: ``[(piece, query, offset), ...]``.

    Row ``i`` of a piece is segment ``[offset[i], offset[i] + len)`` of query ``query[i]``;
    a candidate ``(i, cur_st)`` of the piece is ``(query[i], offset[i] + cur_st)`` of the
    batch. A query longer than ``max_tokens`` is cut into segments that start on a multiple
    of the stride and overlap by ``window - stride`` tokens, so every valid window lies in
    exactly one segment. Queries without a valid window are left out. Pieces come in
    ascending ``(query, offset)``, so concatenating their candidates keeps the contract's
    order. ``max_tokens`` below ``window + stride`` is raised to it.
    """
    c, s = batch.window, batch.stride
    cap = max(int(max_tokens), c + s)
    step = (cap - c + 1) // s * s  # window starts [o, o + step) of one segment
    offsets = np.asarray(batch.offsets, dtype=np.int64)
    tokens = batch.tokens
    segs: list[tuple[int, int, int]] = []  # (query, start, end) in query coordinates
    for q in range(batch.num_queries):
        n = int(offsets[q + 1] - offsets[q])
        if n < c:
            continue
        if n <= cap:
            segs.append((q, 0, n))
            continue
        for o in range(0, n - c + 1, step):
            segs.append((q, o, min(o + step - s + c, n)))
    pieces: list[tuple[QueryBatch, np.ndarray, np.ndarray]] = []
    group: list[tuple[int, int, int]] = []
    size = 0

    def flush() -> None:
        if group:
            qs = [tokens[offsets[q] + a:offsets[q] + b] for q, a, b in group]
            pieces.append((QueryBatch.from_queries(qs, c, s), np.array([g[0] for g in group], np.int64),
                           np.array([g[1] for g in group], np.int64)))

    for seg in segs:
        n = seg[2] - seg[1]
        if group and size + n > cap:
            flush()
            group, size = [], 0
        group.append(seg)
        size += n
    flush()
    return pieces


# --------------------------------------------------------------------------------------
# 2-6. the array probe
# --------------------------------------------------------------------------------------
class ArrayProbe:
    """Steps 2-6 of the module docstring over one array module ``xp`` (numpy or cupy).

    Holds the resident power tables (grown to a power of two, never shrunk). Not
    thread-safe by itself: the owning engine calls it with its lock held.
    """

    def __init__(self, xp: ModuleType = np) -> None:
        self.xp = xp
        self._pow_fwd: Any = None
        self._pow_inv: Any = None
        self._pow_len = 0

    def powers(self, n_tokens: int) -> tuple[Any, Any]:
        """Resident ``(B^k, Binv^k)`` with at least ``n_tokens + 1`` entries (THE hash's tables)."""
        if self._pow_len < n_tokens + 1:
            fw, bw = power_tables(n_tokens + 1)
            self._pow_fwd, self._pow_inv = self.xp.asarray(fw), self.xp.asarray(bw)
            self._pow_len = int(fw.shape[0])
        return self._pow_fwd, self._pow_inv

    def powers_bytes(self) -> int:
        """Bytes the resident power tables take (0 when dropped)."""
        return 0 if self._pow_fwd is None else int(self._pow_fwd.nbytes) + int(self._pow_inv.nbytes)

    def drop_powers(self) -> None:
        """Forget the power tables (rebuilt on the next batch): frees their memory."""
        self._pow_fwd = self._pow_inv = None
        self._pow_len = 0

    def fingerprints(self, tokens: Any, window: int) -> Any:
        """``H[i] = F(tokens[i:i+C])`` for every global position (step 2)."""
        pf, pi = self.powers(int(tokens.shape[0]))
        return prefix_fingerprints(tokens, window, self.xp, pf, pi)

    def coordinates(self, wbase: Any, qstart: Any, windows: int, stride: int) -> tuple[Any, Any, Any]:
        """``(query, cur_st, global start)`` of every valid window, ascending (step 3)."""
        xp = self.xp
        nq = int(qstart.shape[0])
        w = xp.arange(windows, dtype=xp.int64)
        q = xp.searchsorted(wbase[:nq], w, side="right").astype(xp.int64) - 1
        cur = (w - wbase[q]) * stride
        return q, cur, qstart[q] + cur

    def survivors(self, fp: Any, table: Any) -> Any:
        """Boolean survival mask of fingerprints ``fp`` against ``table`` (step 4)."""
        slot, tag = slots_and_tags(fp, int(table.shape[0]) - 1, self.xp)
        v = table[slot]
        return (v == tag) | (v == TAG_SHARED)

    def compact_rows(self, keep: Any, q: Any, cur: Any, fp: Any) -> Any:
        """Packed ``(n, 3)`` uint64 rows of the kept windows, in window order (steps 5-6)."""
        xp = self.xp
        pos = xp.cumsum(keep, dtype=xp.int64)
        n = int(pos[-1]) if pos.shape[0] else 0  # the one synchronisation of the batch
        rows = xp.empty((n, 3), dtype=xp.uint64)
        if n:
            idx = xp.searchsorted(pos, xp.arange(1, n + 1, dtype=xp.int64), side="left")
            rows[:, 0] = q[idx].view(xp.uint64)
            rows[:, 1] = cur[idx].view(xp.uint64)
            rows[:, 2] = fp[idx]
        return rows

    def run(self, tokens: Any, wbase: Any, qstart: Any, plan: WindowPlan, table: Any) -> Any:
        """Steps 2-6 for one batch already on ``xp``: packed survivor rows (on ``xp``)."""
        h = self.fingerprints(tokens, plan.window)
        q, cur, start = self.coordinates(wbase, qstart, plan.windows, plan.stride)
        fp = h[start]
        keep = self.survivors(fp, table)
        return self.compact_rows(keep, q, cur, fp)


def rows_to_candidates(rows: np.ndarray, windows: int, timings: dict[str, float] | None = None) -> Candidates:
    """Unpack host rows ``[query, cur_st, fp]`` (uint64) into fresh, contiguous arrays.

    Always copies, so ``rows`` may be a reused (pinned) staging buffer.
    """
    timings = dict(timings or {})
    n = int(rows.shape[0])
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return Candidates(z, z.copy(), np.zeros(0, dtype=np.uint64), windows, timings)
    return Candidates(rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64),
                      rows[:, 2].astype(np.uint64), windows, timings)


# --------------------------------------------------------------------------------------
# staging: one upload holds the plan and the tokens
# --------------------------------------------------------------------------------------
#: Bytes copied per asynchronous host-to-device piece: the host fills piece i+1 of the
#: pinned buffer while piece i is in flight. 4 MiB is far above the ~10 us per-copy cost.
STAGING_PIECE = 4 << 20


def staging_layout(num_queries: int, num_tokens: int) -> tuple[int, int, int]:
    """Byte offsets ``(qstart_at, tokens_at, total)`` of one upload.

    Layout: ``wbase`` (int64, Q+1) at 0, ``qstart`` (int64, Q), then the tokens (uint32, N).
    Every part starts on an 8-byte boundary.
    """
    qstart_at = 8 * (num_queries + 1)
    tokens_at = qstart_at + 8 * num_queries
    return qstart_at, tokens_at, tokens_at + 4 * num_tokens


def stage_upload(host: np.ndarray, plan: WindowPlan, tokens: np.ndarray | None,
                 copy: Callable[[int, int], None], piece: int = STAGING_PIECE,
                 num_tokens: int | None = None) -> int:
    """Fill the host staging buffer ``host`` (uint8) and hand it to ``copy(offset, nbytes)``
    piece by piece (the GPU engine's ``copy`` starts an asynchronous host-to-device copy).

    Returns the number of bytes staged. ``tokens`` must be C-contiguous uint32, or None when
    the ``num_tokens`` tokens are already in place in ``host`` (decoded straight into it):
    then only the plan is written and the whole buffer goes in one copy.
    """
    nq = plan.num_queries
    n = int(tokens.shape[0]) if tokens is not None else int(num_tokens or 0)
    qstart_at, tokens_at, total = staging_layout(nq, n)
    if host.dtype != np.uint8 or host.shape[0] < total:
        raise ValueError(f"staging buffer too small: need {total} bytes, got {host.shape[0]}")
    host[:qstart_at].view(np.int64)[:] = plan.wbase
    host[qstart_at:tokens_at].view(np.int64)[:] = plan.qstart
    if tokens is None:
        copy(0, total)
        return total
    copy(0, tokens_at)
    src = tokens.view(np.uint8)
    for a in range(0, int(src.shape[0]), piece):
        b = min(a + piece, int(src.shape[0]))
        host[tokens_at + a:tokens_at + b] = src[a:b]
        copy(tokens_at + a, b - a)
    return total


def staging_views(buf: Any, num_queries: int, num_tokens: int) -> tuple[Any, Any, Any]:
    """``(wbase, qstart, tokens)`` views into a staged uint8 buffer (numpy or cupy)."""
    qstart_at, tokens_at, total = staging_layout(num_queries, num_tokens)
    return (buf[:qstart_at].view("int64"), buf[qstart_at:tokens_at].view("int64"),
            buf[tokens_at:total].view("uint32"))


# --------------------------------------------------------------------------------------
# the slot mirror
# --------------------------------------------------------------------------------------
def dedupe_last_write(slots: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Collapse a change log to one write per slot, keeping the *last* (host, numpy).

    A device scatter with repeated indices does not apply them in order, so the log is
    reduced first; the result has unique, ascending slots.
    """
    slots = np.asarray(slots, dtype=np.int64)
    values = np.asarray(values, dtype=np.uint8)
    if slots.shape != values.shape:
        raise ValueError(f"slots and values differ in shape: {slots.shape} vs {values.shape}")
    if slots.size <= 1:
        return slots.copy(), values.copy()
    uniq, first_in_reversed = np.unique(slots[::-1], return_index=True)
    return uniq, values[::-1][first_in_reversed]


class SlotMirror:
    """A copy of a :class:`SlotSource`'s table on ``xp`` (the device), kept current.

    :meth:`sync` asks the source for ``changes_since(generation, version)``: a full upload
    on a new generation (or a trimmed log, or a different source object), otherwise one
    scatter of the deduplicated changes. Idempotent when nothing changed.

    A full upload copies the live host table while writers may still run; writes that land
    during the copy are in the log past the recorded version and are re-applied (in order,
    last write wins) by the next sync, so the mirror converges to the host table.

    Call with the owning engine's lock held. After any failure mid-sync the caller must
    :meth:`invalidate` (the next sync is then a full upload).
    """

    def __init__(self, xp: ModuleType = np, to_device: Callable[[np.ndarray], Any] | None = None) -> None:
        self.xp = xp
        self._to_device = to_device or (lambda a: xp.array(a, copy=True))
        self.table: Any = None
        self.generation = -1
        self.version = -1
        self._source: Any = None  # weakref (or the object itself) of the mirrored source
        self.full_uploads = 0
        self.patches = 0
        self.patched_slots = 0

    def invalidate(self) -> None:
        """Forget the mirrored state: the next :meth:`sync` uploads the whole table."""
        self.table = None
        self.generation = self.version = -1
        self._source = None

    def _same_source(self, slots: Any) -> bool:
        src = self._source
        if src is None:
            return False
        if isinstance(src, weakref.ref):
            return src() is slots
        return src is slots

    def sync(self, slots: SlotSource) -> str:
        """Bring the mirror to the source's current state: ``"full"``, ``"patch"`` or ``"current"``."""
        fresh = self.table is None or not self._same_source(slots)
        gen, ver = (-1, -1) if fresh else (self.generation, self.version)
        ch: SlotChanges = slots.changes_since(gen, ver)
        table = check_table(ch.table)
        if fresh or ch.full or int(table.shape[0]) != int(self.table.shape[0]):
            self.table = self._to_device(table)
            kind = "full"
            self.full_uploads += 1
        elif ch.slots.size:
            s, v = dedupe_last_write(ch.slots, ch.values)
            if s[0] < 0 or s[-1] >= int(self.table.shape[0]):
                raise ValueError(f"change log names slot {int(s[0]) if s[0] < 0 else int(s[-1])} "
                                 f"outside a table of {int(self.table.shape[0])}")
            self.table[self._to_device(s)] = self._to_device(v)
            kind = "patch"
            self.patches += 1
            self.patched_slots += int(s.size)
        else:
            kind = "current"
        self.generation, self.version = int(ch.generation), int(ch.version)
        try:
            self._source = weakref.ref(slots)
        except TypeError:  # a source without weakref support: keep it alive instead
            self._source = slots
        return kind


class TrialSlots:
    """A minimal in-memory :class:`SlotSource` with a change log (self-tests, benchmarks).

    ``gpu`` may not import ``index``; this stands in for ``index.slots.SlotArray`` where the
    engines must be exercised on their own. Writes apply in order (last write wins).
    """

    Changes = SlotChanges

    def __init__(self, table: np.ndarray) -> None:
        self.table = check_table(np.array(table, dtype=np.uint8, copy=True))
        self.filter_arrays = (self.table, occupancy_words(self.table))
        self.generation = 0
        self.version = 0
        self._base = 0
        self._log_s: list[np.ndarray] = []
        self._log_v: list[np.ndarray] = []

    @property
    def mask(self) -> int:
        return int(self.table.shape[0]) - 1

    def changes_since(self, generation: int, version: int) -> "TrialSlots.Changes":
        full = generation != self.generation or version < self._base or version > self.version
        if full or version == self.version or not self._log_s:
            e = np.zeros(0, dtype=np.int64)
            return self.Changes(self.generation, self.version, full, self.table, e, e.astype(np.uint8))
        s = np.concatenate(self._log_s)[version - self._base:]
        v = np.concatenate(self._log_v)[version - self._base:]
        return self.Changes(self.generation, self.version, False, self.table, s, v)

    def write(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` to ``slots`` in order and log each write."""
        s = np.asarray(slots, dtype=np.int64)
        v = np.asarray(values, dtype=np.uint8)
        us, uv = dedupe_last_write(s, v)
        self.table[us] = uv
        self.filter_arrays = (self.table, occupancy_words(self.table))  # a full pass: test sizes
        self._log_s.append(s.copy())
        self._log_v.append(v.copy())
        self.version += int(s.size)

    def replace(self, table: np.ndarray) -> None:
        """Swap in a new table (a rebuild: new generation, log cleared)."""
        self.table = check_table(np.array(table, dtype=np.uint8, copy=True))
        self.filter_arrays = (self.table, occupancy_words(self.table))
        self.generation += 1
        self.version += 1
        self._base = self.version
        self._log_s, self._log_v = [], []


# --------------------------------------------------------------------------------------
# engines
# --------------------------------------------------------------------------------------
class MirroredEngine:
    """Shared engine shell: input checks, one lock, batch splitting, memory-pressure retries,
    run-time errors as :class:`EngineFailure`.

    Subclasses implement :meth:`_run` (called with the lock held, for a batch with at least
    one valid window and at most :attr:`max_pass_tokens` tokens) returning host rows and
    timings. Lock order: the engine lock is taken inside ``probe`` only, and the slot
    source's own lock (``changes_since``) nests inside it.

    Passes: a batch over ``max_pass_tokens`` (never above :data:`SCAN_LIMIT`) runs as several
    passes (:func:`split_batch`) whose candidates are concatenated. Memory pressure (an error
    :meth:`_is_out_of_memory` recognises) is not a broken device: the engine frees its
    cached memory (:meth:`_free_memory`) and retries the batch, first as it was, then in
    passes half as long each time, down to :data:`MIN_PASS_TOKENS`; only then does it raise
    :class:`EngineOutOfMemory`. ``oom_retries`` counts the retries, ``split_batches`` the
    batches that ran in more than one pass.
    """

    name = "mirrored"

    def __init__(self, reason: str = "", max_pass_tokens: int = SCAN_LIMIT) -> None:
        self.reason = reason
        self._lock = threading.Lock()
        self._closed = False
        self.batches = 0
        self.failures = 0
        self.oom_retries = 0
        self.split_batches = 0
        self.max_pass_tokens = max_pass_tokens
        self._mirror: SlotMirror

    @property
    def max_pass_tokens(self) -> int:
        """Tokens one pass may hold (at most :data:`SCAN_LIMIT`)."""
        return self._max_pass_tokens

    @max_pass_tokens.setter
    def max_pass_tokens(self, value: int) -> None:
        value = int(value)
        if value < 1:
            raise ValueError(f"max_pass_tokens must be >= 1, got {value}")
        self._max_pass_tokens = min(value, SCAN_LIMIT)

    # -- the Engine protocol --------------------------------------------------------------
    def probe(self, batch: QueryBatch, slots: SlotSource) -> Candidates:
        """Candidates of ``batch`` against ``slots`` (see ``gpu/engine.py`` for the contract).

        ``ValueError`` for bad input (checked before any device work); :class:`EngineFailure`
        (wrapping the original error) for anything that goes wrong while probing, and
        :class:`EngineOutOfMemory` when even the smallest passes do not fit.
        """
        check_table(slots.table)
        plan = plan_windows(batch)
        with self._lock:
            if self._closed:
                raise EngineFailure(f"the {self.name} engine is closed")
            if plan.windows == 0:
                return Candidates.empty(0)
            return self._run_sync(batch, plan, slots, time.perf_counter())

    def _run_sync(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource, t0: float) -> Candidates:
        """One batch, synchronously, with :meth:`_run_adaptive`'s retries (lock held); every
        run-time error becomes :class:`EngineFailure` (:meth:`_failed`)."""
        try:
            rows, timings = self._run_adaptive(batch, plan, slots)
        except Exception as exc:  # noqa: BLE001 - every run-time error becomes EngineFailure
            self._failed(exc)
        self.batches += 1
        timings["total_s"] = time.perf_counter() - t0
        return rows_to_candidates(rows, plan.windows, timings)

    def _failed(self, exc: BaseException) -> NoReturn:
        """Count a run-time failure, let the subclass clean up, raise it as an engine error."""
        self.failures += 1
        self._after_failure()
        if isinstance(exc, EngineError):
            raise exc
        raise EngineFailure(f"the {self.name} engine failed at run time: {type(exc).__name__}: {exc}") from exc

    #: Whether :meth:`probe_async` overlaps batches on a device (``CupyEngine``'s fused
    #: kernels); here a handle is answered at submit.
    pipelined = False

    def probe_async(self, batch: QueryBatch, slots: SlotSource) -> "ProbeHandle":
        """Submit ``batch`` and return a handle whose ``result()`` gives what :meth:`probe`
        gives, bit for bit. Bad input raises ``ValueError`` here; a run-time failure raises
        :class:`EngineFailure` here or from ``result()``. An engine whose :meth:`_submit`
        does the work (the default) answers the batch here."""
        check_table(slots.table)
        plan = plan_windows(batch)
        with self._lock:
            if self._closed:
                raise EngineFailure(f"the {self.name} engine is closed")
            if plan.windows == 0:
                return ReadyProbe(Candidates.empty(0))
            t0 = time.perf_counter()
            error: BaseException | None = None
            try:
                if batch.num_tokens <= self.max_pass_tokens:
                    jobs = [(self._submit(batch, plan, slots), None, None)]
                else:
                    self.split_batches += 1
                    jobs = [(self._submit(piece, p_plan, slots), query, offset)
                            for piece, query, offset in split_batch(batch, self.max_pass_tokens)
                            for p_plan in (plan_windows(piece),) if p_plan.windows]
            except Exception as exc:  # noqa: BLE001 - sorted by _handle_async_error
                error = exc
            if error is not None:  # outside the except block: the failed submit's frames can go
                return ReadyProbe(self._handle_async_error(error, batch, plan, slots, t0))
        return _MirroredProbe(self, batch, plan, slots, jobs, t0)

    def _finish_async(self, probe: "_MirroredProbe") -> Candidates:
        """Collect ``probe``'s passes (lock held) into its candidates."""
        try:
            if len(probe.jobs) == 1 and probe.jobs[0][1] is None:
                rows, timings = self._collect(probe.jobs[0][0])
            else:
                parts, timings = [], {}
                for job, query, offset in probe.jobs:
                    r, t = self._collect(job)
                    parts.append(_map_rows(r, query, offset))
                    for k, v in t.items():
                        timings[k] = timings.get(k, 0.0) + v
                rows = np.concatenate(parts) if parts else np.zeros((0, 3), np.uint64)
            timings = dict(timings)
        except Exception as exc:  # noqa: BLE001 - sorted by _handle_async_error
            error: BaseException | None = exc
        else:
            error = None
        if error is not None:  # outside the except block: the failed collect's frames can go
            probe.jobs = []
            return self._handle_async_error(error, probe.batch, probe.plan, probe.slots, probe.t0)
        self._after_collect()
        self.batches += 1
        timings["total_s"] = time.perf_counter() - probe.t0
        return rows_to_candidates(rows, probe.plan.windows, timings)

    def _handle_async_error(self, exc: BaseException, batch: QueryBatch, plan: WindowPlan, slots: SlotSource,
                            t0: float) -> Candidates:
        """A pipelined batch that failed (lock held): memory pressure -> the batch again,
        synchronously, with :meth:`probe`'s retries; anything else -> :class:`EngineFailure`."""
        if self._closed or isinstance(exc, EngineError) or not self._is_out_of_memory(exc):
            self._failed(exc)
        # memory pressure: the failed attempt's device arrays must not stay alive through the
        # retries (its traceback holds the frames that allocated them)
        exc.__traceback__ = None
        self._abandon()
        return self._run_sync(batch, plan, slots, t0)

    def lend_tokens(self, num_queries: int, num_tokens: int) -> np.ndarray | None:
        """Pinned memory to decode a batch's tokens into (``CupyEngine``); None here."""
        return None

    def _run_adaptive(self, batch: QueryBatch, plan: WindowPlan,
                      slots: SlotSource) -> tuple[np.ndarray, dict[str, float]]:
        """:meth:`_run_passes`, retried on memory pressure (see the class docstring)."""
        limit = min(self.max_pass_tokens, max(batch.num_tokens, 1))
        floor = max(MIN_PASS_TOKENS, batch.window + batch.stride)
        retried_same = False
        while True:
            try:
                return self._run_passes(batch, plan, slots, limit)
            except Exception as exc:  # noqa: BLE001 - sorted below
                if not self._is_out_of_memory(exc):
                    raise
                self._after_failure()
                self._free_memory()
                if retried_same and limit <= floor:
                    raise EngineOutOfMemory(
                        f"the {self.name} engine ran out of memory even in passes of {limit} tokens "
                        f"after freeing its cached memory ({type(exc).__name__}: {exc})") from exc
                self.oom_retries += 1
                if retried_same:
                    limit = max(floor, limit // 2)
                retried_same = True
                log.warning("%s engine: out of memory on a batch of %d tokens (%s); freed cached memory, "
                            "retrying in passes of at most %d tokens", self.name, batch.num_tokens,
                            type(exc).__name__, limit)

    def _run_passes(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource,
                    limit: int) -> tuple[np.ndarray, dict[str, float]]:
        """The batch in one :meth:`_run`, or in passes of at most ``limit`` tokens."""
        if batch.num_tokens <= limit:
            return self._run(batch, plan, slots)
        self.split_batches += 1
        parts: list[np.ndarray] = []
        timings: dict[str, float] = {}
        for piece, query, offset in split_batch(batch, limit):
            p_plan = plan_windows(piece)
            if p_plan.windows == 0:
                continue
            rows, t = self._run(piece, p_plan, slots)
            parts.append(_map_rows(rows, query, offset))
            for k, v in t.items():
                timings[k] = timings.get(k, 0.0) + v
        rows = np.concatenate(parts) if parts else np.zeros((0, 3), np.uint64)
        return rows, timings

    def close(self) -> None:
        """Release resources; idempotent. Later probes raise :class:`EngineFailure`."""
        with self._lock:
            self._closed = True
            self._mirror.invalidate()
            self._release()

    def stats(self) -> dict[str, Any]:
        m = self._mirror
        return {"engine": self.name, "batches": self.batches, "failures": self.failures,
                "oom_retries": self.oom_retries, "split_batches": self.split_batches,
                "full_uploads": m.full_uploads, "patches": m.patches, "patched_slots": m.patched_slots}

    # -- hooks ------------------------------------------------------------------------------
    def _run(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource) -> tuple[np.ndarray, dict[str, float]]:
        raise NotImplementedError

    def _submit(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource) -> Any:
        """Start one pass (lock held); :meth:`_collect` gives its ``(rows, timings)``. By
        default the pass runs here, synchronously."""
        return self._run(batch, plan, slots)

    def _collect(self, job: Any) -> tuple[np.ndarray, dict[str, float]]:
        """Wait for a pass :meth:`_submit` started (lock held)."""
        return job

    def _after_collect(self) -> None:
        """After a pipelined batch was collected (lock held): trim memory."""

    def _abandon(self) -> None:
        """Before a pipelined batch is run again synchronously after memory pressure (lock
        held): let go of what its own passes still hold on the device."""

    def _is_out_of_memory(self, exc: BaseException) -> bool:
        """Whether ``exc`` is memory pressure (retry smaller) rather than a failure."""
        return isinstance(exc, MemoryError)

    def _free_memory(self) -> None:
        """Give cached memory back before a retry (device engines: their pools)."""

    def _after_failure(self) -> None:
        self._mirror.invalidate()

    def _release(self) -> None:
        pass


def _map_rows(rows: np.ndarray, query: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """A pass's rows in the batch's coordinates (``split_batch``'s ``query``/``offset``)."""
    mapped = np.array(rows, dtype=np.uint64, copy=True)  # rows may be a reused pinned buffer
    local = rows[:, 0].astype(np.int64)
    mapped[:, 0] = query[local].astype(np.uint64)
    mapped[:, 1] = (rows[:, 1].astype(np.int64) + offset[local]).astype(np.uint64)
    return mapped


class _MirroredProbe:
    """The handle :meth:`MirroredEngine.probe_async` returns: its passes in flight."""

    def __init__(self, engine: MirroredEngine, batch: QueryBatch, plan: WindowPlan, slots: SlotSource,
                 jobs: list, t0: float) -> None:
        self.engine, self.batch, self.plan, self.slots, self.jobs, self.t0 = engine, batch, plan, slots, jobs, t0
        self._result: Candidates | None = None

    def result(self) -> Candidates:
        """The batch's candidates (waits for the device once; later calls return them again)."""
        if self._result is None:
            with self.engine._lock:
                if self._result is None:
                    self._result = self.engine._finish_async(self)
                    self.jobs = []
        return self._result


class XpEngine(MirroredEngine):
    """The GPU engine's array algorithm as an engine over any array module ``xp``.

    ``XpEngine(numpy)`` (name ``"xp-numpy"``) runs in CI and is what proves the GPU path's
    logic on the CPU: window enumeration, THE hash's prefix form, slot/tag, survival rule,
    cumsum compaction and packing, and the slot mirror's full-upload / patch logic (the
    mirror here is a separate numpy copy, patched only through the change log). With
    ``xp=cupy`` it is the GPU engine's ``kernels="array"`` path minus pinned staging.
    Thread-safe (one lock per engine).
    """

    def __init__(self, xp: ModuleType = np, reason: str = "", max_pass_tokens: int = SCAN_LIMIT) -> None:
        super().__init__(reason, max_pass_tokens)
        self.xp = xp
        self.name = f"xp-{getattr(xp, '__name__', 'xp')}"
        self._array = ArrayProbe(xp)
        self._mirror = SlotMirror(xp)
        self._to_host: Callable[[Any], np.ndarray] = getattr(xp, "asnumpy", np.asarray)

    def _run(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource) -> tuple[np.ndarray, dict[str, float]]:
        xp = self.xp
        t0 = time.perf_counter()
        self._mirror.sync(slots)
        t1 = time.perf_counter()
        tokens = xp.asarray(np.ascontiguousarray(batch.tokens))
        wbase, qstart = xp.asarray(plan.wbase), xp.asarray(plan.qstart)
        t2 = time.perf_counter()
        rows = self._array.run(tokens, wbase, qstart, plan, self._mirror.table)
        t3 = time.perf_counter()
        host = self._to_host(rows)
        t4 = time.perf_counter()
        return host, {"sync_s": t1 - t0, "upload_s": t2 - t1, "kernels_s": t3 - t2, "copyback_s": t4 - t3}


def create_xp_engine(xp: ModuleType | str = "numpy", reason: str = "") -> XpEngine:
    """Factory for the benchmark and tests: ``create_xp_engine("numpy")`` is ``"xp-numpy"``."""
    if isinstance(xp, str):
        if xp != "numpy":
            raise ValueError(f"xp must be 'numpy' or an array module, got {xp!r}")
        xp = np
    return XpEngine(xp, reason=reason or "asked for by name")

