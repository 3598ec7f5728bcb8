"""The GPU engine: CuPy, a device-resident slot mirror, one batch in a constant number of launches.

Question answered: "which valid windows of this batch survive the slot-array probe?" -- the
``Engine`` contract of ``gpu/engine.py``, bit-identical to the reference engine, on an
NVIDIA GPU. CuPy is imported lazily (inside functions): importing this module never needs it.

One batch (``CupyEngine.probe``), all on one non-blocking stream, under the engine lock:

1. **Slot mirror sync** (``xp_probe.SlotMirror``): ``slots.changes_since(gen, ver)``; a new
   generation (or a trimmed log, or another source) uploads the table whole; otherwise the
   changes are deduplicated on the host (last write wins, ``dedupe_last_write``) and applied
   with one device scatter.
2. **Upload**: plan (``wbase``, ``qstart``) and tokens are written into a pinned staging
   buffer (grown as needed) and copied to a resident device buffer with asynchronous copies,
   in 4 MiB pieces so host copying overlaps the transfer (``xp_probe.stage_upload``).
3. **Kernels** (``kernels="fused"``, the default):
   a. ``H = fingerprint.prefix_fingerprints(tokens, C, cupy)`` -- THE hash in its prefix
      form, as CuPy array operations (multiply, cumsum, subtract, multiply);
   b. ``bm_flag_kernel`` (RawKernel, one thread per window, grid-stride): window -> query by
      binary search in ``wbase`` -> ``fp = H[start]`` -> fmix64 -> slot, tag -> one table load
      -> ``flag[w] = (v == tag) | (v == 255)``;
   c. ``pos = cupy.cumsum(flag)`` (CUB scan);
   d. ``bm_scatter_kernel``: survivor ``w`` writes row ``pos[w] - 1`` = ``[q, cur_st, fp]``
      (order-preserving: rows ascend with ``w``, i.e. with ``(query, cur_st)``).
   ``kernels="array"`` runs ``xp_probe.ArrayProbe`` with ``xp=cupy`` instead (the exact lines
   CI runs on numpy; more launches, no custom CUDA).
4. **Copy-back**: the survivor count ``pos[W-1]`` is read (8 bytes, the one synchronisation),
   then the packed ``(n, 3)`` uint64 rows come back in one device-to-host copy into a pinned
   buffer, and are unpacked into fresh host arrays.

Launch count per batch is constant (independent of the number of queries): about a dozen
(the prefix form's array operations, two RawKernels, one scan, two copies).

``Candidates.timings`` (seconds): ``sync_s`` (host, step 1), ``upload_s``, ``kernels_s``,
``copyback_s`` (CUDA events on the engine's stream; ``upload_s`` spans step 1's device part
and step 2), ``total_s`` (host wall clock for the whole probe).

What CI (no GPU) covers, and how:
- the array algorithm (steps 2-6 of ``xp_probe``) and the slot mirror run on numpy as the
  ``"xp-numpy"`` engine in the cross-engine conformance suite;
- the CUDA C source of the fused kernels (``KERNEL_SOURCE``) is written so the same text also
  compiles as plain C: ``tests/test_gpu_engine.py`` builds it with the host C compiler and runs
  the per-window bodies (``bm_flag_one``, ``bm_scatter_one``) over every window of random
  batches against numpy and the reference engine;
- staging layout and piecewise copies run on numpy (``stage_upload`` with a host "device");
- the self-test used by the trial launch (``select.self_test``) runs on CPU engines too.
Not covered without a GPU: CuPy's own calls (RawModule compilation with NVRTC, argument
marshalling of the launches, ``cupy.cumsum``/``searchsorted`` on the device, pinned memory,
asynchronous copies, events) and device error paths. ``select.create_gpu_engine`` therefore refuses
the GPU unless a trial launch of the complete engine reproduces the numpy engine's answers
bit for bit, and the ``gpu``-marked tests compare it with the reference on random batches.

Failure policy: bad input -> ``ValueError`` (checked before any device work, as on every
engine); any error while probing (CUDA/CuPy errors such as out-of-memory or a lost device)
-> ``EngineFailure`` wrapping it, after which the mirror is invalidated (the next batch
re-uploads the table). ``select.FailoverEngine`` then moves to the CPU engine.

Thread safety: one lock per engine around ``probe``; the stream, events and staging buffers
belong to the engine and are only touched under that lock.
"""

from __future__ import annotations

import ctypes
import logging
import time
from types import ModuleType
from typing import Any

