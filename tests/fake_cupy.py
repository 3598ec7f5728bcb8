"""A numpy-backed stand-in for the slice of CuPy that ``gpu/cupy_engine.py`` uses.

Why: CI has no GPU, yet the GPU engine's Python side (staging and its asynchronous copies,
kernel argument lists, the survivor-count read-back, the packed copy-back, events, the
mirror's uploads, memory pools, out-of-memory handling) should still run in CI. This module
plays the device, strictly where the engine could get it wrong:

- **kernels**: :class:`RawModule` compiles the *given source text* as host C++ after
  ``tests/cuda_emulation.h`` (``tests/cuda_host.py``) and runs each ``__global__`` kernel
  over every thread of the launch's grid, threads in a shuffled order. Launch arguments are
  checked against the kernel's parameters parsed from the source: device arrays of the
  exact element type for pointers, numpy scalars of the exact type for values (what CuPy
  would marshal by size).
- **streams and events**: asynchronous copies (``copy_from_host_async``,
  ``copy_to_host_async``) are *deferred*: each is queued on its stream and applied only when
  that stream is flushed, in stream order, reading its source at that moment (as a DMA
  engine does). A stream is flushed up to a point by ``Stream.synchronize``,
  ``Event.synchronize`` of an event recorded after the copy, ``Device.synchronize``, an
  implicit synchronisation (``int()``/``get()`` of a device array), or by later work on the
  *same* stream: array operations run at once, on the current stream,
  after that stream's queue (stream order); kernel launches are queued like copies.
  ``Stream.wait_event(e)`` queues a wait: flushing
  past it first flushes ``e``'s stream up to ``e``. Nothing else orders two streams, so a
  kernel on one stream that reads a buffer whose upload on another stream it did not wait for
  reads stale bytes, and the host reading a pinned buffer before the event after its copy was
  waited on reads stale bytes. Fresh device arrays from ``empty`` and fresh pinned buffers are
  filled with garbage (0xA5 / 0xCD), so stale reads give wrong answers, not lucky zeros.
  Asynchronous copies must name pinned host memory (``cupyx.empty_pinned``).
  ``get_elapsed_time`` raises for an event that has not completed. :data:`SYNCS` counts every
  host synchronisation.
- **memory**: every device array is allocated from a pool (the default one, or the one a
  ``cuda.using_allocator(pool.malloc)`` block names) that caches freed blocks like CuPy's
  (``total_bytes``, ``used_bytes``, ``free_all_blocks``, ``set_limit``); :data:`DEVICE`
  accounts for every pool and raises ``cuda.memory.OutOfMemoryError`` over its ``limit``.
  ``DEVICE.allocations`` records each allocation's size.
- "device arrays" are numpy arrays of the subclass :class:`DevArray`, whose ``.data`` is a
  :class:`MemoryPointer` (raw address arithmetic); scalar indexing gives 0-d device arrays.

It does **not** prove CuPy's behaviour (that is what ``-m gpu`` is for); it proves that the
engine's own code drives the API consistently with the kernel source and with CUDA's
asynchrony.
"""

from __future__ import annotations

import contextlib
import ctypes
import tempfile
import threading
import time
import types
import weakref
from pathlib import Path
from typing import Any

import numpy as np

import cuda_host

# --------------------------------------------------------------------------------------
# memory: pools and the device's budget
# --------------------------------------------------------------------------------------


class OutOfMemoryError(MemoryError):
    """What CuPy raises when a pool cannot allocate (``cupy.cuda.memory.OutOfMemoryError``)."""

    def __init__(self, size: int, total: int, limit: int) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes, "
                         f"limit set to: {limit:,} bytes).")


