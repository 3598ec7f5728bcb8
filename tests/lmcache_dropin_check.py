"""LMCache 0.5.6's own BlendCoordinatorClient and ours, side by side against the real app.

Run in a subprocess by ``test_client_dropin.py`` when ``BLENDMATCH_LMCACHE_WHEEL`` names an
unzipped lmcache wheel (the directory holding ``lmcache/``). It loads LMCache's client module
the way an MP server has it loaded (its package ``__init__`` files, which need torch and a
compiled extension, are bypassed; ``torch`` is stubbed: that module uses it for annotations
only), then checks that our ``PENDING`` is LMCache's object and that both clients, given
LMCache's ``BlendNamespace``, answer identically through LMCache's poll rule
(``poll is PENDING``). Prints ``OK`` on success.
"""

from __future__ import annotations

import os
import sys
import time
import types

import numpy as np

wheel = os.path.join(os.environ["BLENDMATCH_LMCACHE_WHEEL"], "lmcache")
sys.modules["torch"] = types.SimpleNamespace(Size=tuple, dtype=type)  # type: ignore[assignment]
for name, path in (("lmcache", wheel), ("lmcache.v1", os.path.join(wheel, "v1"))):
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package

from lmcache.v1.mp_coordinator.api import BlendNamespace as LMCacheNamespace  # noqa: E402
from lmcache.v1.mp_coordinator.blend_client import PENDING as LMCACHE_PENDING  # noqa: E402
from lmcache.v1.mp_coordinator.blend_client import BlendCoordinatorClient as LMCacheClient  # noqa: E402

from blendmatch.service.app import create_app  # noqa: E402
from blendmatch.service.client import PENDING, BlendClient, BlendCoordinatorClient  # noqa: E402
from client_support import LoopbackApp  # noqa: E402
from service_support import C, MODEL, chunks, config, store  # noqa: E402

assert PENDING is LMCACHE_PENDING, "our PENDING is not LMCache's inside an LMCache process"
rows = chunks(20, seed=3)
rng = np.random.default_rng(4)
queries = [np.concatenate([rows[i] for i in rng.integers(0, 20, size=4)]).tolist() for _ in range(30)]


def answers(client_class: type, url: str) -> list:
    client = client_class.maybe_create(url, timeout=5.0, match_concurrency=4)
    namespace = LMCacheNamespace(model_name=MODEL, cache_salt="", world_size=1)
    for i, q in enumerate(queries):
        client.submit_match(f"r{i}", q, namespace)
    out = []
    for i in range(len(queries)):
        deadline = time.monotonic() + client.match_budget_s
        while (poll := client.poll_match(f"r{i}")) is LMCACHE_PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        client.take_match(f"r{i}")
        assert isinstance(poll, list), poll
        out.append([(m.chunk_hash, m.old_st, m.cur_st) for m in poll])
    client.close()
    return out


with LoopbackApp(create_app(config())) as url, BlendClient(url) as setup:
    setup.post_events([store("i1", 1, rows)])
    theirs, ours = answers(LMCacheClient, url), answers(BlendCoordinatorClient, url)
assert theirs == ours, (theirs, ours)
assert sum(map(len, ours)) >= len(queries) * 3, "the queries should find their chunks"
print("OK", C)