import numpy as np

from . import fingerprint as _fp
from .batch import QueryBatch
from .engine import EngineUnavailable, SlotSource
from .xp_probe import (
    ArrayProbe,
    MirroredEngine,
    SlotMirror,
    WindowPlan,
    stage_upload,
    staging_layout,
    staging_views,
)

__all__ = [
    "CupyEngine",
    "KERNELS_ENV",
    "KERNEL_MODES",
    "KERNEL_SOURCE",
    "gpu_unavailable_reason",
]

log = logging.getLogger(__name__)

#: ``"fused"``: prefix hash in CuPy array code + two RawKernels + one scan (default).
#: ``"array"``: the ``xp_probe.ArrayProbe`` lines with ``xp=cupy`` (no custom CUDA).
KERNEL_MODES = ("fused", "array")
#: Environment override of the kernel mode for ``select_engine("gpu"|"auto")``.
KERNELS_ENV = "BLENDMATCH_GPU_KERNELS"
#: Threads per block of the RawKernels (memory-bound; 256 keeps occupancy high on any SM).
BLOCK = 256
#: Blocks per SM at most; the kernels loop grid-stride over the remaining windows.
BLOCKS_PER_SM = 32

_INSTALL_HINT = ("install it with pip install 'blendmatch[gpu-cuda12]' (CUDA 12) or "
                 "'blendmatch[gpu-cuda13]' (CUDA 13)")