class _Device:
    """The fake GPU's memory: all pools together, an optional limit, allocation records."""

    def __init__(self) -> None:
        self.limit: int | None = None
        self.pools: weakref.WeakSet = weakref.WeakSet()
        self.allocations: list[int] = []
        self.h2d: list[int] = []  # bytes of each copy_from_host_async
        self.peak = 0
        #: CuPy's scans take the length as a C int; a longer scan gives wrong answers silently
        self.scan_int_max = 2**31 - 1

    def held(self) -> int:
        return sum(p.total_bytes() for p in self.pools)

    def reset(self) -> None:
        self.limit = None
        self.allocations.clear()
        self.h2d.clear()
        self.peak = 0
        self.scan_int_max = 2**31 - 1


DEVICE = _Device()
#: every synchronisation (explicit or implicit) since the last :func:`reset`
SYNCS = [0]


def _round(n: int) -> int:
    return max(512, (int(n) + 511) // 512 * 512)  # CuPy's pool rounds to 512 bytes


class MemoryPool:
    """Caches freed blocks (best fit) until ``free_all_blocks``; ``set_limit`` caps it."""

    def __init__(self) -> None:
        self._used = 0
        self._cached: list[int] = []
        self._limit = 0
        DEVICE.pools.add(self)

    # CuPy's API
    def malloc(self, size: int) -> Any:  # only its __self__ matters to using_allocator
        raise NotImplementedError("the fake allocates through cupy.empty & co.")

    def used_bytes(self) -> int:
        return self._used

    def free_bytes(self) -> int:
        return sum(self._cached)

    def total_bytes(self) -> int:
        return self._used + sum(self._cached)

    def free_all_blocks(self, stream: Any = None) -> None:
        self._cached.clear()

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        self._limit = int(size or 0)

    def get_limit(self) -> int:
        return self._limit

    # the fake's side
    def take(self, nbytes: int) -> int:
        size = _round(nbytes)
        fits = [b for b in self._cached if b >= size]
        if fits:
            block = min(fits)
            self._cached.remove(block)
        else:
            block = size
            over_pool = self._limit and self.total_bytes() + block > self._limit
            over_device = DEVICE.limit is not None and DEVICE.held() + block > DEVICE.limit
            if over_pool or over_device:
                self.free_all_blocks()  # CuPy frees its cache and tries once more
                over_pool = self._limit and self.total_bytes() + block > self._limit
                over_device = DEVICE.limit is not None and DEVICE.held() + block > DEVICE.limit
                if over_pool or over_device:
                    raise OutOfMemoryError(size, self.total_bytes(), self._limit or DEVICE.limit or 0)
        self._used += block
        DEVICE.allocations.append(int(nbytes))
        DEVICE.peak = max(DEVICE.peak, DEVICE.held())
        return block

    def give_back(self, block: int) -> None:
        self._used -= block
        self._cached.append(block)


class PinnedMemoryPool:
    def __init__(self) -> None:
        self.frees = 0

    def free_all_blocks(self) -> None:
        self.frees += 1


_default_pool = MemoryPool()
_pinned_pool = PinnedMemoryPool()
_tls = threading.local()


def _current_pool() -> MemoryPool:
    stack = getattr(_tls, "pools", None)
    return stack[-1] if stack else _default_pool


@contextlib.contextmanager
def using_allocator(allocator: Any = None):
    pool = getattr(allocator, "__self__", None) if allocator is not None else _default_pool
    if not isinstance(pool, MemoryPool):
        raise TypeError("the fake supports using_allocator(MemoryPool().malloc) only")
    _tls.__dict__.setdefault("pools", []).append(pool)
    try:
        yield
    finally:
        _tls.pools.pop()


def _track(owner: np.ndarray) -> None:
    """Account ``owner``'s memory to the current pool until it is garbage-collected."""
    pool = _current_pool()
    block = pool.take(owner.nbytes)
    weakref.finalize(owner, pool.give_back, block)


# --------------------------------------------------------------------------------------
# device arrays
# --------------------------------------------------------------------------------------
class MemoryPointer:
    def __init__(self, ptr: int, owner: Any = None) -> None:
        self.ptr = int(ptr)
        self._owner = owner

    def __add__(self, offset: int) -> "MemoryPointer":
        return MemoryPointer(self.ptr + int(offset), self._owner)

    def copy_from_host_async(self, mem: ctypes.c_void_p, size: int, stream: Any = None) -> None:
        owner = _pinned_owner(int(mem.value), int(size))
        DEVICE.h2d.append(int(size))
        _stream_of(stream).enqueue(("copy", self.ptr, int(mem.value), int(size), (self._owner, owner)))

    def copy_to_host_async(self, mem: ctypes.c_void_p, size: int, stream: Any = None) -> None:
        owner = _pinned_owner(int(mem.value), int(size))
        _stream_of(stream).enqueue(("copy", int(mem.value), self.ptr, int(size), (self._owner, owner)))


class DevArray(np.ndarray):
    """A numpy array playing a device array."""

    @property
    def data(self) -> MemoryPointer:  # type: ignore[override]
        return MemoryPointer(self.ctypes.data, self)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        _stream_of(stream).flush()  # synchronous for pageable memory: after the stream's queue
        if isinstance(arr, DevArray):
            raise TypeError("set() takes a host array")
        np.copyto(self.view(np.ndarray), arr)

    def get(self, stream: Any = None) -> np.ndarray:
        _implicit_sync()
        return np.array(self.view(np.ndarray), copy=True)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _in_order()
        plain = tuple(x.view(np.ndarray) if isinstance(x, DevArray) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, DevArray) else o for o in kwargs["out"])
            getattr(ufunc, method)(*plain, **kwargs)
            outs = kwargs["out"]
            return _dev_view(outs[0]) if len(outs) == 1 else tuple(_dev_view(o) for o in outs)
        return _dev(getattr(ufunc, method)(*plain, **kwargs))

    def __getitem__(self, key: Any) -> Any:
        _in_order()
        mine = self.view(np.ndarray)
        res = mine[_plain(key)]
        if isinstance(res, np.ndarray) and np.may_share_memory(res, mine):
            return res.view(DevArray)  # a view: no allocation
        return _dev(res)  # fancy indexing, or a scalar (a 0-d device array, as in CuPy)

    def __setitem__(self, key: Any, value: Any) -> None:
        _in_order()
        self.view(np.ndarray)[_plain(key)] = value.view(np.ndarray) if isinstance(value, DevArray) else value

    def astype(self, dtype, *args, **kwargs):  # type: ignore[override]
        _in_order()
        return _dev(self.view(np.ndarray).astype(dtype, *args, **kwargs))

    def copy(self, *args, **kwargs):  # type: ignore[override]
        _in_order()
        return _dev(self.view(np.ndarray).copy(*args, **kwargs))

    # implicit synchronisations (CuPy copies the value to the host on the current stream)
    def __int__(self) -> int:
        _implicit_sync()
        return int(self.view(np.ndarray))

    def __index__(self) -> int:
        _implicit_sync()
        return int(self.view(np.ndarray))

    def __float__(self) -> float:
        _implicit_sync()
        return float(self.view(np.ndarray))

    def __bool__(self) -> bool:
        _implicit_sync()
        return bool(self.view(np.ndarray))

    def item(self, *args):  # type: ignore[override]
        _implicit_sync()
        return self.view(np.ndarray).item(*args)


