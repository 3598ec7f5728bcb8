"""The GPU engine: CuPy, a device-resident slot mirror, one batch in a constant number of launches.

Question answered: "which valid windows of this batch survive the slot-array probe?" -- the
``Engine`` contract of ``gpu/engine.py``, bit-identical to the reference engine, on an
NVIDIA GPU. CuPy is imported lazily (inside functions): importing this module never needs it.

One pass (``CupyEngine._submit`` then ``_collect``; ``probe`` does both, ``probe_async``
returns between them), under the engine lock, on three non-blocking streams ordered only by
the events of the pass's staging set (one of a ring of :data:`PIPELINE_DEPTH`):

1. **Slot mirror sync** (``xp_probe.SlotMirror``, on the compute stream):
   ``slots.changes_since(gen, ver)``; a new generation (or a trimmed log, or another source)
   uploads the table whole; otherwise the changes are deduplicated on the host (last write
   wins, ``dedupe_last_write``) and applied with one device scatter.
2. **Upload** (upload stream, after the set's previous pass stopped reading its device
   input): plan (``wbase``, ``qstart``) and tokens are written into the set's pinned staging
   buffer (grown as needed) and copied to its device buffer with asynchronous copies, in
   4 MiB pieces so host copying overlaps the transfer (``xp_probe.stage_upload``); tokens
   already decoded into the lent area (:meth:`CupyEngine.lend_tokens`) go in one copy with
   no host copy. Event ``uploaded``.
3. **Kernels** (compute stream, waits for ``uploaded``; ``kernels="fused"``, the default):
   a. ``H = fingerprint.prefix_fingerprints(tokens, C, cupy)`` -- THE hash in its prefix
      form, as CuPy array operations (multiply, cumsum, subtract, multiply);
   b. ``bm_flag_kernel`` (RawKernel, grid-stride over the windows, at most
      ``BLOCKS_PER_SM`` blocks per SM): window -> query by binary search in ``wbase`` ->
      ``fp = H[start]`` -> fmix64 -> slot, tag -> one table load ->
      ``flag[w] = (v == tag) | (v == 255)``;
   c. ``pos = cupy.cumsum(flag)`` (CUB scan);
   d. an output of ``cap`` rows, ``cap`` guessed before the count is known (twice the
      highest recent survivor rate times the windows, at least ``min_copy_rows``), and
      ``bm_scatter_kernel``: survivor ``w`` writes row ``pos[w] - 1`` = ``[q, cur_st, fp]``
      when it is below ``cap`` (order-preserving: rows ascend with ``w``, i.e. with
      ``(query, cur_st)``). Event ``computed``.
4. **Copy-back** (copy-back stream, waits for ``computed``): the survivor count
   ``pos[W-1]`` and the ``cap`` rows into the set's pinned memory. Event ``done``.
5. **Collect**: the host waits for ``done`` -- **the one host synchronisation of the pass** --
   and reads the count ``n``; when ``n <= cap`` the first ``n`` rows are the answer. Else
   (``overflows``) the scatter runs again into exactly ``n`` rows, which are copied back and
   waited for (a second synchronisation).
   ``kernels="array"`` runs ``xp_probe.ArrayProbe`` with ``xp=cupy`` instead, synchronously
   on the compute stream (the exact lines CI runs on numpy; more launches, no custom CUDA;
   its ``int(pos[-1])`` and its copy-back are two synchronisations), and does not pipeline.

So with ``probe_async``, pass N+1's upload runs while pass N's kernels run and pass N-1's
rows copy back. A staging set is reused only after its pass was collected (a submit that
finds it uncollected collects it first: ``ring_waits``).

Passes, memory and limits (``xp_probe.MirroredEngine``): a batch over ``max_pass_tokens``
(default :data:`DEFAULT_PASS_TOKENS`, never above ``SCAN_LIMIT`` = 2^31 - 1, where CuPy's
scans silently go wrong) runs in several passes. Out-of-memory is memory pressure, not a
broken device: the engine frees its cached memory and retries, then in passes half as long,
and raises ``EngineOutOfMemory`` only below ``MIN_PASS_TOKENS`` (``FailoverEngine`` then
answers that batch on the CPU and keeps the GPU). The engine allocates from its own CuPy
memory pool and, after each pass, frees staging buffers, power tables and cached pool blocks
over ``keep_bytes`` (default :data:`KEEP_BYTES`); the slot mirror stays.

Launch count per pass is constant (independent of the number of queries): about a dozen
(the prefix form's array operations, two RawKernels, one scan, two copies).

``Candidates.timings`` (seconds): ``sync_s`` (host, step 1), ``upload_s``, ``kernels_s``,
``copyback_s`` (CUDA events, each on its own stream: steps 2, 3, 4), ``stage_s`` (host
seconds of step 2: writing the pinned buffer and issuing the copies), ``wait_s`` (host
seconds blocked in step 5), ``total_s`` (host wall clock from submit to result).

What CI (no GPU) covers, and how (docs/performance.md, "GPU engine"):
- the array algorithm and the slot mirror run on numpy as the ``"xp-numpy"`` engine in the
  cross-engine conformance suite;
- ``KERNEL_SOURCE`` is compiled by NVRTC from the pip wheel for sm_90 with CuPy's options
  (``tests/test_gpu_nvrtc.py``: no error, warning, spill or stack frame, both entry points,
  at most 64 registers);
- the same ``__global__`` text is compiled as host C++ with an emulation header and run with
  the H200 grid and tiny grids, threads in shuffled order, under AddressSanitizer and UBSan,
  bit for bit against the reference (``tests/test_gpu_host_emulation.py``);
- this module's CuPy calls run against ``tests/fake_cupy.py``, a numpy-backed device whose
  kernels are that emulation, whose device-to-host copies land only at synchronisation, with
  a memory pool, allocation accounting and injectable out-of-memory errors;
- the self-test used by the trial launch (``select.self_test``) runs on CPU engines too.
Not covered without a GPU: CuPy itself on a device (NVRTC through CuPy, argument marshalling,
``cupy.cumsum``/``searchsorted`` kernels, pinned memory, real asynchrony) and device error
paths. ``select.create_gpu_engine`` therefore refuses the GPU unless a trial of the complete
engine (with a shrunk grid, staging piece and pass size, so it also runs the multi-iteration,
multi-piece, growth and split paths) reproduces the numpy engine's answers bit for bit, and
``scripts/gpu_check.sh`` runs the ``gpu`` tests and a self-test at scale on a device.

Failure policy: bad input -> ``ValueError`` (checked before any device work, as on every
engine); out-of-memory -> retried as above; any other error while probing (a CUDA error, a
lost device) -> ``EngineFailure`` wrapping it, after which the mirror is invalidated (the next
batch re-uploads the table). ``select.FailoverEngine`` then moves to the CPU engine.

Thread safety: one lock per engine around each submit and each collect; the streams, events
and staging sets belong to the engine and are only touched under that lock. A failure (or
``close``) loses every pass in flight: their handles raise ``EngineFailure``.

Why about 760 lines: the kernel source already lives in ``cuda_kernels.py``; what is left is
one engine whose submit, collect, staging ring and memory rules share the engine lock and
the staging sets' events, and which only runs on a device (splitting it would spread one
ordering argument over several files). The staging ring is the next piece to move out.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import time
from types import ModuleType
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .batch import QueryBatch
from .engine import EngineBroken, EngineFailure, EngineUnavailable, SlotSource
from .cuda_kernels import BLOCK, BLOCKS_PER_SM, KERNEL_NAMES, KERNEL_SOURCE, launch_dims
from .xp_probe import (
    STAGING_PIECE,
    ArrayProbe,
    MirroredEngine,
    SlotMirror,
    WindowPlan,
    stage_upload,
    staging_layout,
    staging_views,
)

__all__ = [
    "BLOCK",
    "BLOCKS_PER_SM",
    "CupyEngine",
    "DEFAULT_PASS_TOKENS",
    "KEEP_BYTES",
    "KERNEL_NAMES",
    "KERNELS_ENV",
    "KERNEL_MODES",
    "KERNEL_SOURCE",
    "MIN_COPY_ROWS",
    "PIPELINE_DEPTH",
    "gpu_unavailable",
    "gpu_unavailable_reason",
    "is_out_of_memory",
    "launch_dims",
]

log = logging.getLogger(__name__)

#: ``"fused"``: prefix hash in CuPy array code + two RawKernels + one scan (default).
#: ``"array"``: the ``xp_probe.ArrayProbe`` lines with ``xp=cupy`` (no custom CUDA).
KERNEL_MODES = ("fused", "array")
#: Environment override of the kernel mode for ``select_engine("gpu"|"auto")``.
KERNELS_ENV = "BLENDMATCH_GPU_KERNELS"
_INSTALL_HINT = ("install it with pip install 'blendmatch[gpu-cuda12]' (CUDA 12) or "
                 "'blendmatch[gpu-cuda13]' (CUDA 13)")


# --------------------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------------------
def _cupy_installed() -> bool:
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):  # a broken parent package or a stale module entry
        return True


def _import_cupy() -> ModuleType:
    """``cupy``, or :class:`EngineUnavailable` saying why not (:class:`EngineBroken` when
    CuPy is installed but does not import: a missing CUDA library, a wrong wheel)."""
    try:
        import cupy
    except ImportError as exc:
        if exc.name == "cupy" or not _cupy_installed():
            raise EngineUnavailable(f"CuPy is not installed ({exc}); {_INSTALL_HINT}") from exc
        raise EngineBroken(f"CuPy is installed but failed to import ({type(exc).__name__}: {exc}); "
                           "check that the CuPy wheel matches the CUDA driver and that its CUDA "
                           f"libraries are installed ({_INSTALL_HINT})") from exc
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install fails in many ways
        raise EngineBroken(f"CuPy is installed but failed to import ({type(exc).__name__}: {exc})") from exc
    return cupy


def _import_cupyx() -> ModuleType:
    """``cupyx`` (pinned host arrays); a separate seam so tests can stand in for both."""
    try:
        import cupyx
    except Exception as exc:  # noqa: BLE001
        raise EngineBroken(f"cupyx failed to import ({type(exc).__name__}: {exc}); {_INSTALL_HINT}") from exc
    return cupyx


def gpu_unavailable() -> EngineUnavailable | None:
    """``None`` when CuPy imports and a device answers a trial launch, else why not.

    :class:`EngineUnavailable` for a machine without a GPU (no CuPy, no driver, no device);
    :class:`EngineBroken` when something is there but broken (CuPy fails to import, a device
    answered but a trial launch failed or answered wrong). The trial is a real kernel launch
    and read-back (``sum(arange(8)**2) == 140``): an import proves nothing about the device.
    """
    try:
        cp = _import_cupy()
    except EngineUnavailable as exc:
        return exc
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001
        return EngineUnavailable(f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})")
    if count < 1:
        return EngineUnavailable("CuPy found no CUDA device")
    try:
        x = cp.arange(8, dtype=cp.int64)
        got = int((x * x).sum())
    except Exception as exc:  # noqa: BLE001
        return EngineBroken(f"a trial launch on the GPU failed ({type(exc).__name__}: {exc})")
    if got != 140:
        return EngineBroken(f"a trial launch on the GPU returned a wrong answer ({got} != 140)")
    return None


def gpu_unavailable_reason() -> str | None:
    """``str(gpu_unavailable())``, or ``None`` when a device answers a trial launch."""
    why = gpu_unavailable()
    return None if why is None else str(why)


def is_out_of_memory(cp: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is memory pressure: CuPy's ``OutOfMemoryError`` (device pool), a CUDA
    ``cudaErrorMemoryAllocation`` (pinned host memory, CUB temporaries) or ``MemoryError``."""
    if isinstance(exc, MemoryError):
        return True
    oom = getattr(getattr(getattr(cp, "cuda", None), "memory", None), "OutOfMemoryError", None)
    if isinstance(oom, type) and isinstance(exc, oom):
        return True
    return "cudaErrorMemoryAllocation" in str(exc) or "out of memory" in str(exc).lower()


