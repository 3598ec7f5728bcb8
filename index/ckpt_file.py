"""The checkpoint file: named, checksummed sections, written atomically. Never pickle.

Question answered: "how do we put a few large numpy buffers and a few small documents on
disk so that a restart reads them back in a handful of large reads, and a crash at any
moment leaves the previous file intact?"

Layout (all integers little-endian; version 1)::

    "BMCKPT\\0\\0" | u32 version | u32 flags (0)                     16-byte header
    section blobs: each section's JSON document, then its buffers (64-byte aligned)
    TOC: JSON {"version", "created", "info", "sections": [...]}    (utf-8)
    trailer: u64 toc_offset | u32 toc_length | u32 toc_crc32 | "BMCKEND\\0"   24 bytes

A section is a JSON document (metadata, small tables; ``Section.doc``) plus any number of
raw buffers (``Section.arrays``: name -> ndarray, or a list of ndarrays concatenated along
axis 0, so a block-allocated store is written without gathering it first). The TOC names
each buffer's dtype, shape, offset, length and CRC-32, and each document's too, so every
byte a restore uses is verified (CRC-32 runs at ~1.1 GB/s here). The header carries the
version first, so an unknown version is told apart from corruption before anything else
is read; a file without a valid trailer (truncated: the writer died) is corrupt.

Writing (:func:`write_checkpoint`): a temporary file ``<name>.tmp-<pid>`` in the same
directory, written, ``fsync``-ed, renamed over ``path``, then the directory ``fsync``-ed.
A crash before the rename leaves the previous checkpoint as it was (and a stray temporary
file, removed by the next writer); after the rename the new file is complete. Readers
(:func:`read_checkpoint`) raise :class:`CheckpointError` subclasses naming the reason.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

__all__ = [
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "CheckpointFile",
    "CorruptCheckpoint",
    "Section",
    "SectionReader",
    "UnknownCheckpointVersion",
    "WriteStats",
    "read_checkpoint",
    "remove_stale_temporaries",
    "write_checkpoint",
]

MAGIC = b"BMCKPT\0\0"
END_MAGIC = b"BMCKEND\0"
CHECKPOINT_VERSION = 1
_HEADER = struct.Struct("<8sII")
_TRAILER = struct.Struct("<QII8s")
_ALIGN = 64
#: Bytes per write/read/CRC step: large enough for full-speed I/O, small enough that the
#: progress callback (tests kill a writer half-way) and a reader's memory stay bounded.
_PIECE = 32 << 20

ArrayLike = Union[np.ndarray, Sequence[np.ndarray]]


class CheckpointError(Exception):
    """A checkpoint file cannot be used; ``reason`` is a short phrase for logs and metrics."""

    reason = "unreadable"


class CorruptCheckpoint(CheckpointError):
    """Bad magic, a missing or bad trailer (truncated), a checksum mismatch, a bad TOC."""

    reason = "corrupt"


class UnknownCheckpointVersion(CheckpointError):
    """A well-formed header with a version this build does not read."""

    reason = "unknown_version"


@dataclass
class Section:
    """What one section holds: a JSON-able document and raw buffers (bulk data)."""

    doc: Any = field(default_factory=dict)
    arrays: Mapping[str, ArrayLike] = field(default_factory=dict)


@dataclass
class WriteStats:
    path: str
    bytes: int
    seconds: float
    sections: dict[str, int]  # section -> bytes


def _parts(value: ArrayLike) -> tuple[list[np.ndarray], np.dtype, tuple[int, ...]]:
    parts = [value] if isinstance(value, np.ndarray) else list(value)
    if not parts:
        raise ValueError("an array given as parts needs at least one part")
    dtype = parts[0].dtype
    tail = parts[0].shape[1:]
    for p in parts:
        if p.dtype != dtype or p.shape[1:] != tail:
            raise ValueError(f"array parts disagree: {p.dtype}{p.shape} vs {dtype}(..., {tail})")
        if not p.flags.c_contiguous:
            raise ValueError("array parts must be C-contiguous")
    rows = sum(int(p.shape[0]) if p.ndim else 1 for p in parts)
    shape = (rows, *tail) if parts[0].ndim else ()
    return parts, dtype, shape


class _Writer:
    def __init__(self, fd: int, progress: Optional[Callable[[int], None]]) -> None:
        self.fd, self.pos, self.progress = fd, 0, progress

    def write(self, data: Any, crc: int = 0) -> int:
        """Write ``data`` (bytes-like or a C-contiguous array); returns the running CRC-32
        continued from ``crc`` (one buffer may be written in several parts)."""
        mv = memoryview(data).cast("B")
        for start in range(0, len(mv), _PIECE):
            piece = mv[start:start + _PIECE]
            crc = zlib.crc32(piece, crc)
            rest = piece
            while rest:
                n = os.write(self.fd, rest)
                rest = rest[n:]
            self.pos += len(piece)
            if self.progress is not None:
                self.progress(self.pos)
        return crc

    def pad(self) -> None:
        extra = (-self.pos) % _ALIGN
        if extra:
            self.write(b"\0" * extra)


def write_checkpoint(path: str | os.PathLike, sections: Mapping[str, Section], *, info: Any = None,
                     progress: Optional[Callable[[int], None]] = None) -> WriteStats:
    """Write ``sections`` atomically to ``path`` (see the module docstring).

    ``info``: a small JSON document shown by ``blendmatch checkpoint inspect`` (counts).
    ``progress(bytes_written)`` is called after every piece (tests use it to die half-way).
    Raises ``OSError`` (the previous checkpoint then stands) and ``ValueError`` for bad input.
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        w = _Writer(fd, progress)
        w.write(_HEADER.pack(MAGIC, CHECKPOINT_VERSION, 0))
        toc_sections = []
        sizes: dict[str, int] = {}
        for name, sec in sections.items():
            start = w.pos
            doc_bytes = json.dumps(sec.doc, separators=(",", ":")).encode()
            entry: dict[str, Any] = {"name": name, "doc": {"offset": w.pos, "length": len(doc_bytes),
                                                            "crc32": w.write(doc_bytes)}, "arrays": []}
            for aname, value in sec.arrays.items():
                parts, dtype, shape = _parts(value)
                w.pad()
                offset, crc = w.pos, 0
                for p in parts:
                    crc = w.write(p.reshape(-1), crc)
                entry["arrays"].append({"name": aname, "dtype": dtype.str, "shape": list(shape),
                                        "offset": offset, "length": w.pos - offset, "crc32": crc})
            toc_sections.append(entry)
            sizes[name] = w.pos - start
        toc = json.dumps({"version": CHECKPOINT_VERSION, "created": time.time(), "info": info,
                          "sections": toc_sections}, separators=(",", ":")).encode()
        toc_offset = w.pos
        toc_crc = w.write(toc)
        w.write(_TRAILER.pack(toc_offset, len(toc), toc_crc, END_MAGIC))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(folder)
    return WriteStats(path, w.pos, time.perf_counter() - t0, sizes)