def _plain(key: Any) -> Any:
    if isinstance(key, DevArray):
        return key.view(np.ndarray)
    if isinstance(key, tuple):
        return tuple(_plain(k) for k in key)
    return key


def _dev(x: Any) -> Any:
    """A fresh result of a numpy call as a device array, its memory taken from the pool."""
    if isinstance(x, DevArray):
        return x
    if isinstance(x, np.ndarray):
        owner = x if x.base is None else np.array(x, copy=True)
        _track(owner)
        return owner.view(DevArray)
    if isinstance(x, np.generic):
        return _dev(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_dev(v) for v in x)
    return x


def _dev_view(x: Any) -> Any:
    return x.view(DevArray) if isinstance(x, np.ndarray) and not isinstance(x, DevArray) else x


def asnumpy(a: Any, stream: Any = None) -> np.ndarray:
    _implicit_sync()
    return np.array(a.view(np.ndarray) if isinstance(a, DevArray) else a, copy=True)


# --------------------------------------------------------------------------------------
# streams, events, devices
# --------------------------------------------------------------------------------------
_ALL_STREAMS: weakref.WeakSet = weakref.WeakSet()


class Stream:
    """A queue of deferred copies and waits (see the module docstring)."""

    null: "Stream"

    def __init__(self, non_blocking: bool = False) -> None:
        self.non_blocking = non_blocking
        self.pending: list[tuple] = []
        self.delivered = 0  # operations applied so far (events compare against it)
        _ALL_STREAMS.add(self)

    def __enter__(self) -> "Stream":
        stack = _tls.__dict__.setdefault("streams", [])
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _tls.streams.pop()

    def enqueue(self, op: tuple) -> None:
        self.pending.append(op)

    def wait_event(self, event: "Event") -> None:
        """Later work on this stream runs after ``event`` (as recorded now) completed."""
        if event._stream is None:
            return  # CUDA: waiting on a never-recorded event is a no-op
        self.enqueue(("wait", event._stream, event._mark))

    def flush(self, upto: int | None = None) -> None:
        """Apply queued operations in order, up to operation number ``upto`` (all by default)."""
        target = self.enqueued if upto is None else min(upto, self.enqueued)
        while self.delivered < target:
            op = self.pending.pop(0)
            self.delivered += 1
            if op[0] == "copy":
                _, dst, src, size, _owners = op
                ctypes.memmove(dst, src, size)
            elif op[0] == "call":  # ("call", run, launch arguments kept alive)
                op[1]()
            else:  # ("wait", stream, mark)
                op[1].flush(op[2])

    def synchronize(self) -> None:
        SYNCS[0] += 1
        self.flush()

    @property
    def enqueued(self) -> int:
        return self.delivered + len(self.pending)