# --------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------
class _Grown:
    """A buffer that grows to the next power of two (at least ``floor`` bytes).

    It shrinks only by :meth:`release` (the engine releases buffers over its ``keep_bytes``
    after each batch). Replacing or releasing it is safe only when no copy from/to it is in
    flight; the engine synchronises its stream at the end of every batch (and on failure).
    """

    def __init__(self, alloc: Any, floor: int = 1 << 20) -> None:
        self._alloc = alloc
        self.floor = floor
        self.buf: Any = None
        self.grown = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else int(self.buf.nbytes)

    def get(self, nbytes: int) -> Any:
        if self.buf is None or int(self.buf.shape[0]) < nbytes:
            if self.buf is not None:
                self.grown += 1
            self.buf = None  # release first so the pool can reuse the memory
            self.buf = self._alloc(max(self.floor, 1 << max(0, int(nbytes - 1).bit_length())))
        return self.buf

    def release(self) -> None:
        self.buf = None


#: What the engine keeps between batches besides its slot mirror and power tables up to
#: this size: staging buffers and cached pool memory over it are freed after each batch.
KEEP_BYTES = 256 << 20
#: Tokens per device pass by default (a larger batch runs in several passes). Peak device
#: memory of a pass is about 60 bytes per token (tokens, prefix hash and its scan, flags,
#: positions), so a full pass of 2^26 tokens needs about 4 GiB beside the slot mirror.
DEFAULT_PASS_TOKENS = 1 << 26
#: Staging sets in the engine's ring: pass N+1 uploads from one while pass N's kernels read
#: another and pass N-1's rows copy back into the third.
PIPELINE_DEPTH = 3
#: Fewest survivor rows a pass copies back before its count is known (see ``CupyEngine``).
MIN_COPY_ROWS = 4096


