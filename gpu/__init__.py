"""The bottom room: hashing and probing. Arrays in, candidates out.

``gpu`` sees token arrays and slot tables, never namespaces or chunk hashes, and imports
nothing else of the project. It holds THE fingerprint (``fingerprint``), the batch types,
the engine contract (``engine``, with the pipelined ``probe_async``/``probe_many``), the
engines (``reference``, ``cpu``, ``xp_probe``, ``cupy_engine`` with its kernels' source in
``cuda_kernels``) and their selection with the GPU -> CPU failover (``select``). Nothing
here imports ``cupy`` at module level; ``cupy_engine`` imports it inside its functions.

Why the CPU engine and the numpy oracle live in a room named ``gpu``: the room is the
probe-engine room, named for the work it exists to accelerate. Every engine implements one
contract (``engine.Engine``) and must agree with the others bit for bit, so all of them sit
beside that contract: one conformance suite runs against each, and ``select`` can fail over
from the GPU to the CPU engine (and the self-test compare against the oracle) without
importing from a room above. Nothing in this room needs a GPU to import or to run.
"""

from .batch import Candidates, QueryBatch, count_windows
from .engine import (
    ENGINE_NAMES,
    Engine,
    EngineError,
    EngineFailure,
    EngineName,
    EngineUnavailable,
    SlotChanges,
    SlotSource,
)
from .fingerprint import (
    FP_BASE,
    FP_BASE_INV,
    TAG_EMPTY,
    TAG_SHARED,
    chunk_fingerprint,
    chunk_fingerprints,
    prefix_fingerprints,
    rolling_fingerprints,
)
from .select import FailoverEngine, GpuSelfTestError, create_gpu_engine, select_engine, self_test

__all__ = [
    "Candidates",
    "ENGINE_NAMES",
    "Engine",
    "EngineError",
    "EngineFailure",
    "EngineName",
    "EngineUnavailable",
    "FP_BASE",
    "FP_BASE_INV",
    "FailoverEngine",
    "GpuSelfTestError",
    "QueryBatch",
    "SlotChanges",
    "SlotSource",
    "TAG_EMPTY",
    "TAG_SHARED",
    "chunk_fingerprint",
    "chunk_fingerprints",
    "count_windows",
    "create_gpu_engine",
    "prefix_fingerprints",
    "rolling_fingerprints",
    "select_engine",
    "self_test",
]
