"""Choosing an engine, proving it before use, and the one documented GPU -> CPU failover.

Question answered: "which engine answers this process's probes, and what happens when it
breaks?"

- :func:`select_engine` builds an engine by name: ``"reference"`` (numpy oracle), ``"cpu"``
  (numba), ``"gpu"`` (CuPy; raises :class:`EngineUnavailable` with the reason when unusable)
  or ``"auto"`` (the GPU only after a real trial launch passes the self-test, else the CPU
  engine, saying why in its ``reason``).
- :func:`create_gpu_engine` builds the CuPy engine and runs :func:`self_test` on it: a GPU
  that answers differently from the numpy engine is refused (:class:`GpuSelfTestError`).
- :class:`FailoverEngine` wraps the engine a ``BlendIndex`` uses. When the active engine
  raises :class:`EngineFailure` (a device failure at run time: a lost device, a CUDA error)
  it logs the error, counts it, closes the broken engine and answers the same batch, and
  every later one, on a fresh CPU engine; every batch in flight on the broken engine at
  that moment is answered by the CPU engine too. :class:`EngineOutOfMemory` (memory
  pressure that the engine's own retries could not relieve) is not a broken device: that
  batch is answered on the CPU and the device engine stays. It decides by error type only:
  ``ValueError`` (bad input) and any other exception (a bug) propagate unchanged, and a
  failure of the CPU engine it moved to is not retried.
- Logging: a machine without a GPU (no CuPy, no device) is logged at INFO; a GPU whose
  engine is broken (:class:`EngineBroken`: CuPy fails to import, a kernel does not compile,
  a trial launch fails or answers wrong) at WARNING, with the error.

Import rule: engine modules never import this one; it imports them lazily (the CuPy engine
only when a GPU is asked for), so no engine module depends on another through selection.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from . import fingerprint as _fp
from .batch import Candidates, QueryBatch
from .engine import (
    ENGINE_NAMES,
    Engine,
    EngineBroken,
    EngineFailure,
    EngineOutOfMemory,
    EngineUnavailable,
    ProbeHandle,
    SlotSource,
    is_pipelined,
    probe_async,
)
from .xp_probe import TrialSlots, XpEngine

if TYPE_CHECKING:
    from .cupy_engine import CupyEngine

__all__ = [
    "FailoverEngine",
    "GpuSelfTestError",
    "create_gpu_engine",
    "select_engine",
    "self_test",
]

log = logging.getLogger(__name__)


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
    if name == "gpu":
        return create_gpu_engine(reason="asked for by name")
    try:
        return create_gpu_engine(reason="auto: a trial launch on the GPU succeeded")
    except EngineUnavailable as exc:
        from .cpu import CpuEngine

        if isinstance(exc, EngineBroken):
            log.warning("the GPU engine is broken on this machine (%s); using the CPU engine", exc)
        else:
            log.info("no usable GPU (%s); using the CPU engine", exc)
        return CpuEngine(reason=f"auto: no usable GPU ({exc})")


class GpuSelfTestError(EngineBroken):
    """The GPU engine ran but did not reproduce the numpy engine's answers: never use it."""


# --------------------------------------------------------------------------------------
# the self-test (also run on CPU engines in CI)
# --------------------------------------------------------------------------------------
#: Tokens of the self-test's large case: with the trial geometry of the GPU engine
#: (``CupyEngine.trial_geometry``: 2 blocks of 256 threads, 4 KiB staging pieces, 16k-token
#: passes) it takes many grid-stride iterations, a multi-piece upload, buffer growth over the
#: small cases' and a split into passes, one of them through a query longer than a pass.
SELF_TEST_LARGE_TOKENS = 50_000


def _self_test_cases() -> tuple[list[np.ndarray], int, TrialSlots]:
    """Fixed queries (edge lengths, repeated content, one long query) and a slot source with
    survivors."""
    rng = np.random.default_rng(20240611)
    c = 16
    lengths = (0, 5, 16, 17, 333, 1024, 40)
    queries = [rng.integers(0, 50, size=n, dtype=np.uint32) for n in lengths]
    queries[6][:] = queries[4][100:140]  # the same content in two queries
    table = np.zeros(4096, dtype=np.uint8)
    src = queries[4]
    pf, pi = _fp.power_tables(src.size + 1)
    h = _fp.prefix_fingerprints(src, c, np, pf, pi)
    slot, tag = _fp.slots_and_tags(h[::3], table.size - 1)
    table[slot] = tag  # collisions: some tags overwritten -> those windows must not survive
    table[rng.integers(0, table.size, size=64)] = _fp.TAG_SHARED
    table[rng.integers(0, table.size, size=64)] = rng.integers(1, 255, size=64, dtype=np.uint8)
    return queries, c, TrialSlots(table)


