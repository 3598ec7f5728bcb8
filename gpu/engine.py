"""The engine contract and engine selection.

Question answered: "which windows of this batch could be in the index?" An engine hashes
every valid window of a :class:`~blendmatch.gpu.batch.QueryBatch` with THE fingerprint
(``blendmatch.index.fingerprint``, the one module of ``index/`` that ``gpu/`` may import: a
leaf of constants and pure array functions) and probes a slot array. It sees arrays, never
namespaces or chunk hashes; the index verifies the survivors.

Contract (every engine, bit for bit; one conformance suite checks it):
- ``probe(batch, slots)`` returns :class:`Candidates` for exactly the valid windows whose
  slot value is ``tag(F)`` or 255, ascending ``(query_index, cur_st)``.
- ``slots`` is a :class:`SlotSource` (``blendmatch.index.slots.SlotArray`` implements it).
  A host engine reads ``slots.table``; a device engine mirrors it through
  ``slots.changes_since``. ``probe`` may run concurrently with writers of ``slots``.
- Bad input raises ``ValueError`` identically on every engine; a device failure at run time
  raises :class:`EngineFailure` (the index then fails over to the CPU engine).

Engines are chosen by :func:`select_engine`: ``"reference"`` (numpy oracle), ``"cpu"``
(numba), ``"gpu"`` (CuPy; fails loudly with the reason when unusable) or ``"auto"`` (the GPU
only after a real trial launch succeeds, else the CPU engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from .batch import Candidates, QueryBatch

__all__ = [
    "Engine",
    "EngineName",
    "EngineError",
    "EngineUnavailable",
    "EngineFailure",
    "SlotSource",
    "SlotChanges",
    "SlotChangesLike",
    "select_engine",
    "ENGINE_NAMES",
]

log = logging.getLogger(__name__)

EngineName = Literal["auto", "gpu", "cpu", "reference"]
ENGINE_NAMES: tuple[str, ...] = ("auto", "gpu", "cpu", "reference")


class EngineError(RuntimeError):
    """Base of engine errors (not raised for bad input: that is ``ValueError``)."""


class EngineUnavailable(EngineError):
    """The engine cannot be used on this machine; the message says why."""


class EngineFailure(EngineError):
    """The engine failed at run time (device lost, out of memory); the batch is retryable."""


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


#: Older name of :class:`SlotChanges`, kept for the engines' annotations.
SlotChangesLike = SlotChanges


@runtime_checkable
class SlotSource(Protocol):
    """What an engine may read of the slot array (implemented by ``index.slots.SlotArray``)."""

    table: np.ndarray  # uint8, power-of-two length; live host array (read only)
    generation: int
    version: int

    @property
    def mask(self) -> int: ...

    def changes_since(self, generation: int, version: int) -> SlotChangesLike: ...


@runtime_checkable
class Engine(Protocol):
    """A probe engine. ``name`` is one of ``"gpu" | "cpu" | "reference"``; ``reason`` says why it
    was chosen (logged at start-up)."""

    name: str
    reason: str

    def probe(self, batch: QueryBatch, slots: SlotSource) -> Candidates: ...

    def close(self) -> None: ...


def select_engine(name: str = "auto") -> Engine:
    """Build the engine ``name`` names; see the module docstring for ``"auto"``.

    Raises ``ValueError`` for an unknown name and :class:`EngineUnavailable` (with the reason)
    when ``"gpu"`` is asked for and no usable GPU answers a trial launch.
    """
    if name not in ENGINE_NAMES:
        raise ValueError(f"engine must be one of {', '.join(ENGINE_NAMES)}, got {name!r}")
    if name == "reference":
        from .reference import ReferenceEngine

        return ReferenceEngine(reason="asked for by name")
    if name == "cpu":
        from .cpu import CpuEngine

        return CpuEngine(reason="asked for by name")
    from .cupy_engine import create_gpu_engine  # no cupy import happens at module level there

    if name == "gpu":
        return create_gpu_engine(reason="asked for by name")
    try:
        return create_gpu_engine(reason="auto: a trial launch on the GPU succeeded")
    except EngineUnavailable as exc:
        from .cpu import CpuEngine

        log.info("GPU engine unavailable (%s); using the CPU engine", exc)
        return CpuEngine(reason=f"auto: no usable GPU ({exc})")
