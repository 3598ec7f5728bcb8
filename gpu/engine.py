"""The engine contract: the protocol every probe engine implements, and its errors.

Question answered: "which windows of this batch could be in the index?" An engine hashes
every valid window of a :class:`~blendmatch.gpu.batch.QueryBatch` with THE fingerprint
(``gpu/fingerprint.py``) and probes a slot array. It sees arrays, never
namespaces or chunk hashes; the index verifies the survivors.

Contract (every engine, bit for bit; one conformance suite checks it):
- ``probe(batch, slots)`` returns :class:`Candidates` for exactly the valid windows whose
  slot value is ``tag(F)`` or 255, ascending ``(query_index, cur_st)``.
- ``slots`` is a :class:`SlotSource` (``blendmatch.index.slots.SlotArray`` implements it).
  A host engine reads ``slots.filter_arrays`` (the table and its occupancy bits, one
  generation); a device engine mirrors ``slots.table`` through ``slots.changes_since``. ``probe`` may run concurrently with writers of ``slots``.
- Bad input raises ``ValueError`` identically on every engine; a device failure at run time
  raises :class:`EngineFailure` (``select.FailoverEngine`` then moves to the CPU engine).
- Pipelining (optional; :func:`probe_async` and :func:`probe_many` work on every engine):
  ``engine.probe_async(batch, slots)`` submits a batch and returns a :class:`ProbeHandle`
  whose ``result()`` is, bit for bit, what ``probe`` returns. A device engine returns before
  the device finishes, so the caller can prepare and submit the next batch meanwhile; an
  engine without a device pipeline answers at submit (:class:`ReadyProbe`). ``ValueError``
  comes from the submit; :class:`EngineFailure` from the submit or from ``result()``.
  ``engine.pipelined`` says whether submitting early overlaps anything (callers that gain
  nothing from it, such as the service on a CPU engine, keep the plain ``probe`` path).

This module defines the contract only; engines are built by ``gpu/select.py``. It imports no
engine, so engines can import it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Literal, Protocol, runtime_checkable

import numpy as np

from .batch import Candidates, QueryBatch

__all__ = [
    "Engine",
    "EngineName",
    "EngineError",
    "EngineUnavailable",
    "EngineFailure",
    "EngineOutOfMemory",
    "EngineBroken",
    "SlotSource",
    "SlotChanges",
    "ENGINE_NAMES",
    "ProbeHandle",
    "ReadyProbe",
    "is_pipelined",
    "probe_async",
    "probe_many",
]

EngineName = Literal["auto", "gpu", "cpu", "reference"]
ENGINE_NAMES: tuple[str, ...] = ("auto", "gpu", "cpu", "reference")


class EngineError(RuntimeError):
    """Base of engine errors (not raised for bad input: that is ``ValueError``)."""


class EngineUnavailable(EngineError):
    """The engine cannot be used on this machine; the message says why."""


class EngineBroken(EngineUnavailable):
    """The engine's device or library is there but the engine does not work on it (CuPy
    installed but failing to import, a kernel that does not compile, a trial launch that
    fails or answers wrong). Unlike plain :class:`EngineUnavailable` (no CuPy, no device),
    this is logged at WARNING: it is a defect or a broken install, not a CPU-only machine."""


class EngineFailure(EngineError):
    """The engine failed at run time (device lost, a CUDA error); the batch is retryable."""


class EngineOutOfMemory(EngineFailure):
    """Device memory ran out even after freeing the engine's cached memory and splitting the
    batch into the smallest passes: memory pressure, not a broken device.

    ``select.FailoverEngine`` answers *this* batch on the CPU engine and keeps the device
    engine for the next one (a broken device, any other :class:`EngineFailure`, moves the
    process to the CPU engine for good)."""


@dataclass(frozen=True)
class SlotChanges:
    """What an engine needs to bring its slot mirror to ``(generation, version)``.

    ``full`` -> upload ``table`` whole; otherwise apply ``slots``/``values`` in order (later
    writes to the same slot win). ``table`` is the live host array: read, never write.
    Defined here, beside the protocol, so that ``index.slots`` and the engines' own test
    sources build the same type.
    """

    generation: int
    version: int
    full: bool
    table: np.ndarray
    slots: np.ndarray
    values: np.ndarray


@runtime_checkable
class SlotSource(Protocol):
    """What an engine may read of the slot array (implemented by ``index.slots.SlotArray``)."""

    table: np.ndarray  # uint8, power-of-two length; live host array (read only)
    #: ``(table, occupancy words)`` of one generation (``gpu/occupancy.py``), replaced as one
    #: tuple on a rebuild so a reader never pairs a table with another table's bits.
    filter_arrays: tuple[np.ndarray, np.ndarray]
    generation: int
    version: int

    @property
    def mask(self) -> int: ...

    def changes_since(self, generation: int, version: int) -> SlotChanges: ...


@runtime_checkable
class Engine(Protocol):
    """A probe engine. ``name`` is one of ``"gpu" | "cpu" | "reference"``; ``reason`` says why it
    was chosen (logged at start-up)."""

    name: str
    reason: str

    def probe(self, batch: QueryBatch, slots: SlotSource) -> Candidates: ...

    def close(self) -> None: ...


@runtime_checkable
class ProbeHandle(Protocol):
    """A batch submitted with ``probe_async``: ``result()`` waits for and returns its
    candidates (the same object on every call)."""

    def result(self) -> Candidates: ...


@dataclass(frozen=True)
class ReadyProbe:
    """A handle answered at submit (engines without a device pipeline)."""

    candidates: Candidates

    def result(self) -> Candidates:
        return self.candidates


def probe_async(engine: Any, batch: QueryBatch, slots: SlotSource) -> ProbeHandle:
    """``engine.probe_async(batch, slots)``, or the batch answered now by ``engine.probe``
    for an engine without one (any :class:`Engine` works)."""
    submit = getattr(engine, "probe_async", None)
    if submit is None:
        return ReadyProbe(engine.probe(batch, slots))
    return submit(batch, slots)


def is_pipelined(engine: Any) -> bool:
    """Whether ``engine``'s ``probe_async`` overlaps batches (a device pipeline)."""
    return bool(getattr(engine, "pipelined", False))


def probe_many(engine: Any, batches: Iterable[QueryBatch], slots: SlotSource, depth: int = 2) -> Iterator[Candidates]:
    """Candidates of each batch, in order, with up to ``depth`` batches submitted ahead: batch
    N+1 is submitted (its upload starts) before batch N's candidates are waited for."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    pending: list[ProbeHandle] = []
    for batch in batches:
        pending.append(probe_async(engine, batch, slots))
        if len(pending) > depth:
            yield pending.pop(0).result()
    for handle in pending:
        yield handle.result()