class _Slot:
    """One staging set of the ring: pinned input, its device copy, pinned output, the
    survivor count's pinned word, and the events that order the three streams for the pass
    that uses it. ``job`` is the pass in flight from it (None once collected)."""

    def __init__(self, cp: Any, cupyx: Any, dev_alloc: Any) -> None:
        self.pin_in = _Grown(lambda n: cupyx.empty_pinned((n,), dtype=np.uint8))
        self.pin_out = _Grown(lambda n: cupyx.empty_pinned((n,), dtype=np.uint8))
        self.dev_in = _Grown(dev_alloc)
        self.pin_count = cupyx.empty_pinned((1,), dtype=np.int64)
        self.ev = {k: cp.cuda.Event() for k in ("up0", "uploaded", "k0", "computed", "d0", "done")}
        self.job: _Pass | None = None

    def grown(self) -> tuple[_Grown, _Grown, _Grown]:
        return self.pin_in, self.pin_out, self.dev_in


@dataclass(eq=False)
class _Pass:
    """A pass submitted to the device and not yet collected (see ``CupyEngine``)."""

    slot: _Slot
    plan: WindowPlan
    epoch: int
    cap: int = 0  # survivor rows the pass's output holds and copies back
    keep: tuple = ()  # device arrays the overflow path needs: h, pos, flag, wbase, qstart
    sync_s: float = 0.0
    stage_s: float = 0.0  # host seconds writing the staging buffer and issuing the upload
    rows: np.ndarray | None = None  # host rows once collected
    timings: dict[str, float] = field(default_factory=dict)