# --------------------------------------------------------------------------------------
# the fused kernels: one source, compiled by NVRTC on a GPU and by a C compiler in CI
# --------------------------------------------------------------------------------------
def _render_source() -> str:
    """CUDA C source of the fused kernels, with THE hash's constants from ``fingerprint.py``.

    The per-window bodies are ``BM_FN`` functions; the ``__global__`` kernels are grid-stride
    loops over them. Without a CUDA compiler the same text defines host loops instead
    (``bm_flag_host``/``bm_scatter_host``), which CI compiles with ``cc`` and tests.
    Slot and tag follow ``fingerprint.slots_and_tags``: ``m = fmix64(F)``,
    ``slot = m & mask``, ``tag = 1 + ((m >> 56) * 254 >> 8)``; survival: ``v == tag || v == 255``.
    """
    c1 = int(_fp.FMIX_C1)
    c2 = int(_fp.FMIX_C2)
    return f"""
/* blendmatch fused probe kernels (generated by blendmatch.gpu.cupy_engine; do not edit). */
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BM_CUDA 1
#define BM_FN __device__ __forceinline__
#else
#define BM_FN static inline
#endif

typedef unsigned long long bm_u64;
typedef long long bm_i64;

#define BM_FMIX_C1 {c1:#x}ULL
#define BM_FMIX_C2 {c2:#x}ULL
#define BM_TAG_SHARED {_fp.TAG_SHARED}u

/* murmur3 fmix64 (fingerprint.mix64). */
BM_FN bm_u64 bm_fmix64(bm_u64 h) {{
    h ^= h >> 33;
    h *= BM_FMIX_C1;
    h ^= h >> 33;
    h *= BM_FMIX_C2;
    h ^= h >> 33;
    return h;
}}

/* The query of window w: the last q in [0, nq) with wbase[q] <= w (wbase[0] == 0, wbase is
   non-decreasing, so this skips queries without windows). */
BM_FN bm_i64 bm_query_of(bm_i64 w, const bm_i64* __restrict__ wbase, bm_i64 nq) {{
    bm_i64 lo = 0, hi = nq - 1;
    while (lo < hi) {{
        bm_i64 mid = lo + ((hi - lo + 1) >> 1);
        if (wbase[mid] <= w) lo = mid; else hi = mid - 1;
    }}
    return lo;
}}

/* 1 if window w survives the probe, else 0. H[i] is F(tokens[i:i+C]) at global position i. */
BM_FN unsigned char bm_flag_one(bm_i64 w, const bm_u64* __restrict__ H,
                                const bm_i64* __restrict__ wbase, const bm_i64* __restrict__ qstart,
                                bm_i64 nq, bm_i64 stride, const unsigned char* __restrict__ table,
                                bm_u64 mask) {{
    bm_i64 q = bm_query_of(w, wbase, nq);
    bm_u64 m = bm_fmix64(H[qstart[q] + (w - wbase[q]) * stride]);
    unsigned int tag = 1u + (unsigned int)(((m >> 56) * 254ULL) >> 8);
    unsigned int v = table[m & mask];
    return (unsigned char)(v == tag || v == BM_TAG_SHARED);
}}

/* A surviving window w writes its row pos[w] - 1 = [query, cur_st, fingerprint]. */
BM_FN void bm_scatter_one(bm_i64 w, const bm_u64* __restrict__ H, const bm_i64* __restrict__ pos,
                          const unsigned char* __restrict__ flag, const bm_i64* __restrict__ wbase,
                          const bm_i64* __restrict__ qstart, bm_i64 nq, bm_i64 stride,
                          bm_u64* __restrict__ out) {{
    if (!flag[w]) return;
    bm_i64 r = pos[w] - 1;
    bm_i64 q = bm_query_of(w, wbase, nq);
    bm_i64 cur = (w - wbase[q]) * stride;
    out[3 * r] = (bm_u64)q;
    out[3 * r + 1] = (bm_u64)cur;
    out[3 * r + 2] = H[qstart[q] + cur];
}}

#ifdef BM_CUDA
extern "C" __global__ void bm_flag_kernel(const bm_u64* __restrict__ H, const bm_i64* __restrict__ wbase,
                                          const bm_i64* __restrict__ qstart, const bm_i64 nq,
                                          const bm_i64 W, const bm_i64 stride,
                                          const unsigned char* __restrict__ table, const bm_u64 mask,
                                          unsigned char* __restrict__ flag) {{
    const bm_i64 step = (bm_i64)blockDim.x * gridDim.x;
    for (bm_i64 w = (bm_i64)blockIdx.x * blockDim.x + threadIdx.x; w < W; w += step)
        flag[w] = bm_flag_one(w, H, wbase, qstart, nq, stride, table, mask);
}}

extern "C" __global__ void bm_scatter_kernel(const bm_u64* __restrict__ H, const bm_i64* __restrict__ pos,
                                             const unsigned char* __restrict__ flag,
                                             const bm_i64* __restrict__ wbase,
                                             const bm_i64* __restrict__ qstart, const bm_i64 nq,
                                             const bm_i64 W, const bm_i64 stride,
                                             bm_u64* __restrict__ out) {{
    const bm_i64 step = (bm_i64)blockDim.x * gridDim.x;
    for (bm_i64 w = (bm_i64)blockIdx.x * blockDim.x + threadIdx.x; w < W; w += step)
        bm_scatter_one(w, H, pos, flag, wbase, qstart, nq, stride, out);
}}
#else
void bm_flag_host(const bm_u64* H, const bm_i64* wbase, const bm_i64* qstart, bm_i64 nq, bm_i64 W,
                  bm_i64 stride, const unsigned char* table, bm_u64 mask, unsigned char* flag) {{
    for (bm_i64 w = 0; w < W; ++w) flag[w] = bm_flag_one(w, H, wbase, qstart, nq, stride, table, mask);
}}

void bm_scatter_host(const bm_u64* H, const bm_i64* pos, const unsigned char* flag, const bm_i64* wbase,
                     const bm_i64* qstart, bm_i64 nq, bm_i64 W, bm_i64 stride, bm_u64* out) {{
    for (bm_i64 w = 0; w < W; ++w) bm_scatter_one(w, H, pos, flag, wbase, qstart, nq, stride, out);
}}
#endif
"""


#: The fused kernels' source (CUDA C; also valid C for the host build used in CI).
KERNEL_SOURCE = _render_source()


# --------------------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------------------
def _import_cupy() -> ModuleType:
    """``cupy`` (and ``cupyx``), or :class:`EngineUnavailable` saying why not."""
    try:
        import cupy
    except ImportError as exc:
        raise EngineUnavailable(f"CuPy is not installed ({exc}); {_INSTALL_HINT}") from exc
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install fails in many ways
        raise EngineUnavailable(f"CuPy failed to import ({type(exc).__name__}: {exc})") from exc
    return cupy


def _import_cupyx() -> ModuleType:
    """``cupyx`` (pinned host arrays); a separate seam so tests can stand in for both."""
    try:
        import cupyx
    except Exception as exc:  # noqa: BLE001
        raise EngineUnavailable(f"cupyx failed to import ({type(exc).__name__}: {exc}); {_INSTALL_HINT}") from exc
    return cupyx