Stream.null = Stream()


def _current_stream() -> Stream:
    stack = getattr(_tls, "streams", None)
    return stack[-1] if stack else Stream.null


def _stream_of(stream: Any) -> Stream:
    if stream is None:
        return _current_stream()
    if not isinstance(stream, Stream):
        raise TypeError(f"stream must be a Stream, got {type(stream).__name__}")
    return stream


def _implicit_sync() -> None:
    _current_stream().synchronize()


def _in_order() -> None:
    """Work issued now on the current stream runs after that stream's queued work."""
    _current_stream().flush()


class Event:
    def __init__(self) -> None:
        self.t: float | None = None
        self._stream: Stream | None = None
        self._mark = 0

    def record(self, stream: Any = None) -> None:
        self._stream = _stream_of(stream)
        self._mark = self._stream.enqueued
        self.t = time.perf_counter()

    @property
    def done(self) -> bool:
        return self._stream is not None and self._stream.delivered >= self._mark

    def synchronize(self) -> None:
        if self._stream is None:
            raise RuntimeError("event never recorded")
        SYNCS[0] += 1
        self._stream.flush(self._mark)


def get_elapsed_time(a: Event, b: Event) -> float:
    if a.t is None or b.t is None:
        raise RuntimeError("cudaErrorInvalidResourceHandle: event never recorded")
    if not (a.done and b.done):
        raise RuntimeError("cudaErrorNotReady: an event has not completed (no synchronisation after it)")
    return max(0.0, (b.t - a.t) * 1e3)


class Device:
    #: multiprocessors of the fake device (the engine sizes its grid from it)
    sms = 2

    def __init__(self, id: int | None = None) -> None:
        self.id = 0 if id is None else int(id)
        self.attributes = {"MultiProcessorCount": Device.sms}

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def synchronize(self) -> None:
        SYNCS[0] += 1
        for s in list(_ALL_STREAMS):
            s.flush()




# --------------------------------------------------------------------------------------
# kernels: the source's __global__ functions, emulated on the host
# --------------------------------------------------------------------------------------
class LaunchLog:
    def __init__(self) -> None:
        self.launches: list[tuple[str, int, int, int]] = []  # (kernel, grid, block, W)


