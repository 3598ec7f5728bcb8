"""The probe engines: given a query batch and a slot array, return candidate windows.

``gpu`` sees arrays, never namespaces; it imports ``blendmatch.index.fingerprint`` (THE
hash, a leaf module) and nothing else of ``index``. Nothing here imports ``cupy`` at module
level except inside ``cupy_engine``'s functions.
"""

from .batch import Candidates, QueryBatch, count_windows
from .engine import (
    ENGINE_NAMES,
    Engine,
    EngineError,
    EngineFailure,
    EngineName,
    EngineUnavailable,
    SlotSource,
    select_engine,
)

__all__ = [
    "Candidates",
    "ENGINE_NAMES",
    "Engine",
    "EngineError",
    "EngineFailure",
    "EngineName",
    "EngineUnavailable",
    "QueryBatch",
    "SlotSource",
    "count_windows",
    "select_engine",
]