def self_test(engine: Any, oracle: Any = None) -> int:
    """Probe fixed batches on ``engine`` and ``oracle`` (default: a numpy ``XpEngine``); raise
    :class:`GpuSelfTestError` on any difference. Exercises strides below, at and above the
    window, a change-log patch (with repeated slots) and a rebuild between batches.

    Returns the number of candidates compared (always > 0: the cases plant survivors).
    """
    oracle = oracle or XpEngine(np, reason="self-test oracle")
    queries, c, slots = _self_test_cases()
    rng = np.random.default_rng(7)
    compared = 0

    def check(label: str, stride: int) -> None:
        nonlocal compared
        batch = QueryBatch.from_queries(queries, c, stride)
        want = oracle.probe(batch, slots)
        got = engine.probe(batch, slots)
        if not want.same_as(got) or want.windows != got.windows:
            raise GpuSelfTestError(
                f"self-test '{label}' (stride {stride}): {engine.name} returned {len(got)} candidates "
                f"over {got.windows} windows, the numpy engine {len(want)} over {want.windows}; "
                "refusing to use an engine that changes answers")
        compared += len(want)

    for stride in (1, 3, c, c + 1):
        check("initial upload", stride)
    big = _large_case(c)
    for stride in (1, 5):
        want = oracle.probe(QueryBatch.from_queries(big, c, stride), slots)
        got = engine.probe(QueryBatch.from_queries(big, c, stride), slots)
        if not want.same_as(got) or want.windows != got.windows:
            raise GpuSelfTestError(
                f"self-test 'large batch' (stride {stride}): {engine.name} returned {len(got)} candidates "
                f"over {got.windows} windows, the numpy engine {len(want)} over {want.windows}; "
                "refusing to use an engine that changes answers")
        compared += len(want)
    s = rng.integers(0, slots.table.size, size=200)
    s[100:] = s[:100]  # every slot written twice: the last write must win
    slots.write(s, rng.integers(0, 256, size=200, dtype=np.uint8))
    check("change-log patch", 1)
    table = slots.table.copy()
    table[rng.integers(0, table.size, size=300)] = _fp.TAG_SHARED
    slots.replace(np.concatenate([table, table]))  # a rebuild that also resizes
    check("rebuild", 2)
    if compared == 0:
        raise GpuSelfTestError("self-test compared no candidates (broken test cases)")
    return compared