class _Kernel:
    def __init__(self, fn: Any, params: list, name: str, module: "RawModule") -> None:
        self._fn, self._params, self._name, self._module = fn, params, name, module

    def __call__(self, grid: tuple, block: tuple, args: tuple, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"unexpected launch options {sorted(kwargs)}")
        for dims in (grid, block):
            if not isinstance(dims, tuple) or len(dims) != 1 or not all(isinstance(d, int) and d >= 1 for d in dims):
                raise ValueError(f"{self._name}: bad launch dims {dims!r} (the kernels are one-dimensional)")
        if block[0] > 1024:
            raise ValueError(f"{self._name}: block {block} over 1024 threads")
        if grid[0] > 2**31 - 1:
            raise ValueError(f"{self._name}: grid {grid} over the x-dimension limit")
        if len(args) != len(self._params):
            raise TypeError(f"{self._name}: {len(args)} arguments for {len(self._params)} parameters")
        cargs = []
        for a, (pname, kind, dtype, _) in zip(args, self._params):
            if kind == "ptr":
                if not isinstance(a, DevArray) or a.dtype != dtype or not a.flags.c_contiguous:
                    raise TypeError(f"{self._name}: parameter {pname} wants a contiguous device {np.dtype(dtype)} "
                                    f"array, got {type(a).__name__} {getattr(a, 'dtype', '')}")
                cargs.append(ctypes.c_void_p(a.ctypes.data))
            else:
                if type(a) is not dtype:
                    raise TypeError(f"{self._name}: parameter {pname} wants {np.dtype(dtype)}, got {type(a).__name__}")
                cargs.append(ctypes.c_ulonglong(int(a)) if dtype is np.uint64 else ctypes.c_longlong(int(a)))
        self._module.launches.append(self._name)
        w = next((int(a) for a, p in zip(args, self._params) if p[0] == "W"), -1)
        LAUNCHES.launches.append((self._name, grid[0], block[0], w))
        if self._module.fail_next:
            self._module.fail_next = False
            raise RuntimeError("cudaErrorLaunchFailure: simulated lost device")
        order = cuda_host.shuffled_threads(grid[0], block[0], _RNG)
        fn = self._fn

        def run() -> None:
            fn(order.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(order.size),
               ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), *cargs)

        # a launch is queued on the current stream like a copy: it runs when that stream is
        # flushed (by later work on it, a wait ordered after it, or a synchronisation), so a
        # copy on another stream not ordered after it reads the kernel's output buffer stale
        _current_stream().enqueue(("call", run, args))


_RNG = np.random.default_rng(2718)
LAUNCHES = LaunchLog()


class RawModule:
    """Builds ``code`` as host C++ (``tests/cuda_host.py``); kernels run over shuffled threads."""

    instances: list["RawModule"] = []
    _cache: dict[str, tuple[Any, Any]] = {}

    def __init__(self, code: str, options: tuple = (), **kwargs: Any) -> None:
        if code not in RawModule._cache:
            d = tempfile.TemporaryDirectory(prefix="fake_cupy_")
            lib = cuda_host.build(code, Path(d.name), shared=True)
            RawModule._cache[code] = (d, ctypes.CDLL(str(lib)))
        self._lib = RawModule._cache[code][1]
        self._params = cuda_host.kernel_params(code)
        self.options = options
        self.launches: list[str] = []
        self.fail_next = False
        RawModule.instances.append(self)

    def get_function(self, name: str) -> _Kernel:
        if name not in self._params:
            raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name}")
        fn = getattr(self._lib, f"bm_emu_launch_{name}")
        fn.restype = None
        return _Kernel(fn, self._params[name], name, self)


def reset() -> None:
    """Forget counters, records and limits (each test starts from a clean device)."""
    SYNCS[0] = 0
    DEVICE.reset()
    LAUNCHES.launches.clear()
    RawModule.instances.clear()
    _default_pool.free_all_blocks()


