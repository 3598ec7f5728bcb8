"""The CPU engine: numba, ``nogil``, parallel across the batch.

Where there is no GPU (CI, laptops) this engine answers, and it takes over when a GPU fails.

How it is fast:
- The batch's valid windows are cut into *work items* of at most ``ITEM_WINDOWS`` windows,
  never straddling a query, so one long query still spreads over every core; ``prange``
  runs the items in parallel with the GIL released.
- Small batches (< ``PARALLEL_MIN_WINDOWS`` windows) run serially on the calling thread,
  which keeps their latency free of thread wake-ups and barrier waits.
- Inside an item the rolling form costs O(1) per token; each item starts with one direct
  chunk fingerprint. For ``stride >= C`` windows do not overlap and are fingerprinted directly.
- At stride 1 (the service's default) an item runs as ``CHAINS`` independent rolling chains
  over equal segments of its windows: one chain is bound by its multiply-add latency (about
  1.3 ns a window here), four overlap.
- Work goes in lanes of ``LANE`` windows per chain: hash, then mix (a loop of its own, so it
  vectorises), then keep the windows whose slot is occupied (the occupancy bits,
  ``gpu/occupancy.py``: one bit per slot, an eighth of the table, so it stays in L2 where the
  table does not; about 6% of windows go on), prefetch their slot bytes, apply the tag rule.
  Measured here (AMD EPYC, 1 MiB L2 a core; 16 x 8K-token queries, 2M-slot table; serial):
  3.2 ns per window with one chain and the lane of 64 that prefetched every occupancy word,
  1.7 ns with four chains, lanes of 256 and the branch-free selection (``_keep``). Earlier
  (Intel Xeon, 2 MiB L2, 16 x 32K-token batches): 5.2-5.9 ns per window with the two-pass
  table probe, 2.2-2.4 ns with the bits, at 100k-1M chunks.
- Each item (each chain's segment of it) writes its survivors into its own region of the
  output (region = its first global window index), so there is no synchronisation; one
  gather compacts them in ascending order.
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
from .engine import ReadyProbe, SlotSource

__all__ = ["CHAINS", "CpuEngine", "ITEM_WINDOWS", "LANE"]

#: Windows per work item: large enough to amortise the direct start-up hash (C multiplies),
#: small enough that a 32K-token query splits into several items for the cores.
ITEM_WINDOWS = 8192
#: Windows per hash-then-probe sub-block and chain (``CHAINS`` lanes of fingerprints and mixed
#: values, 16 KiB, fit in L1 with room to spare; 256 measured 4% faster than 64).
LANE = 256
#: Independent rolling chains per work item at stride 1 (``_item_stride1``). The kernel
#: spells the four chains out as scalars (a small array would live in memory, not registers).
CHAINS = 4

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
def _keep(words, table, umask, fps, mixed, b0, m, sel, out_st, out_fp, o, k, first_window, stride):  # pragma: no cover
    """Passes two and three over ``m`` buffered windows (``fps``/``mixed`` from ``b0``): keep the
    windows whose slot is occupied, then apply the tag rule to their slot bytes. Appends
    survivors at ``out[o + k]`` and returns the new ``k``.

    The selection is branch-free (``sel[n] = j; n += bit``): at about 6% occupied slots a
    branch mispredicts on every survivor, and the loop ran 12% slower with one. The slot
    bytes of the kept windows are prefetched before the rule reads them, so those (mostly
    L3) reads overlap."""
    n = 0
    for j in range(m):
        sl = np.int64(mixed[b0 + j] & umask)
        sel[n] = j
        n += np.int64((words[sl >> 6] >> np.uint64(sl & 63)) & np.uint64(1))
    for t in range(n):
        _prefetch(table, np.int64(mixed[b0 + sel[t]] & umask))
    for t in range(n):
        j = sel[t]
        mx = mixed[b0 + j]
        v = table[np.int64(mx & umask)]
        if v == tag_of_mixed(mx) or v == 255:
            out_st[o + k] = (first_window + j) * stride
            out_fp[o + k] = fps[b0 + j]
            k += 1
    return k


@numba.njit(inline="always", nogil=True)
def _mix_lane(fps, mixed, b0, m):  # pragma: no cover - compiled
    """``mixed = mix64(fps)`` over one lane: a loop on its own, so LLVM vectorises it."""
    for j in range(m):
        mixed[b0 + j] = mix64_scalar(fps[b0 + j])


@numba.njit(inline="always", nogil=True)
def _item_stride1(tokens, pos, c, w0, cnt, topb, words, table, umask, out_st, out_fp, base, counts, starts, it):  # pragma: no cover
    """One work item at stride 1, as ``CHAINS`` independent rolling chains.

    The item's windows are cut into ``CHAINS`` equal segments (the last also takes the
    remainder); each starts with one direct fingerprint and then rolls. One chain is bound
    by its own latency (multiply then add, about 4 cycles a window); four interleaved chains
    let the core overlap them. The roll is written ``h*B + (in - out*B^C)`` (``topb`` =
    B^(C-1)*B mod 2^64), equal to ``roll_step`` modulo 2^64 but with one multiply and one add
    on the chain. Segment ``s`` writes its survivors from ``out[base + starts[it, s]]`` and
    counts them in ``counts[it, s]``, so the compaction keeps ascending order."""
    seg = cnt // CHAINS
    fps = np.empty(CHAINS * LANE, dtype=np.uint64)
    mixed = np.empty(CHAINS * LANE, dtype=np.uint64)
    sel = np.empty(LANE, dtype=np.int64)
    p0 = pos
    p1 = p0 + seg
    p2 = p1 + seg
    p3 = p2 + seg
    for s in range(CHAINS):
        starts[it, s] = s * seg
    h0 = np.uint64(0)
    h1 = np.uint64(0)
    h2 = np.uint64(0)
    h3 = np.uint64(0)
    if seg > 0:
        for i in range(c):
            h0 = h0 * B_U64 + np.uint64(tokens[p0 + i])
            h1 = h1 * B_U64 + np.uint64(tokens[p1 + i])
            h2 = h2 * B_U64 + np.uint64(tokens[p2 + i])
            h3 = h3 * B_U64 + np.uint64(tokens[p3 + i])
    done = 0
    while done < seg:
        m = min(LANE, seg - done)
        j0 = 0
        if done == 0:  # each segment's first window is its direct fingerprint
            fps[0] = h0
            fps[LANE] = h1
            fps[2 * LANE] = h2
            fps[3 * LANE] = h3
            j0 = 1
        for j in range(j0, m):
            h0 = h0 * B_U64 + (np.uint64(tokens[p0 + c]) - np.uint64(tokens[p0]) * topb)
            h1 = h1 * B_U64 + (np.uint64(tokens[p1 + c]) - np.uint64(tokens[p1]) * topb)
            h2 = h2 * B_U64 + (np.uint64(tokens[p2 + c]) - np.uint64(tokens[p2]) * topb)
            h3 = h3 * B_U64 + (np.uint64(tokens[p3 + c]) - np.uint64(tokens[p3]) * topb)
            p0 += 1
            p1 += 1
            p2 += 1
            p3 += 1
            fps[j] = h0
            fps[LANE + j] = h1
            fps[2 * LANE + j] = h2
            fps[3 * LANE + j] = h3
        for s in range(CHAINS):
            _mix_lane(fps, mixed, s * LANE, m)
        for s in range(CHAINS):
            counts[it, s] = _keep(words, table, umask, fps, mixed, s * LANE, m, sel, out_st, out_fp,
                                  base + s * seg, counts[it, s], w0 + s * seg + done, 1)
        done += m
    # the remainder (fewer than CHAINS windows) continues the last chain; with seg == 0 the
    # whole item is that remainder, started directly
    k = counts[it, CHAINS - 1]
    w = CHAINS * seg
    if seg == 0:
        p3 = p0
        for i in range(c):
            h3 = h3 * B_U64 + np.uint64(tokens[p3 + i])
    while w < cnt:
        if w > 0:
            h3 = h3 * B_U64 + (np.uint64(tokens[p3 + c]) - np.uint64(tokens[p3]) * topb)
            p3 += 1
        fps[0] = h3
        mixed[0] = mix64_scalar(h3)
        k = _keep(words, table, umask, fps, mixed, 0, 1, sel, out_st, out_fp,
                  base + (CHAINS - 1) * seg, k, w0 + w, 1)
        w += 1
    counts[it, CHAINS - 1] = k


@numba.njit(inline="always", nogil=True)
def _item_strided(tokens, qstart, c, stride, w0, cnt, pows, words, table, umask, out_st, out_fp, base, counts, it):  # pragma: no cover
    """One work item at stride > 1: rolling (``stride < C``, ``stride`` steps a window) or
    direct (``stride >= C``: windows do not overlap). One chain; survivors in segment 0."""
    top = pows[0]
    rolling = stride < c
    fps = np.empty(LANE, dtype=np.uint64)
    mixed = np.empty(LANE, dtype=np.uint64)
    sel = np.empty(LANE, dtype=np.int64)
    k = 0
    h = np.uint64(0)
    pos = qstart + w0 * stride  # absolute start of the current window
    if rolling:
        for i in range(c):
            h = h * B_U64 + np.uint64(tokens[pos + i])
    done = 0
    while done < cnt:
        m = min(LANE, cnt - done)
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
            fps[j] = h
        _mix_lane(fps, mixed, 0, m)
        k = _keep(words, table, umask, fps, mixed, 0, m, sel, out_st, out_fp, base, k, w0 + done, stride)
        done += m
    counts[it, 0] = k


@numba.njit(inline="always", nogil=True)
def _probe_body(tokens, offsets, c, stride, table, words, mask, pows, items, total):  # pragma: no cover
    n_items = items.shape[0]
    out_st = np.empty(total, dtype=np.int64)
    out_fp = np.empty(total, dtype=np.uint64)
    counts = np.zeros((n_items, CHAINS), dtype=np.int64)
    starts = np.zeros((n_items, CHAINS), dtype=np.int64)
    topb = pows[0] * B_U64
    umask = np.uint64(mask)
    for it in numba.prange(n_items):
        q = items[it, 0]
        w0 = items[it, 1]
        cnt = items[it, 2]
        base = items[it, 3]
        if stride == 1:
            _item_stride1(tokens, offsets[q] + w0, c, w0, cnt, topb, words, table, umask, out_st, out_fp,
                          base, counts, starts, it)
        else:
            _item_strided(tokens, offsets[q], c, stride, w0, cnt, pows, words, table, umask, out_st, out_fp,
                          base, counts, it)
    # compact (ascending: items are ordered by query, then position; segments by position)
    n_out = 0
    for it in range(n_items):
        for s in range(CHAINS):
            n_out += counts[it, s]
    qi = np.empty(n_out, dtype=np.int64)
    st = np.empty(n_out, dtype=np.int64)
    fp = np.empty(n_out, dtype=np.uint64)
    o = 0
    for it in range(n_items):
        for s in range(CHAINS):
            r = items[it, 3] + starts[it, s]
            for j in range(counts[it, s]):
                qi[o] = items[it, 0]
                st[o] = out_st[r + j]
                fp[o] = out_fp[r + j]
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

    #: no device pipeline: :meth:`probe_async` answers at submit
    pipelined = False

    def probe_async(self, batch: QueryBatch, slots: SlotSource) -> ReadyProbe:
        """The pipelined API (``gpu/engine.py``) on the host: the batch is answered now."""
        return ReadyProbe(self.probe(batch, slots))

    def close(self) -> None:
        pass
