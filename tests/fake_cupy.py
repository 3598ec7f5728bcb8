"""A numpy-backed stand-in for the slice of CuPy that ``gpu/cupy_engine.py`` uses.

Why: CI has no GPU, yet the GPU engine's Python side (staging and its asynchronous copies,
kernel argument lists, the survivor-count read-back, the packed copy-back, events, the
mirror's uploads) should still run in CI. This module plays the device:

- "device arrays" are numpy arrays of the subclass :class:`DevArray`, whose ``.data`` is a
  :class:`MemoryPointer` (raw address arithmetic and ``copy_{from,to}_host_async`` as
  ``memmove``), with ``.set(host, stream=...)``;
- :class:`RawModule` compiles the *given source text* with the host C compiler (the kernel
  source is valid C, see ``cupy_engine.KERNEL_SOURCE``) and maps each ``__global__`` kernel
  ``bm_X_kernel`` to its host loop ``bm_X_host``. Launch arguments are checked against the C
  prototype parsed from the source: device arrays of the exact element type for pointers,
  numpy scalars of the exact type for values (what CuPy would marshal by size);
- streams, events and devices are context managers with host timers.

It does **not** prove CuPy's behaviour (that is what ``-m gpu`` is for); it proves that the
engine's own code drives the API consistently with the kernel source.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

_C_TYPES = {
    "bm_u64*": ("ptr", np.uint64), "bm_i64*": ("ptr", np.int64), "unsignedchar*": ("ptr", np.uint8),
    "bm_u64": ("val", np.uint64), "bm_i64": ("val", np.int64),
}


def parse_prototypes(source: str) -> dict[str, list[tuple[str, str, Any]]]:
    """``{function: [(name, kind, dtype), ...]}`` for every kernel and host loop in ``source``."""
    out = {}
    pat = re.compile(r'(?:extern "C" __global__ void|\nvoid) (bm_\w+_(?:kernel|host))\((.*?)\)\s*\{', re.S)
    for m in pat.finditer(source):
        params = []
        for raw in m.group(2).split(","):
            words = [w for w in raw.replace("*", " * ").split() if w not in ("const", "__restrict__")]
            name = words[-1]
            ctype = "".join(words[:-1])
            params.append((name,) + _C_TYPES[ctype])
        out[m.group(1)] = params
    return out


class MemoryPointer:
    def __init__(self, ptr: int, owner: Any = None) -> None:
        self.ptr = int(ptr)
        self._owner = owner

    def __add__(self, offset: int) -> "MemoryPointer":
        return MemoryPointer(self.ptr + int(offset), self._owner)

    def copy_from_host_async(self, mem: ctypes.c_void_p, size: int, stream: Any = None) -> None:
        _check_stream(stream)
        ctypes.memmove(self.ptr, mem.value, int(size))

    def copy_to_host_async(self, mem: ctypes.c_void_p, size: int, stream: Any = None) -> None:
        _check_stream(stream)
        ctypes.memmove(mem.value, self.ptr, int(size))


class DevArray(np.ndarray):
    """A numpy array playing a device array."""

    @property
    def data(self) -> MemoryPointer:  # type: ignore[override]
        return MemoryPointer(self.ctypes.data, self)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        _check_stream(stream)
        if isinstance(arr, DevArray):
            raise TypeError("set() takes a host array")
        np.copyto(self, arr)


def _dev(x: Any) -> Any:
    if isinstance(x, np.ndarray) and not isinstance(x, DevArray):
        return x.view(DevArray)
    if isinstance(x, tuple):
        return tuple(_dev(v) for v in x)
    return x


class Stream:
    current: "Stream | None" = None

    def __init__(self, non_blocking: bool = False) -> None:
        self.non_blocking = non_blocking
        self.synchronized = 0
        self._prev: list[Stream | None] = []

    def __enter__(self) -> "Stream":
        self._prev.append(Stream.current)
        Stream.current = self
        return self

    def __exit__(self, *exc: Any) -> None:
        Stream.current = self._prev.pop()

    def synchronize(self) -> None:
        self.synchronized += 1


def _check_stream(stream: Any) -> None:
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"stream must be a Stream, got {type(stream).__name__}")


class Event:
    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        _check_stream(stream)
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        if self.t is None:
            raise RuntimeError("event never recorded")


def get_elapsed_time(a: Event, b: Event) -> float:
    if a.t is None or b.t is None:
        raise RuntimeError("cudaErrorInvalidResourceHandle: event never recorded")
    return max(0.0, (b.t - a.t) * 1e3)


class Device:
    def __init__(self, id: int | None = None) -> None:
        self.id = 0 if id is None else int(id)
        self.attributes = {"MultiProcessorCount": 2}

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Kernel:
    def __init__(self, fn: Any, proto: list, name: str, module: "RawModule") -> None:
        self._fn, self._proto, self._name, self._module = fn, proto, name, module

    def __call__(self, grid: tuple, block: tuple, args: tuple, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"unexpected launch options {sorted(kwargs)}")
        for dims in (grid, block):
            if not isinstance(dims, tuple) or not dims or not all(isinstance(d, int) and d >= 1 for d in dims):
                raise ValueError(f"{self._name}: bad launch dims {dims!r}")
        if block[0] > 1024:
            raise ValueError(f"{self._name}: block {block} over 1024 threads")
        if len(args) != len(self._proto):
            raise TypeError(f"{self._name}: {len(args)} arguments for {len(self._proto)} parameters")
        for a, (pname, kind, dtype) in zip(args, self._proto):
            if kind == "ptr":
                if not isinstance(a, DevArray) or a.dtype != dtype or not a.flags.c_contiguous:
                    raise TypeError(f"{self._name}: parameter {pname} wants a contiguous device {np.dtype(dtype)} "
                                    f"array, got {type(a).__name__} {getattr(a, 'dtype', '')}")
            elif type(a) is not dtype:
                raise TypeError(f"{self._name}: parameter {pname} wants {np.dtype(dtype)}, got {type(a).__name__}")
        self._module.launches.append(self._name)
        if self._module.fail_next:
            self._module.fail_next = False
            raise RuntimeError("cudaErrorLaunchFailure: simulated lost device")
        cargs = [ctypes.c_void_p(a.ctypes.data) if kind == "ptr" else
                 (ctypes.c_ulonglong(int(a)) if dtype is np.uint64 else ctypes.c_longlong(int(a)))
                 for a, (_, kind, dtype) in zip(args, self._proto)]
        self._fn(*cargs)


class RawModule:
    """Compiles ``code`` with the host C compiler; kernels run as their host loops."""

    instances: list["RawModule"] = []

    def __init__(self, code: str, options: tuple = (), **kwargs: Any) -> None:
        cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if cc is None:
            raise RuntimeError("no C compiler for the fake device")
        self._dir = tempfile.TemporaryDirectory(prefix="fake_cupy_")
        src, lib = Path(self._dir.name) / "k.c", Path(self._dir.name) / "k.so"
        src.write_text(code)
        res = subprocess.run([cc, "-O2", "-std=gnu99", "-shared", "-fPIC", "-x", "c", str(src), "-o", str(lib)],
                             capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"compile failed: {res.stderr}")
        self._lib = ctypes.CDLL(str(lib))
        self._protos = parse_prototypes(code)
        self.options = options
        self.launches: list[str] = []
        self.fail_next = False
        RawModule.instances.append(self)

    def get_function(self, name: str) -> _Kernel:
        host = name.replace("_kernel", "_host")
        if name not in self._protos or host not in self._protos:
            raise RuntimeError(f"no kernel {name} in the module")
        if [p[1:] for p in self._protos[name]] != [p[1:] for p in self._protos[host]]:
            raise RuntimeError(f"{name} and {host} disagree on their parameters")
        fn = getattr(self._lib, host)
        fn.restype = None
        return _Kernel(fn, self._protos[name], name, self)


def _make_cupy() -> types.ModuleType:
    cp = types.ModuleType("fake_cupy")
    cp.__dict__["__name__"] = "fake_cupy"
    for name in ("uint8", "uint32", "uint64", "int64", "int32", "bool_"):
        setattr(cp, name, getattr(np, name))
    cp.ndarray = DevArray

    def wrap(fn):
        def inner(*args, **kwargs):
            return _dev(fn(*args, **kwargs))
        inner.__name__ = fn.__name__
        return inner

    for name in ("empty", "zeros", "arange", "searchsorted", "ascontiguousarray", "concatenate", "full"):
        setattr(cp, name, wrap(getattr(np, name)))

    def cumsum(a, axis=None, dtype=None, out=None):
        if out is not None:
            np.cumsum(a, axis=axis, dtype=dtype, out=out)
            return out
        return _dev(np.cumsum(a, axis=axis, dtype=dtype))

    def asarray(a, dtype=None):
        return _dev(np.array(a, dtype=dtype, copy=True))  # to the "device": always a copy

    def array(a, dtype=None, copy=True):
        return _dev(np.array(a, dtype=dtype, copy=True))

    cp.cumsum, cp.asarray, cp.array = cumsum, asarray, array
    cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, Event=Event, get_elapsed_time=get_elapsed_time,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                      getDeviceProperties=lambda i: {"name": b"Fake numpy device"}),
    )
    cp.cuda = cuda
    cp.RawModule = RawModule
    return cp


#: The stand-ins: ``cupy`` and ``cupyx`` (pinned host arrays are plain numpy arrays).
cupy = _make_cupy()
cupyx = types.SimpleNamespace(empty_pinned=lambda shape, dtype=float: np.empty(shape, dtype=dtype))