def gpu_unavailable_reason() -> str | None:
    """``None`` when CuPy imports and a device answers a trial launch, else the reason.

    The trial is a real kernel launch and read-back (``sum(arange(8)**2) == 140``): an import
    that succeeds proves nothing about the driver or the device.
    """
    try:
        cp = _import_cupy()
    except EngineUnavailable as exc:
        return str(exc)
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001
        return f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return "CuPy found no CUDA device"
    try:
        x = cp.arange(8, dtype=cp.int64)
        got = int((x * x).sum())
    except Exception as exc:  # noqa: BLE001
        return f"a trial launch on the GPU failed ({type(exc).__name__}: {exc})"
    if got != 140:
        return f"a trial launch on the GPU returned a wrong answer ({got} != 140)"
    return None


# --------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------
class _Grown:
    """A buffer that grows to the next power of two (at least ``floor`` bytes), never shrinks.

    Replacing it is safe only when no copy from/to it is in flight; the engine synchronises
    its stream at the end of every batch (and on failure) before the next one starts.
    """

    def __init__(self, alloc: Any, floor: int = 1 << 20) -> None:
        self._alloc = alloc
        self._floor = floor
        self.buf: Any = None

    def get(self, nbytes: int) -> Any:
        if self.buf is None or int(self.buf.shape[0]) < nbytes:
            self.buf = None  # release first so the pool can reuse the memory
            self.buf = self._alloc(max(self._floor, 1 << max(0, int(nbytes - 1).bit_length())))
        return self.buf


