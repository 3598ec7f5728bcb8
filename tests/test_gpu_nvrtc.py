"""The GPU kernels compiled by NVRTC for sm_90 (H100/H200), without a GPU or a driver.

NVRTC comes from its pip wheel (``nvidia-cuda-nvrtc``, in the ``test`` extras; also
``nvidia-cuda-nvrtc-cu12`` when installed) and is loaded with ctypes. The source is compiled
with the options CuPy's ``RawModule`` passes (CuPy 14: ``--std=c++17`` by default, ``-ftz=true``,
``-arch=sm_90`` to get a cubin directly, ``--device-as-default-execution-space``; its ``-I``
options do not matter, the source includes nothing) plus ``--ptxas-options=-v`` for the
resource report. The test fails on any error or warning, a spill, a stack frame, a missing
entry point, or more than 64 registers per thread (a 256-thread block then still fits 4
blocks per SM on the register file).
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import struct

import pytest

from blendmatch.gpu import cupy_engine

#: What CuPy 14's RawModule adds for a source without options, on an sm_90 device
#: (cupy/_core/core.pyx assemble_cupy_compiler_options, cupy/cuda/compiler.py).
CUPY_OPTIONS = ("--std=c++17", "-ftz=true", "-arch=sm_90", "--device-as-default-execution-space")
MAX_REGISTERS = 64


def _nvrtc_libraries() -> list[str]:
    try:
        import nvidia
    except ImportError:
        return []
    found = []
    for base in list(getattr(nvidia, "__path__", [])):
        found += glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*"))
    return sorted({p for p in found if "builtins" not in os.path.basename(p)})


LIBS = _nvrtc_libraries()


class Nvrtc:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        assert self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
        self.version = (major.value, minor.value)

    def compile(self, source: str, options: tuple[str, ...]) -> tuple[int, str, bytes]:
        """``(result, log, cubin)`` (``cubin`` empty when the compile failed)."""
        lib = self.lib
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"blendmatch_kernels.cu", 0, None,
                                      None) == 0
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            result = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            cubin = b""
            if result == 0:
                lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
                out = ctypes.create_string_buffer(size.value)
                assert lib.nvrtcGetCUBIN(prog, out) == 0
                cubin = out.raw
            return result, buf.value.decode(errors="replace"), cubin
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def elf_functions(image: bytes) -> set[str]:
    """Names of the global function symbols of an ELF64 little-endian image (a cubin)."""
    assert image[:4] == b"\x7fELF" and image[4] == 2 and image[5] == 1, "not an ELF64 LE image"
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        stroff = sections[link][4]
        for k in range(size // entsize):
            st_name, st_info = struct.unpack_from("<IB", image, off + k * entsize)
            if st_info >> 4 == 1 and st_info & 0xF == 2:  # STB_GLOBAL, STT_FUNC
                end = image.index(b"\0", stroff + st_name)
                names.add(image[stroff + st_name:end].decode())
    return names


def resource_report(log: str) -> dict[str, dict[str, int]]:
    """``{kernel: {registers, stack, spill_stores, spill_loads}}`` from ptxas's ``-v`` log."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for 'sm_90'", line)
        if m:
            current = out.setdefault(m.group(1), {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
    return out


@pytest.fixture(params=LIBS or [None], ids=lambda p: os.path.basename(os.path.dirname(os.path.dirname(p))) if p
                else "none")
def nvrtc(request):
    if request.param is None:
        pytest.skip("no NVRTC wheel installed (nvidia-cuda-nvrtc is in the test extras: pip install -e '.[test]')")
    return Nvrtc(request.param)


def test_kernel_source_includes_nothing():
    # so CuPy's -I options (its headers, CCCL, the CUDA headers) cannot change the compile
    assert "#include" not in cupy_engine.KERNEL_SOURCE


def test_kernels_compile_for_sm90_cleanly(nvrtc):
    result, log, cubin = nvrtc.compile(cupy_engine.KERNEL_SOURCE, CUPY_OPTIONS + ("--ptxas-options=-v",))
    assert result == 0, f"NVRTC {nvrtc.version} failed:\n{log}"
    assert "warning" not in log.lower(), log
    assert "error" not in log.lower(), log
    assert elf_functions(cubin) >= set(cupy_engine.KERNEL_NAMES), sorted(elf_functions(cubin))
    report = resource_report(log)
    assert set(report) == set(cupy_engine.KERNEL_NAMES), log
    for kernel, r in report.items():
        assert r.keys() >= {"registers", "stack", "spill_stores", "spill_loads"}, (kernel, log)
        assert r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, (kernel, r)
        assert 0 < r["registers"] <= MAX_REGISTERS, (kernel, r)


def test_kernels_compile_as_ptx_for_compute_90(nvrtc):
    # what CuPy does instead under CUPY_COMPILE_WITH_PTX=1 (or a newer device than NVRTC knows)
    opts = tuple(o if o != "-arch=sm_90" else "-arch=compute_90" for o in CUPY_OPTIONS)
    result, log, _ = nvrtc.compile(cupy_engine.KERNEL_SOURCE, opts)
    assert result == 0 and "warning" not in log.lower(), log


def test_the_harness_reports_a_broken_kernel(nvrtc):
    broken = cupy_engine.KERNEL_SOURCE.replace("bm_u64 m =", "bm_u64 m = =")
    result, log, cubin = nvrtc.compile(broken, CUPY_OPTIONS)
    assert result != 0 and "error" in log and not cubin