def _fsync_dir(folder: str) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Remove ``<path>.tmp-<pid>`` files left by writers that died (none is running: call
    before this process writes its first checkpoint). Returns the removed paths."""
    path = os.fspath(path)
    folder, base = os.path.split(os.path.abspath(path))
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if name.startswith(base + ".tmp-"):
            full = os.path.join(folder, name)
            _unlink_quietly(full)
            removed.append(full)
    return removed


class SectionReader:
    """One section of an open checkpoint: its document (verified) and lazy, verified buffers."""

    def __init__(self, file: "CheckpointFile", entry: dict[str, Any]) -> None:
        self._file = file
        self.name: str = entry["name"]
        self._arrays = {a["name"]: a for a in entry["arrays"]}
        raw = file._read_exact(entry["doc"]["offset"], entry["doc"]["length"])
        if zlib.crc32(raw) != entry["doc"]["crc32"]:
            raise CorruptCheckpoint(f"section {self.name!r}: document checksum mismatch")
        try:
            self.doc = json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpoint(f"section {self.name!r}: document is not JSON ({exc})") from None
        self.nbytes = entry["doc"]["length"] + sum(a["length"] for a in entry["arrays"])

    def has(self, name: str) -> bool:
        return name in self._arrays

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._desc(name)["shape"])

    def _desc(self, name: str) -> dict[str, Any]:
        try:
            return self._arrays[name]
        except KeyError:
            raise CorruptCheckpoint(f"section {self.name!r}: buffer {name!r} is missing") from None

    def array(self, name: str, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Read buffer ``name`` (verified by its CRC-32). ``out``: a C-contiguous array to read
        into (it may be larger: the buffer fills its first bytes); returned as given."""
        d = self._desc(name)
        try:
            dtype = np.dtype(d["dtype"])
            shape = tuple(int(x) for x in d["shape"])
        except (TypeError, ValueError):
            raise CorruptCheckpoint(f"section {self.name!r}: buffer {name!r} has a bad descriptor") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes != d["length"]:
            raise CorruptCheckpoint(f"section {self.name!r}: buffer {name!r} length does not match its shape")
        if out is None:
            result = np.empty(shape, dtype=dtype)
            target = memoryview(result.reshape(-1)).cast("B") if nbytes else memoryview(b"")
        else:
            if not out.flags.c_contiguous or out.nbytes < nbytes:
                raise ValueError(f"out must be C-contiguous with >= {nbytes} bytes")
            result = out
            target = memoryview(out.reshape(-1)).cast("B")[:nbytes]
        crc = self._file._read_into(d["offset"], target)
        if crc != d["crc32"]:
            raise CorruptCheckpoint(f"section {self.name!r}: buffer {name!r} checksum mismatch")
        return result

    def verify(self) -> None:
        """Check every buffer's checksum without keeping the data."""
        for name, d in self._arrays.items():
            crc, pos, end = 0, d["offset"], d["offset"] + d["length"]
            while pos < end:
                raw = self._file._read_exact(pos, min(_PIECE, end - pos))
                crc = zlib.crc32(raw, crc)
                pos += len(raw)
            if crc != d["crc32"]:
                raise CorruptCheckpoint(f"section {self.name!r}: buffer {name!r} checksum mismatch")


