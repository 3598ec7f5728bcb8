"""The CPU engine: numba, ``nogil``, parallel across the batch.

Where there is no GPU (CI, laptops) this engine answers, and it takes over when a GPU fails.

How it is fast:
- The batch's valid windows are cut into *work items* of at most ``ITEM_WINDOWS`` windows,
  never straddling a query, so one long query still spreads over every core; ``prange``
  runs the items in parallel with the GIL released.
- Small batches (< ``PARALLEL_MIN_WINDOWS`` windows) run serially on the calling thread,
  which keeps their latency free of thread wake-ups and barrier waits.
- Inside an item the rolling form (``fingerprint.roll_step``) costs O(1) per token; each
  item starts with one direct chunk fingerprint. For ``stride >= C`` windows do not
  overlap and are fingerprinted directly.
- Hashing and probing run in three passes over sub-blocks of ``LANE`` windows: pass one
  computes fingerprints and mixed values into a small buffer and prefetches each window's
  occupancy word (``gpu/occupancy.py``: one bit per slot, an eighth of the table, so it
  stays in L2 where the table does not); pass two keeps the windows whose slot is
  occupied (about 6%) and prefetches their slot bytes; pass three applies the tag rule.
  The memory reads are then independent of the hash chain and few of them leave L2.
  Measured here (Intel Xeon, 2 MiB L2, 16 x 32K-token batches, 25% hits): 5.2-5.9 ns per
  window with the two-pass table probe, 2.2-2.4 ns with the bits, at 100k-1M chunks.
- Each item writes its survivors into its own region of the output (region = its first
  global window index), so there is no synchronisation; one gather compacts them in
  ascending order.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .fingerprint import B_U64, base_powers, mix64_scalar, roll_step, tag_of_mixed
from .occupancy import is_occupied

from .batch import Candidates, QueryBatch
from .engine import SlotSource

__all__ = ["CpuEngine", "ITEM_WINDOWS", "LANE"]

#: Windows per work item: large enough to amortise the direct start-up hash (C multiplies),
#: small enough that a 32K-token query splits into several items for the cores.
ITEM_WINDOWS = 8192
#: Windows per hash-then-probe sub-block (fits in L1 with room to spare).
LANE = 64

#: Batches with fewer windows run on the calling thread. A parallel region ends at a barrier
#: that waits for every worker; when another process (or the service's own event loop) holds
#: the other core, a worker is descheduled and the barrier waits out a scheduler slice:
#: measured here, a 32K-window probe took 12-16 ms in parallel under load against 0.4-0.6 ms
#: serially. A quarter of a million windows (about 1.1 ms of serial work with the occupancy
#: bits; 16 x 32K-token batches, half a million windows, gain 1.6-1.9x from two threads on a
#: quiet machine) amortises that risk on a machine of 2 or fewer engine threads, and keeps
#: the service's default batch (``max_batch_tokens`` 2^18 tokens, so fewer than 2^18 windows)
#: on the calling thread, where the event loop's core is often busy. With more threads a
#: region's work per thread is small and the service's default batch must still spread over
#: the cores, so the bar drops to 64K windows there. Decided when the engine is built
#: (``numba``'s thread count, which the service sets from ``--engine-threads``).
PARALLEL_MIN_WINDOWS = 1 << 18
PARALLEL_MIN_WINDOWS_MANY_THREADS = 1 << 16


def default_parallel_min_windows() -> int:
    """The parallel threshold for this process (see ``PARALLEL_MIN_WINDOWS``)."""
    return PARALLEL_MIN_WINDOWS if numba.get_num_threads() <= 2 else PARALLEL_MIN_WINDOWS_MANY_THREADS

#: One parallel probe at a time per process: each already uses every core, and numba's
#: fallback "workqueue" threading layer aborts on concurrent parallel launches (OpenMP and
#: TBB merely oversubscribe). Readers of other engines are not affected.
_PARALLEL_LOCK = threading.Lock()


@intrinsic
def _prefetch(typingctx, arr, idx):  # pragma: no cover - compiled
    """``llvm.prefetch`` of ``arr[idx]`` (read, high locality): starts the slot's cache miss
    while the next windows are still being hashed. A hint only; never faults."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def _plan_items(offsets, c, stride, item_windows):  # pragma: no cover - compiled
    """Work items ``(query, first window number in query, count, global window base)``."""
    nq = offsets.shape[0] - 1
    total_items = 0
    for q in range(nq):
        span = offsets[q + 1] - offsets[q] - c + 1
        if span > 0:
            nw = (span + stride - 1) // stride
            total_items += (nw + item_windows - 1) // item_windows
    items = np.empty((total_items, 4), dtype=np.int64)
    k = 0
    base = 0
    for q in range(nq):
        span = offsets[q + 1] - offsets[q] - c + 1
        if span <= 0:
            continue
        nw = (span + stride - 1) // stride
        w0 = 0
        while w0 < nw:
            cnt = min(item_windows, nw - w0)
            items[k, 0] = q
            items[k, 1] = w0
            items[k, 2] = cnt
            items[k, 3] = base
            base += cnt
            w0 += cnt
            k += 1
    return items, base


