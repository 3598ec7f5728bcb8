"""LMCache 0.5.6's real coordinator app (its ``create_app``, unmodified) served by uvicorn, as its
``lmcache coordinator`` command serves it, for ``blendmatch loadtest --vs-lmcache SITE``.

Run as ``python bench/lmcache_serve.py SITE PORT CHUNK_SIZE`` (a subprocess: the torch
stand-ins must not leak into the load generator). ``SITE`` is the unpacked wheel (the
directory holding ``lmcache/``; the test suite unpacks it into
``.pytest_cache/lmcache-0.5.6``). The stand-ins replace only what LMCache imports but never
runs on the coordinator's paths: ``torch`` (annotations and defaults at import time) and two
modules that pull in its libtorch-linked extension (:func:`install_stand_ins`, which
``tests/lmcache_driver.py`` uses too). Blend lookup is on, health and eviction checks off
(nothing to check in a bench).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _AnyMeta(name, (_Any,), {})
        setattr(cls, name, sub)
        return sub


class _Any(metaclass=_AnyMeta):
    """Any attribute, any call, falsy: enough for annotations, aliases and defaults."""

    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()

    def __call__(self, *a, **k):
        return _Any()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _AnyMeta(name, (_Any,), {})
        setattr(self, name, value)
        return value


class _TorchFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch" or fullname.startswith("torch."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        if spec.name == "torch":
            mod.__version__ = "0.0.0+stand-in"
            mod.Size = type("Size", (tuple,), {})
            mod.dtype = type("dtype", (), {})
        return mod

    def exec_module(self, module):
        return None


def install_stand_ins(site: str) -> None:
    sys.path.insert(0, site)
    sys.meta_path.insert(0, _TorchFinder())
    for name, attr in (("lmcache.v1.memory_management", "MemoryObj"),
                       ("lmcache.v1.mp_observability.config", "ObservabilityConfig")):
        mod = types.ModuleType(name)
        setattr(mod, attr, type(attr, (), {}))
        sys.modules[name] = mod


def main(site: str, port: int, chunk_size: int) -> None:
    install_stand_ins(site)
    logging.disable(logging.INFO)  # LMCache logs every registration at INFO
    import uvicorn

    from lmcache.v1.mp_coordinator.app import create_app
    from lmcache.v1.mp_coordinator.config import MPCoordinatorConfig

    config = MPCoordinatorConfig(host="127.0.0.1", port=port, chunk_size=chunk_size, enable_blend_lookup=True,
                                 health_check_interval=0.0, eviction_check_interval=0.0)
    uvicorn.run(create_app(config), host="127.0.0.1", port=port, log_level="warning",
                timeout_keep_alive=config.timeout_keep_alive)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
