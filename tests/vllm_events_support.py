"""vLLM's own KV-event classes for the tests: ``vllm/distributed/kv_events.py`` out of a
real vLLM wheel, imported with stand-ins only for what it imports from the rest of vLLM.

The wheel is fetched once with ``pip download --no-deps`` into a cache directory outside
the repository (``$BLENDMATCH_VLLM_DIR``, else ``<tmp>/blendmatch-vllm-cache``); only the
one file is kept. Two releases: 0.33.0 writes tagged **maps** (and answers replays with the
topic frame), 0.20.0 tagged **arrays** (replays without it). Tests skip, with the reason,
only when the wheel cannot be fetched.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import pytest

#: encoding -> the vLLM release whose classes decode it
RELEASES = {"map": "0.33.0", "array": "0.20.0"}
_loaded: dict[str, types.ModuleType] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("BLENDMATCH_VLLM_DIR") or Path(tempfile.gettempdir()) / "blendmatch-vllm-cache")


def kv_events_file(version: str) -> Path:
    """``vllm/distributed/kv_events.py`` of vllm==version (fetched once)."""
    target = cache_dir() / version / "kv_events.py"
    if target.exists():
        return target
    download = cache_dir() / version / "wheel"
    download.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
           "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_35_x86_64", "--dest", str(download), f"vllm=={version}"]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wheels = sorted(download.glob(f"vllm-{version}-*.whl"))
    if got.returncode != 0 or not wheels:
        pytest.skip(f"vllm=={version} wheel could not be fetched: {(got.stderr or got.stdout)[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        data = wheel.read("vllm/distributed/kv_events.py")
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
    for w in wheels:  # hundreds of MB; only the one file is needed
        w.unlink()
    return target


def _stand_ins() -> dict[str, types.ModuleType]:
    """What kv_events.py imports from the rest of vLLM, and nothing more."""
    mods: dict[str, types.ModuleType] = {}

    def mod(name: str, **attrs) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        mods[name] = m

    class KVEventsConfig:  # only constructed by the publisher, which the tests do not run
        def __init__(self, **kw) -> None:
            self.__dict__.update(kw)

    for pkg in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        mod(pkg, __path__=[])
    mod("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    mod("vllm.logger", init_logger=logging.getLogger)
    mod("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1", get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip, split_zmq_path=lambda path: tuple(path.rsplit(":", 2)))
    mod("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return mods


def vllm_kv_events(encoding: str) -> types.ModuleType:
    """vLLM's kv_events module of the release that writes ``encoding``."""
    version = RELEASES[encoding]
    if version in _loaded:
        return _loaded[version]
    path = kv_events_file(version)
    stand_ins = _stand_ins()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        name = f"vllm_kv_events_{version.replace('.', '_')}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    _loaded[version] = module
    return module


def decode_batch(encoding: str, payload: bytes):
    """Decode one payload with vLLM's ``KVEventBatch``, strict (raises on anything else)."""
    import msgspec

    return msgspec.msgpack.decode(payload, type=vllm_kv_events(encoding).KVEventBatch, strict=True)
