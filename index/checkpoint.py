"""Checkpoints of the key directory: what goes in, how it is captured, how it comes back.

Question answered: "how does a restart answer exactly as before, without pausing ingest for
seconds and without pausing lookups at all?"

Sections (file format: ``ckpt_file.py``; each section checksummed):

- ``meta`` (document): chunk size, probe stride, filter, whether blend lookup is on: a
  checkpoint is restored only into a server with the same ones (:class:`IncompatibleCheckpoint`).
- ``gate`` (document): every instance's cursor ``(incarnation, last_seq, ...)`` and the
  gate's counters, so a replayed batch is a duplicate after a restart.
- ``directory`` (bulk): bindings in dict order (chunk hashes, interned member tables as a
  small document plus one member id per binding, offsets, indexed flags, where each
  binding's tokens live: a row of the index, none, or a private copy), the per-instance L1
  bookkeeping, each accessed key's access count and last access time (as the binding's
  position and its scope's), capacities and counters.
- ``index`` (bulk, when blend lookup is on): the blend index's columns, free lists,
  fingerprint map, occupant hashes and token rows exactly as they are
  (``BlendIndex.export_state``): occupant and claim order, hence every answer, survive.
- any number of extra documents registered by the service (``registry``,
  ``stream_position``, ...): opaque JSON, returned to their owners on restore.

Capture (:func:`capture`): ingest is paused (the directory lock) only while the process
**forks** (copy-on-write: the child sees a frozen copy of every structure, Redis' BGSAVE
trick), then the child encodes and writes the file while the parent goes on ingesting.
The pause is the ``fork`` call: page tables only (measured in ``docs/performance.md``).
Lookups never take the directory lock; they wait only for the fork syscall itself. The
child touches no lock (every structure it reads was quiescent at the fork: writes happen
only under the directory lock, which the forking thread holds), logs nothing and leaves
with ``os._exit``; it dies with its parent (``PR_SET_PDEATHSIG``), so a killed server
leaves the previous checkpoint and at most a stray temporary file. Without ``os.fork``
(or ``fork=False``) the encoding and writing run inline, ingest paused throughout.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np

from .ckpt_file import CheckpointError, CheckpointFile, Section, WriteStats, read_checkpoint, write_checkpoint
from .key_directory import KeyDirectory
from .placements import Placement
from .storage import split_hashes
from .types import BlendNamespace
from .wire import KeyScope

__all__ = ["CaptureResult", "IncompatibleCheckpoint", "RestoreResult", "capture", "directory_sections",
           "enter_forked_child",
           "inspect_checkpoint", "restore_directory"]

#: Sections this module writes itself; any other section is an extra document.
CORE_SECTIONS = ("meta", "gate", "directory", "index")


class IncompatibleCheckpoint(CheckpointError):
    """A valid checkpoint from a server with another chunk size, stride, filter or blend
    setting: not corrupt, so it is not set aside; the server refuses to start."""

    reason = "incompatible"


@dataclass
class CaptureResult:
    path: str
    bytes: int
    pause_s: float  # ingest paused (directory lock held)
    total_s: float  # until the file was renamed into place
    forked: bool
    info: dict[str, Any]


@dataclass
class RestoreResult:
    path: str
    bytes: int
    seconds: float
    created: float
    info: dict[str, Any]
    extra: dict[str, Any]  # extra documents by section name


# ---------------------------------------------------------------------- encoding
def _meta_doc(directory: KeyDirectory) -> dict[str, Any]:
    index = directory.blend_index
    return {"blend_lookup": index is not None,
            "chunk_size": index.chunk_size if index is not None else None,
            "probe_stride": index.probe_stride if index is not None else None,
            "filter": index.filter if index is not None else None}


def _hash_columns(hashes: list[bytes]) -> dict[str, np.ndarray]:
    lengths = np.fromiter(map(len, hashes), dtype=np.int32, count=len(hashes))
    return {"hash_len": lengths, "hash_blob": np.frombuffer(b"".join(hashes), dtype=np.uint8)}


def directory_sections(directory: KeyDirectory, extra: Optional[Mapping[str, Any]] = None
                       ) -> tuple[dict[str, Section], dict[str, Any]]:
    """The sections of ``directory`` (call with ingest paused, or in a forked child) and the
    summary shown by ``inspect``. ``extra``: name -> JSON document, one section each."""
    snap = directory.export_state()
    hashes: list[bytes] = snap["hashes"]
    n = len(hashes)
    # member tables: interned tuples, deduplicated by identity, then scopes/placements by value
    member_ids: dict[int, int] = {}
    uniq: list[Any] = []
    mids = np.empty(n, dtype=np.int32)
    for i, m in enumerate(snap["members"]):
        j = member_ids.get(id(m))
        if j is None:
            j = member_ids[id(m)] = len(uniq)
            uniq.append(m)
        mids[i] = j
    scope_ix: dict[Any, int] = {}
    place_ix: dict[Any, int] = {}
    table = [[[scope_ix.setdefault(sc, len(scope_ix)), [place_ix.setdefault(p, len(place_ix)) for p in pls]]
              for sc, pls in m] for m in uniq]
    scopes = [[sc.model_name, sc.kv_rank, sc.object_group_id, sc.cache_salt, sc.namespace.world_size]
              for sc in scope_ix]
    placements = [list(p) for p in place_ix]
    tokens = snap["tokens"]
    index = snap["index"]
    ref = index.locate_rows(tokens) if index is not None else np.full(n, -1, dtype=np.int64)
    private = [i for i in np.flatnonzero(ref < 0).tolist() if tokens[i] is not None]
    ref[private] = -2
    priv_len = np.fromiter((tokens[i].shape[0] for i in private), dtype=np.int64, count=len(private))
    priv_blob = np.concatenate([tokens[i] for i in private]) if private else np.empty(0, dtype=np.uint32)
    # canonical: instances sorted, each one's chunks in binding order (the logs' order
    # depends on when each was compacted, which a replica's history decides)
    l1_insts = sorted(snap["l1_chunks"])
    if l1_insts:
        pos = {h: i for i, h in enumerate(hashes)}
        l1_pos = np.concatenate([np.sort(np.fromiter((pos[h] for h in snap["l1_chunks"][inst]), dtype=np.int64))
                                 for inst in l1_insts])
    else:
        l1_pos = np.empty(0, dtype=np.int64)
    # access records: the key's binding position and scope id (every accessed key is live,
    # so its scope is in the member tables), sorted for a canonical file
    access = snap.get("access") or {}
    if access:
        pos = {h: i for i, h in enumerate(hashes)}
        scope_of = {tuple(sc[:4]): i for sc, i in scope_ix.items()}  # an ObjectKey's fields after its hash
        rows = sorted((pos[k.chunk_hash], scope_of[(k.model_name, k.kv_rank, k.object_group_id, k.cache_salt)],
                       rec[0], rec[1]) for k, rec in access.items())
    else:
        rows = []
    acc_arrays = {"access_pos": np.asarray([r[0] for r in rows], dtype=np.int64),
                  "access_scope": np.asarray([r[1] for r in rows], dtype=np.int64),
                  "access_count": np.asarray([r[2] for r in rows], dtype=np.int64),
                  "access_last": np.asarray([r[3] for r in rows], dtype=np.float64)}
    dir_doc = {"bindings": n, "scopes": scopes, "placements": placements, "members": table,
               "l1_chunks": [[inst, len(snap["l1_chunks"][inst])] for inst in l1_insts],
               "l1_keys": snap["l1_keys"], "capacity": snap["capacity"], "counters": snap["counters"]}
    dir_arrays = {**_hash_columns(hashes), "member_id": mids,
                  "offset": np.asarray(snap["offsets"], dtype=np.int64),
                  "indexed": np.asarray(snap["indexed"], dtype=np.uint8), "token_ref": ref,
                  "private_len": priv_len, "private_tokens": priv_blob, "l1_pos": l1_pos, **acc_arrays}
    sections = {"meta": Section(_meta_doc(directory)), "gate": Section(snap["gate"]),
                "directory": Section(dir_doc, dir_arrays)}
    if index is not None:
        idoc, iarrays = index.export_state()
        sections["index"] = Section(idoc, iarrays)
    for name, doc in (extra or {}).items():
        if name in CORE_SECTIONS:
            raise ValueError(f"extra section name {name!r} is reserved")
        sections[name] = Section(doc)
    info = {"chunk_hashes": n, "keys": snap["counters"]["num_keys"],
            "placements": snap["counters"]["num_placements"],
            "indexed_chunks": int((ref >= 0).sum()), "instances": len(snap["gate"]["cursors"]),
            "extra_sections": sorted(extra or {})}
    return sections, info


# ---------------------------------------------------------------------- capture
def _set_parent_death_signal() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def enter_forked_child(parent: int) -> None:
    """What a child forked to write a frozen copy of the directory does first (a checkpoint
    here, a KV-events snapshot in the service): the service's SIGTERM/SIGINT handlers go
    back to the default, it dies with ``parent`` (``PR_SET_PDEATHSIG``; it leaves at once if
    the parent is already gone), and the cyclic GC is off (nothing to collect in a
    short-lived copy, and a collection would touch, hence copy, every page)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (ValueError, OSError):
            pass
    _set_parent_death_signal()
    gc.disable()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)