class CheckpointFile:
    """An open, header- and TOC-verified checkpoint. Use as a context manager."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._f = open(self.path, "rb", buffering=0)
        try:
            self._open()
        except BaseException:
            self._f.close()
            raise

    def _open(self) -> None:
        size = os.fstat(self._f.fileno()).st_size
        self.size = size
        head = self._read_exact(0, _HEADER.size, what="header")
        magic, version, _flags = _HEADER.unpack(head)
        if magic != MAGIC:
            raise CorruptCheckpoint("not a blendmatch checkpoint (bad magic)")
        if version != CHECKPOINT_VERSION:
            raise UnknownCheckpointVersion(f"checkpoint version {version}; this build reads {CHECKPOINT_VERSION}")
        if size < _HEADER.size + _TRAILER.size:
            raise CorruptCheckpoint("truncated (no trailer)")
        toc_offset, toc_len, toc_crc, end = _TRAILER.unpack(self._read_exact(size - _TRAILER.size, _TRAILER.size))
        if end != END_MAGIC or toc_offset + toc_len != size - _TRAILER.size:
            raise CorruptCheckpoint("truncated or damaged (bad trailer)")
        raw = self._read_exact(toc_offset, toc_len, what="table of contents")
        if zlib.crc32(raw) != toc_crc:
            raise CorruptCheckpoint("table of contents checksum mismatch")
        try:
            toc = json.loads(raw)
            self.version: int = int(toc["version"])
            self.created: float = float(toc["created"])
            self.info: Any = toc.get("info")
            entries = list(toc["sections"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"bad table of contents ({exc})") from None
        self._entries = {e["name"]: e for e in entries}
        self._limit = toc_offset
        for e in entries:
            for region in [e["doc"], *e["arrays"]]:
                if region["offset"] < _HEADER.size or region["offset"] + region["length"] > toc_offset:
                    raise CorruptCheckpoint(f"section {e['name']!r}: region outside the file")
        self._sections: dict[str, SectionReader] = {}

    @property
    def section_names(self) -> list[str]:
        return list(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def section(self, name: str) -> SectionReader:
        """The section (its document is read and verified now)."""
        got = self._sections.get(name)
        if got is None:
            entry = self._entries.get(name)
            if entry is None:
                raise CorruptCheckpoint(f"section {name!r} is missing")
            got = self._sections[name] = SectionReader(self, entry)
        return got

    def verify(self) -> None:
        """Verify every section's document and buffers."""
        for name in self._entries:
            self.section(name).verify()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def _read_exact(self, offset: int, length: int, what: str = "data") -> bytes:
        self._f.seek(offset)
        chunks, left = [], length
        while left:
            got = self._f.read(left)
            if not got:
                raise CorruptCheckpoint(f"truncated (short read of {what})")
            chunks.append(got)
            left -= len(got)
        return b"".join(chunks)

    def _read_into(self, offset: int, target: memoryview) -> int:
        """Fill ``target`` from ``offset``; returns the CRC-32 of what was read."""
        self._f.seek(offset)
        crc, pos, n = 0, 0, len(target)
        while pos < n:
            piece = target[pos:pos + _PIECE]
            got = self._f.readinto(piece)
            if not got:
                raise CorruptCheckpoint("truncated (short read of a buffer)")
            crc = zlib.crc32(piece[:got], crc)
            pos += got
        return crc

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "CheckpointFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_checkpoint(path: str | os.PathLike) -> CheckpointFile:
    """Open ``path`` and verify its header, trailer and table of contents. Raises
    ``FileNotFoundError`` when absent and :class:`CheckpointError` when unusable."""
    return CheckpointFile(path)