class CupyEngine(MirroredEngine):
    """The GPU engine (``name == "gpu"``); build it with ``select.create_gpu_engine`` (which
    refuses it unless the self-test passes).

    ``kernels``: ``"fused"`` (default) or ``"array"`` (see the module docstring). ``device``:
    CUDA device id (default: the current device). ``max_pass_tokens``: tokens per device pass
    (capped at ``SCAN_LIMIT``). ``keep_bytes``: memory kept between batches (see
    :data:`KEEP_BYTES`). Kernels are compiled in the constructor.

    Pipelined (``kernels="fused"``): :meth:`probe_async` submits a batch and returns at once;
    its handle's ``result()`` waits for it. Each pass takes a staging set of a ring of
    :data:`PIPELINE_DEPTH` and runs on three streams ordered by that set's events only:
    upload (pinned -> device), compute (waits for the upload: hash, flag, scan, scatter into
    an output of ``cap`` rows), copy-back (waits for the compute: the survivor count and
    ``cap`` rows into pinned memory). ``cap`` is a guess made before the count is known:
    twice the highest recent survivor rate times the pass's windows, at least
    :attr:`min_copy_rows`; so the host synchronises once per pass (on the copy-back's last
    event, in ``result()``). A pass with more survivors than ``cap`` (``overflows``) scatters
    again into an exact output and copies it back: a second synchronisation, rare. A staging
    set is reused only after its pass was collected (``ring_waits`` counts the times a submit
    had to collect one first). :meth:`lend_tokens` lends the next set's pinned token area so
    a caller can decode straight into it (no host copy at submit).
    """

    name = "gpu"

    def __init__(self, reason: str = "", kernels: str = "fused", device: int | None = None, *,
                 max_pass_tokens: int = DEFAULT_PASS_TOKENS, keep_bytes: int = KEEP_BYTES) -> None:
        super().__init__(reason, max_pass_tokens)
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
        cp = _import_cupy()
        cupyx = _import_cupyx()
        self._cp = cp
        self.kernels = kernels
        self.keep_bytes = int(keep_bytes)
        self.staging_piece = STAGING_PIECE
        self.min_copy_rows = MIN_COPY_ROWS
        self._rate = 1.0 / 64  # survivors per window, highest recent (sizes the copy-back)
        self._device = cp.cuda.Device(device) if device is not None else cp.cuda.Device()
        with self._device:
            self.device_name = _device_name(cp, self._device)
            self._stream = cp.cuda.Stream(non_blocking=True)  # compute (and the mirror's updates)
            self._up = cp.cuda.Stream(non_blocking=True)
            self._down = cp.cuda.Stream(non_blocking=True)
            self._events = [cp.cuda.Event() for _ in range(4)]
            # the engine's own pool: what it caches can be measured and trimmed without
            # touching other users of CuPy's default pool in the process
            self._pool = cp.cuda.MemoryPool()
            self._array = ArrayProbe(cp)
            self._mirror = SlotMirror(cp, to_device=self._to_device)
            try:
                sms = int(self._device.attributes["MultiProcessorCount"])
            except Exception:  # noqa: BLE001 - only sizes the grid
                sms = 132
            self.max_blocks = max(1, sms * BLOCKS_PER_SM)
            self._slots = [_Slot(cp, cupyx, self._dev_alloc) for _ in range(PIPELINE_DEPTH)]
            self._next = 0
            self._lent: tuple[_Slot, int, int] | None = None  # (slot, queries, tokens) lent out
            self._k_flag = self._k_scatter = None
            if kernels == "fused":
                # no -std option: the source is plain C-style CUDA; CuPy adds its default
                # (--std=c++17), the options tests/test_gpu_nvrtc.py compiles with for sm_90
                with cp.cuda.using_allocator(self._pool.malloc):
                    module = cp.RawModule(code=KERNEL_SOURCE)
                self._k_flag = module.get_function("bm_flag_kernel")
                self._k_scatter = module.get_function("bm_scatter_kernel")
        self._epoch = 0  # bumped by a failure or close: passes of an older epoch are lost
        self._one_slot = False  # set while a synchronous probe runs (see _take_slot)
        self.device_batches = 0
        self.trims = 0
        self.overflows = 0
        self.ring_waits = 0
        self.in_place_passes = 0  # passes whose tokens were decoded into the lent staging area

    @property
    def pipelined(self) -> bool:
        """Whether :meth:`probe_async` overlaps batches (the fused kernels do)."""
        return self.kernels == "fused"

    # -- helpers (lock held) --------------------------------------------------------------
    def _dev_alloc(self, n: int) -> Any:
        with self._cp.cuda.using_allocator(self._pool.malloc):
            return self._cp.empty((n,), dtype=self._cp.uint8)

    def _to_device(self, host: np.ndarray) -> Any:
        """Copy a host array to the device on the compute stream (used by the mirror)."""
        dev = self._cp.empty(host.shape, dtype=host.dtype)
        dev.set(np.ascontiguousarray(host), stream=self._stream)
        return dev

    def _take_slot(self) -> _Slot:
        """The next staging set of the ring (not the lent one), its last pass collected."""
        lent = self._lent[0] if self._lent is not None else None
        if self._one_slot:  # a synchronous probe: the last set again (one set's memory, not three)
            self._next = (self._next - 1) % PIPELINE_DEPTH
        slot = self._slots[self._next]
        self._next = (self._next + 1) % PIPELINE_DEPTH
        if slot is lent:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % PIPELINE_DEPTH
        if slot.job is not None:
            self.ring_waits += 1
            self._collect_pass(slot.job)
        return slot

    def lend_tokens(self, num_queries: int, num_tokens: int) -> np.ndarray | None:
        """A writable uint32 array of ``num_tokens`` in the next staging set's pinned memory,
        for a batch of ``num_queries`` queries: fill it and submit a ``QueryBatch`` whose
        ``tokens`` is this array, and the submit skips the host copy. ``None`` when the engine
        does not pipeline or the batch would not run in one pass. A later call takes the lent
        area back (an earlier loan must then not be used)."""
        with self._lock:
            if self._closed or not self.pipelined or num_tokens > self.max_pass_tokens or num_tokens < 1:
                return None
            self._lent = None
            slot = self._take_slot()
            _, tokens_at, total = staging_layout(num_queries, num_tokens)
            host = slot.pin_in.get(total)
            self._lent = (slot, num_queries, num_tokens)
            return host[tokens_at:total].view(np.uint32)

    def _slot_for(self, batch: QueryBatch, plan: WindowPlan) -> tuple[_Slot, bool]:
        """The staging set for ``batch``: the lent one when its tokens are already there
        (the loan is then used up); otherwise the next set, never the lent one (another
        caller's batch must not overwrite tokens decoded into a loan not yet submitted)."""
        lent = self._lent
        if lent is not None:
            slot, nq, n = lent
            if nq == plan.num_queries and n == batch.num_tokens and slot.pin_in.buf is not None:
                _, tokens_at, _ = staging_layout(nq, n)
                if batch.tokens.ctypes.data == slot.pin_in.buf.ctypes.data + tokens_at:
                    self._lent = None
                    self.in_place_passes += 1
                    return slot, True
        return self._take_slot(), False

    def _stage(self, slot: _Slot, batch: QueryBatch, plan: WindowPlan, stream: Any,
               in_place: bool) -> tuple[Any, Any, Any]:
        """Plan + tokens through the slot's pinned buffer, asynchronous copies on ``stream``."""
        nq, n = plan.num_queries, batch.num_tokens
        total = staging_layout(nq, n)[2]
        host = slot.pin_in.get(total)
        dev = slot.dev_in.get(total)
        base_h = host.ctypes.data
        base_d = dev.data

        def copy(offset: int, nbytes: int) -> None:
            (base_d + offset).copy_from_host_async(ctypes.c_void_p(base_h + offset), nbytes, stream)

        tokens = None if in_place else np.ascontiguousarray(batch.tokens, dtype=np.uint32)
        stage_upload(host, plan, tokens, copy, piece=self.staging_piece, num_tokens=n)
        return staging_views(dev, nq, n)

    def _guess_rows(self, windows: int) -> int:
        return int(min(windows, max(self.min_copy_rows, int(2 * self._rate * windows) + 1)))

    # -- one pass: submit (no host synchronisation), collect (one) ------------------------
    def _submit(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource) -> _Pass:
        if self.kernels != "fused":
            rows, timings = self._run_array(batch, plan, slots)
            return _Pass(self._slots[0], plan, self._epoch, rows=rows, timings=timings)
        cp = self._cp
        t0 = time.perf_counter()
        slot, in_place = self._slot_for(batch, plan)
        ev = slot.ev
        job = _Pass(slot, plan, self._epoch)
        with self._device, cp.cuda.using_allocator(self._pool.malloc):
            with self._stream:
                self._mirror.sync(slots)  # on the compute stream: ordered before this pass's kernels
            job.sync_s = time.perf_counter() - t0
            # the upload may overwrite the slot's device input only after the slot's last
            # pass stopped reading it (collected already, so this costs the device nothing)
            self._up.wait_event(ev["computed"])
            ev["up0"].record(self._up)
            t_stage = time.perf_counter()
            wbase, qstart, tokens = self._stage(slot, batch, plan, self._up, in_place)
            job.stage_s = time.perf_counter() - t_stage
            ev["uploaded"].record(self._up)
            w = plan.windows
            cap = job.cap = self._guess_rows(w)
            with self._stream:
                self._stream.wait_event(ev["uploaded"])
                ev["k0"].record(self._stream)
                h = self._array.fingerprints(tokens, plan.window)
                grid, block = launch_dims(w, self.max_blocks)
                flag = cp.empty((w,), dtype=cp.uint8)
                self._k_flag(grid, block, (h, wbase, qstart, np.int64(plan.num_queries), np.int64(w),
                                           np.int64(plan.stride), self._mirror.table,
                                           np.uint64(int(self._mirror.table.shape[0]) - 1), flag))
                pos = cp.cumsum(flag, dtype=cp.int64)
                out = cp.empty((cap, 3), dtype=cp.uint64)
                self._k_scatter(grid, block, (h, pos, flag, wbase, qstart, np.int64(plan.num_queries),
                                              np.int64(w), np.int64(plan.stride), np.int64(cap), out))
                ev["computed"].record(self._stream)
            self._down.wait_event(ev["computed"])
            ev["d0"].record(self._down)
            pos[w - 1:w].data.copy_to_host_async(ctypes.c_void_p(slot.pin_count.ctypes.data), 8, self._down)
            host = slot.pin_out.get(cap * 24)
            out.data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), cap * 24, self._down)
            ev["done"].record(self._down)
        job.keep = (h, pos, flag, wbase, qstart, out)
        slot.job = job
        return job

    def _collect(self, job: _Pass) -> tuple[np.ndarray, dict[str, float]]:
        if job.rows is None:
            self._collect_pass(job)
        assert job.rows is not None
        return job.rows, job.timings

    def _collect_pass(self, job: _Pass) -> None:
        """Wait for ``job`` (the one host synchronisation of a pass) and keep its rows."""
        if job.epoch != self._epoch:
            raise EngineFailure(f"the {self.name} engine failed or closed while this batch was on the device")
        cp, slot, ev = self._cp, job.slot, job.slot.ev
        t0 = time.perf_counter()
        with self._device:
            ev["done"].synchronize()
            wait_s = time.perf_counter() - t0
            n = int(slot.pin_count[0])
            w = job.plan.windows
            if n <= job.cap:
                rows = slot.pin_out.buf[:n * 24].view(np.uint64).reshape(n, 3).copy()
            else:
                rows = self._overflow(job, n)
            timings = {
                "sync_s": job.sync_s,
                "stage_s": job.stage_s,
                "upload_s": cp.cuda.get_elapsed_time(ev["up0"], ev["uploaded"]) / 1e3,
                "kernels_s": cp.cuda.get_elapsed_time(ev["k0"], ev["computed"]) / 1e3,
                "copyback_s": cp.cuda.get_elapsed_time(ev["d0"], ev["done"]) / 1e3,
                "wait_s": wait_s,
            }
        self._rate = max(n / w, 0.9 * self._rate, 1.0 / (1 << 16))
        job.rows, job.timings, job.keep = rows, timings, ()
        if slot.job is job:
            slot.job = None
        self.device_batches += 1

    def _overflow(self, job: _Pass, n: int) -> np.ndarray:
        """More survivors than the guessed rows: scatter again into exactly ``n`` rows, copy
        them back and wait (a second host synchronisation for this pass)."""
        cp, slot, ev = self._cp, job.slot, job.slot.ev
        h, pos, flag, wbase, qstart, _ = job.keep
        plan = job.plan
        self.overflows += 1
        grid, block = launch_dims(plan.windows, self.max_blocks)
        with cp.cuda.using_allocator(self._pool.malloc), self._stream:
            out = cp.empty((n, 3), dtype=cp.uint64)
            self._k_scatter(grid, block, (h, pos, flag, wbase, qstart, np.int64(plan.num_queries),
                                          np.int64(plan.windows), np.int64(plan.stride), np.int64(n), out))
            ev["computed"].record(self._stream)
        self._down.wait_event(ev["computed"])
        host = slot.pin_out.get(n * 24)
        out.data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), n * 24, self._down)
        ev["done"].record(self._down)
        ev["done"].synchronize()
        return host[:n * 24].view(np.uint64).reshape(n, 3).copy()

    def _run_array(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource) -> tuple[np.ndarray, dict[str, float]]:
        """``kernels="array"``: one pass on the compute stream, synchronously (its count read
        is a synchronisation, and the copy-back a second)."""
        cp, stream, ev = self._cp, self._stream, self._events
        slot = self._take_slot()
        t0 = time.perf_counter()
        with self._device, stream, cp.cuda.using_allocator(self._pool.malloc):
            ev[0].record(stream)
            self._mirror.sync(slots)
            t_sync = time.perf_counter() - t0
            wbase, qstart, tokens = self._stage(slot, batch, plan, stream, False)
            ev[1].record(stream)
            rows = self._array.run(tokens, wbase, qstart, plan, self._mirror.table)  # syncs once for n
            n = int(rows.shape[0])
            ev[2].record(stream)
            host = np.zeros((0, 3), dtype=np.uint64)
            if n:
                rows = cp.ascontiguousarray(rows)
                buf = slot.pin_out.get(n * 24)
                rows.data.copy_to_host_async(ctypes.c_void_p(buf.ctypes.data), n * 24, stream)
                host = buf[:n * 24].view(np.uint64).reshape(n, 3)
            ev[3].record(stream)
            stream.synchronize()
            timings = {
                "sync_s": t_sync,
                "upload_s": cp.cuda.get_elapsed_time(ev[0], ev[1]) / 1e3,
                "kernels_s": cp.cuda.get_elapsed_time(ev[1], ev[2]) / 1e3,
                "copyback_s": cp.cuda.get_elapsed_time(ev[2], ev[3]) / 1e3,
            }
            del rows, wbase, qstart, tokens
        self.device_batches += 1
        return host.copy(), timings

    # -- MirroredEngine hooks ---------------------------------------------------------------
    def _run(self, batch: QueryBatch, plan: WindowPlan, slots: SlotSource) -> tuple[np.ndarray, dict[str, float]]:
        """One pass, synchronously: submit and collect (one host synchronisation, two on an
        overflow; ``kernels="array"``: two)."""
        self._one_slot = True
        try:
            rows, timings = self._collect(self._submit(batch, plan, slots))
        finally:
            self._one_slot = False
        self._trim()
        return rows, timings

    def _abandon(self) -> None:
        """Collect every pass in flight (their rows stay with their handles) so that nothing
        of theirs is held on the device while a batch is retried under memory pressure."""
        for slot in self._slots:
            if slot.job is not None:
                try:
                    self._collect_pass(slot.job)
                except Exception:  # noqa: BLE001 - that pass's own handle reports it
                    slot.job.keep = ()
                    slot.job = None

    def _after_collect(self) -> None:
        self._trim()

    def _trim(self) -> None:
        """Keep at most ``keep_bytes`` of staging buffers, power tables and cached pool blocks
        between batches (the slot mirror is kept whatever its size). Staging sets with a
        pass in flight are kept."""
        trimmed = False
        lent = self._lent[0] if self._lent is not None else None
        for slot in self._slots:
            if slot.job is not None or slot is lent:
                continue
            for g in slot.grown():
                if g.nbytes > self.keep_bytes:
                    g.release()
                    trimmed = True
        if self._array.powers_bytes() > self.keep_bytes:
            self._array.drop_powers()
            trimmed = True
        if self._pool.total_bytes() - self._pool.used_bytes() > self.keep_bytes:
            self._pool.free_all_blocks()
            trimmed = True
        if trimmed:
            self.trims += 1
            self._cp.get_default_pinned_memory_pool().free_all_blocks()

    def _is_out_of_memory(self, exc: BaseException) -> bool:
        return is_out_of_memory(self._cp, exc)

    def _free_memory(self) -> None:
        """Drop every buffer the engine can rebuild and give the pools' free blocks back."""
        for slot in self._slots:
            for g in slot.grown():
                g.release()
        self._array.drop_powers()
        try:
            with self._device:
                self._pool.free_all_blocks()
                self._cp.get_default_memory_pool().free_all_blocks()
                self._cp.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:  # noqa: BLE001 - freeing is best effort; the retry will tell
            log.debug("freeing GPU memory after an out-of-memory error failed", exc_info=True)

    def _quiesce(self) -> None:
        """Every pass in flight is lost (its handle raises ``EngineFailure``); no copy may
        still read or write the staging buffers when the next pass starts."""
        self._epoch += 1
        self._lent = None
        for slot in self._slots:
            slot.job = None
        try:
            with self._device:
                for s in (self._up, self._stream, self._down):
                    s.synchronize()
        except Exception:  # noqa: BLE001 - the device may be gone; the failure is already raised
            log.debug("stream synchronise after a GPU failure failed", exc_info=True)

    def _after_failure(self) -> None:
        super()._after_failure()
        self._quiesce()

    def _release(self) -> None:
        self._quiesce()
        for slot in self._slots:
            for g in slot.grown():
                g.buf = None
        self._array = ArrayProbe(self._cp)
        try:
            with self._device:
                self._pool.free_all_blocks()
        except Exception:  # noqa: BLE001
            log.debug("freeing the engine's pool on close failed", exc_info=True)

    def memory_stats(self) -> dict[str, int]:
        """Bytes the engine holds now: its pool (``pool_bytes``, of which ``pool_used_bytes``
        are live arrays such as the slot mirror), pinned staging and power tables."""
        return {
            "pool_bytes": int(self._pool.total_bytes()),
            "pool_used_bytes": int(self._pool.used_bytes()),
            "pinned_bytes": sum(s.pin_in.nbytes + s.pin_out.nbytes for s in self._slots),
            "staging_device_bytes": sum(s.dev_in.nbytes for s in self._slots),
            "powers_bytes": self._array.powers_bytes(),
            "keep_bytes": self.keep_bytes,
        }

    @contextlib.contextmanager
    def trial_geometry(self, *, max_blocks: int = 2, staging_piece: int = 4096, floor: int = 4096,
                       max_pass_tokens: int = 1 << 14, min_copy_rows: int = 8) -> Iterator[None]:
        """Shrink the grid, the staging piece, the buffers' floor, the pass size and the rows
        copied back before the count is known, so that a small self-test runs many
        grid-stride iterations, multi-piece uploads, buffer growth, split batches and
        overflowing copy-backs: the paths a full-size batch takes on a real device."""
        saved = (self.max_blocks, self.staging_piece, self._slots[0].pin_in.floor, self.max_pass_tokens,
                 self.min_copy_rows, self._rate)
        with self._lock:
            self.max_blocks, self.staging_piece, self.max_pass_tokens = max_blocks, staging_piece, max_pass_tokens
            self.min_copy_rows, self._rate = min_copy_rows, 1.0 / (1 << 16)
            for slot in self._slots:
                for g in slot.grown():
                    g.floor = floor
                    g.release()
        try:
            yield
        finally:
            with self._lock:
                self.max_blocks, self.staging_piece, floor0, self.max_pass_tokens, self.min_copy_rows, \
                    self._rate = saved
                for slot in self._slots:
                    for g in slot.grown():
                        g.floor = floor0
                        g.release()

    def reset_after_trial(self) -> None:
        """Forget the self-test's slot source and counters (the first real batch uploads the
        real table)."""
        self._mirror.invalidate()
        self.batches = self.device_batches = 0
        self.split_batches = self.oom_retries = self.trims = self.overflows = self.ring_waits = 0
        self.in_place_passes = 0
        self._mirror.full_uploads = self._mirror.patches = self._mirror.patched_slots = 0

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(kernels=self.kernels, device=self.device_name, device_batches=self.device_batches,
                   trims=self.trims, overflows=self.overflows, ring_waits=self.ring_waits,
                   in_place_passes=self.in_place_passes, **self.memory_stats())
        return out


def _device_name(cp: ModuleType, device: Any) -> str:
    try:
        name = cp.cuda.runtime.getDeviceProperties(device.id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - a name is cosmetic
        return f"cuda:{device.id}"