def _large_case(c: int) -> list[np.ndarray]:
    """Queries of :data:`SELF_TEST_LARGE_TOKENS` tokens in all, one longer than the trial's
    pass, built from the small cases' content so that the planted slots survive."""
    queries, _, _ = _self_test_cases()
    src = queries[4]
    rng = np.random.default_rng(99)
    reps = SELF_TEST_LARGE_TOKENS // 2 // src.size + 1
    long_q = np.tile(src, reps)[: SELF_TEST_LARGE_TOKENS // 2]
    rest = SELF_TEST_LARGE_TOKENS - long_q.size
    noise = rng.integers(0, 50, size=rest // 2, dtype=np.uint32)
    return [long_q, noise, np.tile(src, rest // 2 // src.size + 1)[: rest - noise.size]]


def create_gpu_engine(reason: str = "", *, kernels: str | None = None, device: int | None = None) -> "CupyEngine":
    """Build the GPU engine only after a real trial launch reproduces the numpy engine.

    Raises :class:`EngineUnavailable` with the reason when CuPy is missing, no device answers,
    compilation or the trial fails (:class:`GpuSelfTestError` when it ran but answered
    differently). ``kernels`` defaults to ``$BLENDMATCH_GPU_KERNELS`` or ``"fused"``;
    an unknown value is a ``ValueError``.
    """
    from .cupy_engine import KERNEL_MODES, KERNELS_ENV

    kernels = kernels or os.environ.get(KERNELS_ENV) or "fused"
    if kernels not in KERNEL_MODES:
        raise ValueError(f"GPU kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
    from .cupy_engine import CupyEngine, gpu_unavailable  # no cupy import at module level there

    why = gpu_unavailable()
    if why is not None:
        raise why
    engine = None
    try:
        engine = CupyEngine(reason=reason, kernels=kernels, device=device)
        with engine.trial_geometry():  # small batches through the large-batch paths
            self_test(engine)
    except EngineUnavailable as exc:
        if isinstance(exc, GpuSelfTestError):  # a wrong answer is worse than no GPU: say so loudly
            log.error("GPU engine refused: %s", exc)
        if engine is not None:
            engine.close()
        raise
    except Exception as exc:  # noqa: BLE001 - compile errors, device errors, EngineFailure
        if engine is not None:
            engine.close()
        raise EngineBroken(f"a device answered but the GPU engine failed its trial "
                           f"({type(exc).__name__}: {exc})") from exc
    engine.reset_after_trial()  # the trial used its own slot source
    log.info("GPU engine ready on %s (kernels=%s): %s", engine.device_name, kernels, reason)
    return engine


class FailoverEngine:
    """The engine a ``BlendIndex`` probes through: the chosen engine, or the CPU engine after
    the chosen one failed at run time (see the module docstring).

    ``name`` and ``reason`` are the active engine's (``reason`` says ``failover from gpu:
    ...`` after a failover); ``failovers`` counts them (at most one per wrapped engine: the
    CPU engine it moves to is never replaced); ``memory_fallbacks`` counts batches answered on
    the CPU because of :class:`EngineOutOfMemory`. Thread-safe: concurrent probes that fail
    together fail over once, and each of them is answered by the CPU engine.
    """

    def __init__(self, engine: Engine) -> None:
        self._active: Engine = engine
        self._fallback: Engine | None = None  # the CPU engine moved to, once failed over
        self._spare: Engine | None = None  # a CPU engine for batches the device has no memory for
        self._lock = threading.Lock()
        self.failovers = 0
        self.memory_fallbacks = 0

    @property
    def active(self) -> Engine:
        """The engine that answers now."""
        return self._active

    @property
    def name(self) -> str:
        return self._active.name

    @property
    def reason(self) -> str:
        return self._active.reason

    def probe(self, batch: QueryBatch, slots: SlotSource) -> Candidates:
        engine = self._active
        try:
            return engine.probe(batch, slots)
        except EngineOutOfMemory as exc:
            if engine is self._fallback:
                raise
            return self._probe_spare(engine, exc, batch, slots)
        except EngineFailure as exc:
            if engine is self._fallback:  # the CPU engine moved to failed: not retried
                raise
            self._fail_over(engine, exc)  # idempotent: a batch in flight on the old engine lands here too
        return self._active.probe(batch, slots)

    @property
    def pipelined(self) -> bool:
        """Whether the active engine overlaps batches (``gpu/engine.py``, pipelining)."""
        return is_pipelined(self._active)

    def lend_tokens(self, num_queries: int, num_tokens: int) -> np.ndarray | None:
        """The active engine's pinned staging area for the next batch's tokens, or None."""
        lend = getattr(self._active, "lend_tokens", None)
        return None if lend is None else lend(num_queries, num_tokens)

    def probe_async(self, batch: QueryBatch, slots: SlotSource) -> "_FailoverProbe":
        """:meth:`probe`, pipelined: the failover rules apply to the submit and to
        ``result()`` alike, so a batch in flight when the device fails is answered on the CPU."""
        engine = self._active
        try:
            return _FailoverProbe(self, engine, batch, slots, probe_async(engine, batch, slots))
        except EngineOutOfMemory as exc:
            if engine is self._fallback:
                raise
            return _FailoverProbe(self, engine, batch, slots, None, self._probe_spare(engine, exc, batch, slots))
        except EngineFailure as exc:
            if engine is self._fallback:
                raise
            self._fail_over(engine, exc)
        return _FailoverProbe(self, self._active, batch, slots, None, self._active.probe(batch, slots))

    def _settle(self, probe: "_FailoverProbe") -> Candidates:
        """``probe``'s candidates, with the failover rules of :meth:`probe`."""
        engine = probe.engine
        try:
            return probe.handle.result()
        except EngineOutOfMemory as exc:
            if engine is self._fallback:
                raise
            return self._probe_spare(engine, exc, probe.batch, probe.slots)
        except EngineFailure as exc:
            if engine is self._fallback:
                raise
            self._fail_over(engine, exc)
        return self._active.probe(probe.batch, probe.slots)

    def _probe_spare(self, engine: Engine, exc: EngineOutOfMemory, batch: QueryBatch,
                     slots: SlotSource) -> Candidates:
        from .cpu import CpuEngine

        with self._lock:
            self.memory_fallbacks += 1
            if self._spare is None:
                self._spare = self._fallback or CpuEngine(reason=f"memory fallback for {engine.name}")
            spare = self._spare
        log.warning("engine %s ran out of memory (%s); this batch runs on the CPU engine, the %s engine stays",
                    engine.name, exc, engine.name)
        return spare.probe(batch, slots)

    def _fail_over(self, engine: Engine, exc: EngineFailure) -> None:
        from .cpu import CpuEngine

        with self._lock:
            if self._active is not engine:  # another thread already moved on
                return
            self.failovers += 1
            log.error("engine %s failed (%s: %s); continuing on the CPU engine",
                      engine.name, type(exc).__name__, exc)
            self._fallback = CpuEngine(reason=f"failover from {engine.name}: {type(exc).__name__}: {exc}")
            self._active = self._fallback
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the device is already broken; closing is best effort
            log.debug("closing the failed engine raised", exc_info=True)

    def stats(self) -> dict[str, Any]:
        stats = getattr(self._active, "stats", None)
        out = dict(stats()) if callable(stats) else {}
        if self.memory_fallbacks:
            out["memory_fallbacks"] = self.memory_fallbacks
        return out

    def close(self) -> None:
        self._active.close()
        if self._spare is not None and self._spare is not self._active:
            self._spare.close()


class _FailoverProbe:
    """A batch submitted through :meth:`FailoverEngine.probe_async`."""

    def __init__(self, owner: FailoverEngine, engine: Engine, batch: QueryBatch, slots: SlotSource,
                 handle: ProbeHandle | None, ready: Candidates | None = None) -> None:
        self.owner, self.engine, self.batch, self.slots, self.handle = owner, engine, batch, slots, handle
        self._result = ready

    def result(self) -> Candidates:
        if self._result is None:
            self._result = self.owner._settle(self)
            self.handle = None
        return self._result