@numba.njit(inline="always", nogil=True)
def _probe_body(tokens, offsets, c, stride, table, words, mask, pows, items, total):  # pragma: no cover
    n_items = items.shape[0]
    out_st = np.empty(total, dtype=np.int64)
    out_fp = np.empty(total, dtype=np.uint64)
    counts = np.zeros(n_items, dtype=np.int64)
    top = pows[0]
    umask = np.uint64(mask)
    rolling = stride < c
    for it in numba.prange(n_items):
        q = items[it, 0]
        w0 = items[it, 1]
        cnt = items[it, 2]
        base = items[it, 3]
        qstart = offsets[q]
        lane_mixed = np.empty(LANE, dtype=np.uint64)
        lane_fp = np.empty(LANE, dtype=np.uint64)
        lane_sel = np.empty(LANE, dtype=np.int64)
        k = 0
        h = np.uint64(0)
        pos = qstart + w0 * stride  # absolute start of the current window
        if rolling:
            for i in range(c):
                h = h * B_U64 + np.uint64(tokens[pos + i])
        done = 0
        while done < cnt:
            m = min(LANE, cnt - done)
            # pass one: fingerprints of the next m windows (the stride-1 rolling loop on its
            # own: a branch or an inner loop in it costs a third of the probe)
            if rolling and stride == 1:
                for j in range(m):
                    if done + j > 0:
                        h = roll_step(h, tokens[pos], tokens[pos + c], top)
                        pos += 1
                    lane_fp[j] = h
            else:
                for j in range(m):
                    if rolling:
                        if done + j > 0:
                            for _ in range(stride):
                                h = roll_step(h, tokens[pos], tokens[pos + c], top)
                                pos += 1
                    else:
                        pos = qstart + (w0 + done + j) * stride
                        h = np.uint64(0)
                        for i in range(c):
                            h += np.uint64(tokens[pos + i]) * pows[i]
                    lane_fp[j] = h
            # mixed values; start the fetch of each window's occupancy word
            for j in range(m):
                mixed = mix64_scalar(lane_fp[j])
                lane_mixed[j] = mixed
                _prefetch(words, np.int64((mixed & umask) >> np.uint64(6)))
            # pass two: keep the windows whose slot is occupied (about 6% at the table's
            # load) and start the fetch of their slot bytes
            n = 0
            for j in range(m):
                sl = np.int64(lane_mixed[j] & umask)
                if is_occupied(words, sl):
                    _prefetch(table, sl)
                    lane_sel[n] = j
                    n += 1
            # pass three: the filter rule on those slots (independent loads)
            for t in range(n):
                j = lane_sel[t]
                mixed = lane_mixed[j]
                v = table[np.int64(mixed & umask)]
                if v == tag_of_mixed(mixed) or v == 255:
                    out_st[base + k] = (w0 + done + j) * stride
                    out_fp[base + k] = lane_fp[j]
                    k += 1
            done += m
        counts[it] = k
    # compact (ascending: items are ordered by query, then position)
    n_out = 0
    for it in range(n_items):
        n_out += counts[it]
    qi = np.empty(n_out, dtype=np.int64)
    st = np.empty(n_out, dtype=np.int64)
    fp = np.empty(n_out, dtype=np.uint64)
    o = 0
    for it in range(n_items):
        base = items[it, 3]
        for j in range(counts[it]):
            qi[o] = items[it, 0]
            st[o] = out_st[base + j]
            fp[o] = out_fp[base + j]
            o += 1
    return qi, st, fp


# One body, two compilations: ``prange`` is a plain range in the serial one. Each has its own
# Python function because numba's on-disk cache is keyed by the function (its file, name and
# line), not by the compile flags: ``njit(parallel=True)(f)`` and ``njit(f)`` of one ``f``
# share one cache entry, and a process then loads whichever was compiled first for both.
# That is what happened before (the "parallel" probe ran serially on a warm cache: 2.3 ms
# for 16 x 32K windows in both, 1.4 ms when compiled fresh). The body is inlined at numba IR
# level, before the parallel pass, so the parallel wrapper still sees the ``prange``.
@numba.njit(cache=True, nogil=True, parallel=True)
def _probe_parallel(tokens, offsets, c, stride, table, words, mask, pows, items, total):  # pragma: no cover
    return _probe_body(tokens, offsets, c, stride, table, words, mask, pows, items, total)


@numba.njit(cache=True, nogil=True)
def _probe_serial(tokens, offsets, c, stride, table, words, mask, pows, items, total):  # pragma: no cover
    return _probe_body(tokens, offsets, c, stride, table, words, mask, pows, items, total)


class CpuEngine:
    """numba engine; thread-safe (no state besides compiled code)."""

    name = "cpu"

    def __init__(self, reason: str = "", item_windows: int = ITEM_WINDOWS,
                 parallel_min_windows: int | None = None) -> None:
        if item_windows < 1:
            raise ValueError(f"item_windows must be >= 1, got {item_windows}")
        if parallel_min_windows is None:
            parallel_min_windows = default_parallel_min_windows()
        if parallel_min_windows < 0:
            raise ValueError(f"parallel_min_windows must be >= 0, got {parallel_min_windows}")
        self.reason = reason
        self.item_windows = item_windows
        self.parallel_min_windows = parallel_min_windows

    def probe(self, batch: QueryBatch, slots: SlotSource) -> Candidates:
        table, words = slots.filter_arrays  # one snapshot for the whole batch (a rebuild swaps both)
        if words.dtype != np.uint64 or words.shape[0] != (table.shape[0] + 63) >> 6:
            raise ValueError(f"occupancy words {words.dtype}[{words.shape[0]}] do not fit a table of "
                             f"{table.shape[0]} slots")  # the kernel does not bounds-check
        items, total = _plan_items(batch.offsets, batch.window, batch.stride, self.item_windows)
        if total == 0:
            return Candidates.empty(0)
        args = (batch.tokens, batch.offsets, batch.window, batch.stride, table, words, table.shape[0] - 1,
                base_powers(batch.window), items, total)
        if total >= self.parallel_min_windows and items.shape[0] > 1:
            with _PARALLEL_LOCK:
                qi, st, fp = _probe_parallel(*args)
        else:
            qi, st, fp = _probe_serial(*args)
        return Candidates(qi, st, fp, int(total))

    def close(self) -> None:
        pass