class CupyEngine(MirroredEngine):
    """The GPU engine (``name == "gpu"``); build it with ``select.create_gpu_engine`` (which
    refuses it unless the self-test passes).

    ``kernels``: ``"fused"`` (default) or ``"array"`` (see the module docstring). ``device``:
    CUDA device id (default: the current device). Kernels are compiled in the constructor.
    """

    name = "gpu"

    def __init__(self, reason: str = "", kernels: str = "fused", device: int | None = None) -> None:
        super().__init__(reason)
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
        cp = _import_cupy()
        cupyx = _import_cupyx()
        self._cp = cp
        self.kernels = kernels
        self._device = cp.cuda.Device(device) if device is not None else cp.cuda.Device()
        with self._device:
            self.device_name = _device_name(cp, self._device)
            self._stream = cp.cuda.Stream(non_blocking=True)
            self._events = [cp.cuda.Event() for _ in range(4)]
            self._array = ArrayProbe(cp)
            self._mirror = SlotMirror(cp, to_device=self._to_device)
            try:
                sms = int(self._device.attributes["MultiProcessorCount"])
            except Exception:  # noqa: BLE001 - only sizes the grid
                sms = 132
            self._max_blocks = max(1, sms * BLOCKS_PER_SM)
            self._pin_in = _Grown(lambda n: cupyx.empty_pinned((n,), dtype=np.uint8))
            self._pin_out = _Grown(lambda n: cupyx.empty_pinned((n,), dtype=np.uint8))
            self._pin_count = cupyx.empty_pinned((1,), dtype=np.int64)
            self._dev_in = _Grown(lambda n: cp.empty((n,), dtype=cp.uint8))
            self._k_flag = self._k_scatter = None
            if kernels == "fused":
                # no -std option: the source is plain C-style CUDA; CuPy >= 13 adds its default
                module = cp.RawModule(code=KERNEL_SOURCE)
                self._k_flag = module.get_function("bm_flag_kernel")
                self._k_scatter = module.get_function("bm_scatter_kernel")
        self.device_batches = 0

    # -- helpers (lock held) --------------------------------------------------------------
    def _to_device(self, host: np.ndarray) -> Any:
        """Copy a host array to the device on the engine's stream (used by the mirror)."""
        dev = self._cp.empty(host.shape, dtype=host.dtype)
        dev.set(np.ascontiguousarray(host), stream=self._stream)
        return dev

    def _stage(self, batch: QueryBatch, plan: WindowPlan) -> tuple[Any, Any, Any]:
        """Plan + tokens through the pinned buffer, asynchronous copies on the stream."""
        tokens = np.ascontiguousarray(batch.tokens, dtype=np.uint32)
        nq, n = plan.num_queries, int(tokens.shape[0])
        total = staging_layout(nq, n)[2]
        host = self._pin_in.get(total)
        dev = self._dev_in.get(total)
        base_h = host.ctypes.data
        base_d = dev.data
        stream = self._stream

        def copy(offset: int, nbytes: int) -> None:
            (base_d + offset).copy_from_host_async(ctypes.c_void_p(base_h + offset), nbytes, stream)

        stage_upload(host, plan, tokens, copy)
        return staging_views(dev, nq, n)

    def _launch_dims(self, windows: int) -> tuple[tuple[int], tuple[int]]:
        return (int(min((windows + BLOCK - 1) // BLOCK, self._max_blocks)),), (BLOCK,)

    def _fused_rows(self, tokens: Any, wbase: Any, qstart: Any, plan: WindowPlan, table: Any) -> tuple[Any, int]:
        cp = self._cp
        w = plan.windows
        h = self._array.fingerprints(tokens, plan.window)
        nq, ww, stride = np.int64(plan.num_queries), np.int64(w), np.int64(plan.stride)
        mask = np.uint64(int(table.shape[0]) - 1)
        grid, block = self._launch_dims(w)
        flag = cp.empty((w,), dtype=cp.uint8)
        self._k_flag(grid, block, (h, wbase, qstart, nq, ww, stride, table, mask, flag))
        pos = cp.cumsum(flag, dtype=cp.int64)
        out = cp.empty((w, 3), dtype=cp.uint64)
        self._k_scatter(grid, block, (h, pos, flag, wbase, qstart, nq, ww, stride, out))
        self._events[2].record(self._stream)
        # the survivor count: 8 bytes back, the one synchronisation before the copy-back
        pos[w - 1:w].data.copy_to_host_async(ctypes.c_void_p(self._pin_count.ctypes.data), 8, self._stream)
        self._stream.synchronize()
        n = int(self._pin_count[0])
        return out[:n], n

    def _copy_back(self, rows: Any, n: int) -> np.ndarray:
        """One device-to-host copy of the packed rows into pinned memory (caller copies out)."""
        if n == 0:
            return np.zeros((0, 3), dtype=np.uint64)
        if not rows.flags.c_contiguous:
            rows = self._cp.ascontiguousarray(rows)
        nbytes = n * 24
        host = self._pin_out.get(nbytes)
        rows.data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), nbytes, self._stream)
        self._stream.synchronize()
        return host[:nbytes].view(np.uint64).reshape(n, 3)

    # -- MirroredEngine hooks ---------------------------------------------------------------
    def _run(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource) -> tuple[np.ndarray, dict[str, float]]:
        cp, stream, ev = self._cp, self._stream, self._events
        t0 = time.perf_counter()
        with self._device, stream:
            ev[0].record(stream)
            self._mirror.sync(slots)
            t_sync = time.perf_counter() - t0
            wbase, qstart, tokens = self._stage(batch, plan)
            ev[1].record(stream)
            table = self._mirror.table
            if self.kernels == "fused":
                rows, n = self._fused_rows(tokens, wbase, qstart, plan, table)
            else:
                rows = self._array.run(tokens, wbase, qstart, plan, table)  # syncs once for n
                n = int(rows.shape[0])
                ev[2].record(stream)
            host = self._copy_back(rows, n)
            ev[3].record(stream)
            ev[3].synchronize()
            timings = {
                "sync_s": t_sync,
                "upload_s": cp.cuda.get_elapsed_time(ev[0], ev[1]) / 1e3,
                "kernels_s": cp.cuda.get_elapsed_time(ev[1], ev[2]) / 1e3,
                "copyback_s": cp.cuda.get_elapsed_time(ev[2], ev[3]) / 1e3,
            }
        self.device_batches += 1
        return host, timings

    def _after_failure(self) -> None:
        super()._after_failure()
        try:  # no copy may still read or write the staging buffers when the next batch starts
            with self._device:
                self._stream.synchronize()
        except Exception:  # noqa: BLE001 - the device may be gone; the failure is already raised
            log.debug("stream synchronise after a GPU failure failed", exc_info=True)

    def _release(self) -> None:
        self._pin_in.buf = self._pin_out.buf = self._dev_in.buf = None
        self._array = ArrayProbe(self._cp)

    def reset_after_trial(self) -> None:
        """Forget the self-test's slot source and counters (the first real batch uploads the
        real table)."""
        self._mirror.invalidate()
        self.batches = self.device_batches = 0
        self._mirror.full_uploads = self._mirror.patches = self._mirror.patched_slots = 0

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(kernels=self.kernels, device=self.device_name, device_batches=self.device_batches)
        return out


def _device_name(cp: ModuleType, device: Any) -> str:
    try:
        name = cp.cuda.runtime.getDeviceProperties(device.id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - a name is cosmetic
        return f"cuda:{device.id}"