def _child_write(path: str, directory: KeyDirectory, docs: Mapping[str, Any], wfd: int, parent: int,
                 progress: Optional[Callable[[int], None]]) -> None:
    code = 1
    try:
        enter_forked_child(parent)
        sections, info = directory_sections(directory, docs)
        stats = write_checkpoint(path, sections, info=info, progress=progress)
        os.write(wfd, json.dumps({"bytes": stats.bytes, "info": info}).encode())
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised here
        try:
            os.write(wfd, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def capture(directory: KeyDirectory, path: str | os.PathLike, *,
            extra: Optional[Callable[[], Mapping[str, Any]]] = None, fork: Optional[bool] = None,
            progress: Optional[Callable[[int], None]] = None) -> CaptureResult:
    """Write a consistent checkpoint of ``directory`` (and ``extra()``'s documents, called
    with ingest paused so that, e.g., a log position matches the state) to ``path``.

    ``fork``: None = fork where the OS can. Raises ``OSError`` / ``RuntimeError`` when the
    write failed (the previous checkpoint then stands). Not reentrant: callers serialize.
    """
    path = os.fspath(path)
    use_fork = hasattr(os, "fork") if fork is None else fork
    t0 = time.perf_counter()
    with directory.ingest_lock:
        docs = dict(extra()) if extra is not None else {}
        if use_fork:
            rfd, wfd = os.pipe()
            parent = os.getpid()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child (covered by the service tests)
                os.close(rfd)
                _child_write(path, directory, docs, wfd, parent, progress)
            pause = time.perf_counter() - t0
        else:
            gc_was_on = gc.isenabled()
            gc.disable()
            try:
                sections, info = directory_sections(directory, docs)
                stats: WriteStats = write_checkpoint(path, sections, info=info, progress=progress)
            finally:
                if gc_was_on:
                    gc.enable()
            pause = time.perf_counter() - t0
    if not use_fork:
        return CaptureResult(path, stats.bytes, pause, time.perf_counter() - t0, False, info)
    os.close(wfd)
    chunks = []
    while True:
        got = os.read(rfd, 1 << 16)
        if not got:
            break
        chunks.append(got)
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    try:
        report = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        report = {}
    if "error" in report:
        raise RuntimeError(f"checkpoint writer failed: {report['error']}")
    if status != 0 or "bytes" not in report:
        raise RuntimeError(f"checkpoint writer died (wait status {status})")
    return CaptureResult(path, int(report["bytes"]), pause, time.perf_counter() - t0, True, report["info"])


# ---------------------------------------------------------------------- restore
def _members(doc: dict[str, Any]) -> list[Any]:
    scopes = [KeyScope(model, int(rank), int(group), salt, BlendNamespace(model, salt, int(ws)))
              for model, rank, group, salt, ws in doc["scopes"]]
    places = [Placement(str(i), int(inc), str(t), str(be), int(sz), bool(sh)) for i, inc, t, be, sz, sh in doc["placements"]]
    return [tuple((scopes[s], tuple(places[p] for p in pls)) for s, pls in m) for m in doc["members"]]


def restore_directory(directory: KeyDirectory, ckpt: CheckpointFile) -> RestoreResult:
    """Restore ``ckpt`` into the empty ``directory`` (configured like the server that wrote
    it). Every buffer is verified by its checksum before it is used; on a
    :class:`CheckpointError` the directory may be half-filled: build a fresh one to start
    cold. Raises :class:`IncompatibleCheckpoint` when the parameters differ."""
    t0 = time.perf_counter()
    gc_was_on = gc.isenabled()
    gc.disable()  # a restore allocates ~1 acyclic object per binding: no collection needed meanwhile
    try:
        return _restore(directory, ckpt, t0)
    finally:
        if gc_was_on:
            gc.enable()


def _restore(directory: KeyDirectory, ckpt: CheckpointFile, t0: float) -> RestoreResult:
    meta = ckpt.section("meta").doc
    mine = _meta_doc(directory)
    if meta != mine:
        diff = ", ".join(f"{k} {meta.get(k)!r} (this server: {v!r})" for k, v in mine.items() if meta.get(k) != v)
        raise IncompatibleCheckpoint(f"checkpoint was written with {diff}")
    try:
        gate = ckpt.section("gate").doc
        sec = ckpt.section("directory")
        doc = sec.doc
        # read (and so verify) every buffer before anything changes
        arr = {name: sec.array(name) for name in ("hash_blob", "hash_len", "member_id", "token_ref", "offset",
                                                   "indexed", "private_tokens", "private_len", "l1_pos")}
        hashes = split_hashes(arr["hash_blob"].tobytes(), arr["hash_len"])
        n = len(hashes)
        member_table = _members(doc)
        members = list(map(member_table.__getitem__, arr["member_id"].tolist()))
        index = directory.blend_index
        if index is not None:
            isec = ckpt.section("index")
            index.restore_state(isec.doc, isec.array)
        ref = arr["token_ref"]
        tokens: list[Optional[np.ndarray]] = [None] * n
        rows_at = np.flatnonzero(ref >= 0)
        if rows_at.size:
            if index is None:
                raise CheckpointError("bindings refer to index rows, but the checkpoint has no index")
            for i, view in zip(rows_at.tolist(), index.token_rows(ref[rows_at])):
                tokens[i] = view
        priv_at = np.flatnonzero(ref == -2).tolist()
        if priv_at:
            blob = arr["private_tokens"]
            blob.setflags(write=False)
            ends = np.cumsum(arr["private_len"]).tolist()
            for i, start, end in zip(priv_at, [0] + ends[:-1], ends):
                tokens[i] = blob[start:end]
        l1_pos = arr["l1_pos"].tolist()
        l1_chunks, at = {}, 0
        for inst, count in doc["l1_chunks"]:
            l1_chunks[inst] = [hashes[p] for p in l1_pos[at:at + count]]
            at += count
        access: dict[Any, list] = {}
        if sec.has("access_pos"):  # absent from checkpoints written before access counts
            scopes = [KeyScope(model, int(rank), int(group), salt, BlendNamespace(model, salt, int(ws)))
                      for model, rank, group, salt, ws in doc["scopes"]]
            for p, s, c, last in zip(sec.array("access_pos").tolist(), sec.array("access_scope").tolist(),
                                     sec.array("access_count").tolist(), sec.array("access_last").tolist()):
                access[scopes[s].object_key(hashes[p])] = [int(c), float(last)]
        state = {"hashes": hashes, "members": members, "access": access, "offsets": arr["offset"].tolist(),
                 "indexed": arr["indexed"].astype(bool).tolist(), "tokens": tokens,
                 "l1_chunks": l1_chunks, "l1_keys": doc["l1_keys"], "capacity": doc["capacity"],
                 "counters": doc["counters"], "gate": gate}
        if not (len(members) == len(state["offsets"]) == len(state["indexed"]) == n):
            raise CheckpointError("directory columns disagree in length")
        directory.restore_state(state)
        extra = {name: ckpt.section(name).doc for name in ckpt if name not in CORE_SECTIONS}
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CheckpointError(f"inconsistent checkpoint ({type(exc).__name__}: {exc})") from None
    info = ckpt.info if isinstance(ckpt.info, dict) else {}
    return RestoreResult(ckpt.path, ckpt.size, time.perf_counter() - t0, ckpt.created, info, extra)


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Version, time, counts, section sizes and stream position of ``path``, every checksum
    verified (``blendmatch checkpoint inspect``). Raises like :func:`read_checkpoint`."""
    with read_checkpoint(path) as ckpt:
        ckpt.verify()
        sections = {name: ckpt.section(name).nbytes for name in ckpt}
        stream = ckpt.section("stream_position").doc if ckpt.has("stream_position") else None
        return {"path": ckpt.path, "version": ckpt.version, "created": ckpt.created,
                "created_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ckpt.created)),
                "bytes": ckpt.size, "checksums": "ok", "info": ckpt.info, "sections": sections,
                "stream_position": stream}
