"""Lazy public names for a package (PEP 562): the one helper both rooms' ``__init__`` use.

Why: ``import blendmatch.index.tokens`` (what the client needs) must not import the blend
index (numba), nor ``import blendmatch.service.client`` the app (FastAPI). A package lists
``{name: submodule}`` and each name is imported on first use, then cached in the package.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``name`` lives in
    ``package.<exports[name]>``; ``namespace`` is the package's ``globals()`` (cache)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