# --------------------------------------------------------------------------------------
# the module objects
# --------------------------------------------------------------------------------------
def _make_cupy() -> types.ModuleType:
    cp = types.ModuleType("fake_cupy")
    cp.__dict__["__name__"] = "fake_cupy"
    for name in ("uint8", "uint32", "uint64", "int64", "int32", "bool_"):
        setattr(cp, name, getattr(np, name))
    cp.ndarray = DevArray

    def wrap(fn):
        def inner(*args, **kwargs):
            _in_order()
            args = tuple(a.view(np.ndarray) if isinstance(a, DevArray) else a for a in args)
            res = fn(*args, **kwargs)
            if fn is np.empty:
                res.view(np.uint8).reshape(-1)[:] = 0xA5  # fresh device memory holds garbage
            return _dev(res)
        inner.__name__ = fn.__name__
        return inner

    for name in ("empty", "zeros", "arange", "searchsorted", "ascontiguousarray", "concatenate", "full",
                 "where", "nonzero"):
        setattr(cp, name, wrap(getattr(np, name)))

    def cumsum(a, axis=None, dtype=None, out=None):
        _in_order()
        a = a.view(np.ndarray) if isinstance(a, DevArray) else a
        res = np.cumsum(a, axis=axis, dtype=dtype)
        if res.size > DEVICE.scan_int_max:  # CuPy: the length cast to int; past it, garbage
            res[DEVICE.scan_int_max:] = 0
        if out is not None:
            np.copyto(out.view(np.ndarray), res)
            return out
        return _dev(res)

    def asarray(a, dtype=None):
        _in_order()
        if isinstance(a, DevArray) and (dtype is None or a.dtype == dtype):
            return a
        return _dev(np.array(a.view(np.ndarray) if isinstance(a, DevArray) else a, dtype=dtype, copy=True))

    def array(a, dtype=None, copy=True):
        _in_order()
        return _dev(np.array(a.view(np.ndarray) if isinstance(a, DevArray) else a, dtype=dtype, copy=True))

    cp.cumsum, cp.asarray, cp.array, cp.asnumpy = cumsum, asarray, array, asnumpy
    cp.get_default_memory_pool = lambda: _default_pool
    cp.get_default_pinned_memory_pool = lambda: _pinned_pool
    memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError, MemoryPool=MemoryPool)
    cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, Event=Event, get_elapsed_time=get_elapsed_time,
        MemoryPool=MemoryPool, PinnedMemoryPool=PinnedMemoryPool, using_allocator=using_allocator,
        memory=memory,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                      getDeviceProperties=lambda i: {"name": b"Fake numpy device"}),
    )
    cp.cuda = cuda
    cp.RawModule = RawModule
    return cp


#: live pinned buffers (weak): asynchronous copies must name memory inside one of them
_PINNED: "weakref.WeakValueDictionary[int, np.ndarray]" = weakref.WeakValueDictionary()


def _empty_pinned(shape, dtype=float):
    arr = np.empty(shape, dtype=dtype)
    arr.view(np.uint8).reshape(-1)[:] = 0xCD  # fresh host memory holds garbage
    _PINNED[arr.ctypes.data] = arr
    return arr


def _pinned_owner(addr: int, size: int) -> np.ndarray:
    """The pinned buffer holding ``[addr, addr + size)`` (kept alive by the queued copy), or
    TypeError: CUDA's asynchronous copies from pageable memory are not asynchronous."""
    for base, arr in list(_PINNED.items()):
        if base <= addr and addr + size <= base + arr.nbytes:
            return arr
    raise TypeError(f"asynchronous copy of {size} bytes at {addr:#x}: not inside a pinned buffer "
                    "(cupyx.empty_pinned)")


#: The stand-ins: ``cupy`` and ``cupyx`` (pinned host arrays are plain numpy arrays).
cupy = _make_cupy()
cupyx = types.SimpleNamespace(empty_pinned=_empty_pinned)
