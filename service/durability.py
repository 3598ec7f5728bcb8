"""Durable state for the service: restore at start, periodic and on-demand checkpoints,
the final checkpoint of a graceful stop, and readiness.

Question answered: "after a restart, does this server answer exactly as before, and does it
say when it is ready?" The file format and what goes in it are ``index/ckpt_file.py`` and
``index/checkpoint.py``; this module decides *when*.

LMCache 0.5.6's flags, same names and defaults: ``--checkpoint-path`` (empty: off) and
``--checkpoint-interval`` (60 s; 0: only on a clean stop). Ours: ``--require-checkpoint``
(a missing, corrupt or unknown-version file is fatal instead of a cold start) and
``--max-ready-lag`` (readiness while events come from a log).

- **Restore** runs on the events thread as its first task, after the port opened: ``/healthz``
  answers at once (a liveness probe never kills a restoring server), ``/readyz`` answers 503
  ``restoring checkpoint`` until it is done, and event requests that arrive meanwhile queue
  behind it and then pass the restored gate (a replay is a duplicate). A missing file is a
  cold start (logged at info). A corrupt, truncated or unknown-version file is renamed to
  ``<path>.corrupt-<unix time>``, logged at error with the reason, counted
  (``blendmatch_checkpoint_restore_failures{reason}``), and the server starts cold, as
  LMCache does; with ``--require-checkpoint`` the server exits non-zero instead. A file
  from a server with another chunk size, stride or filter is never set aside: the server
  refuses to start (an operator error, not corruption).
- **Checkpoints** (periodic thread, ``POST /admin/checkpoint``, the graceful stop) are
  serialized by one lock; each pauses ingest only while the process forks
  (``index/checkpoint.py``). Extra sections (the instance registry, a log position) are
  registered with :meth:`Durability.register_section`: ``snapshot()`` is called with
  ingest paused and must return a JSON-able document; ``restore(doc)`` is called after the
  directory was restored, before the server reports ready.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from prometheus_client import Counter, Gauge

from blendmatch.index.checkpoint import CaptureResult, IncompatibleCheckpoint, RestoreResult, capture, restore_directory
from blendmatch.index.ckpt_file import CheckpointError, read_checkpoint, remove_stale_temporaries
from blendmatch.index.key_directory import KeyDirectory

__all__ = ["CheckpointRequired", "Durability", "SectionHooks"]

log = logging.getLogger("blendmatch.service.durability")


class CheckpointRequired(RuntimeError):
    """``--require-checkpoint`` and no usable checkpoint (or an incompatible one): the
    server must not start."""


@dataclass
class SectionHooks:
    snapshot: Callable[[], Any]
    restore: Callable[[Any], None]


class Durability:
    """One per service. ``directory()`` returns the directory now in use."""

    def __init__(self, path: str, interval_s: float, *, require: bool, max_ready_lag: int,
                 directory: Callable[[], KeyDirectory], registry: Any) -> None:
        self.path = path
        self.interval_s = interval_s
        self.require = require
        self.max_ready_lag = max_ready_lag
        self._directory = directory
        self._sections: dict[str, SectionHooks] = {}
        #: Records the log is ahead of what was applied, or None when events do not come
        #: from a log (HTTP push). The log transport sets it (issue 10).
        self.lag: Optional[Callable[[], Optional[int]]] = None
        self._lock = threading.Lock()  # one checkpoint at a time
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.restored = not path  # nothing to restore: ready at once
        self.restore_result: Optional[RestoreResult] = None
        self.last: Optional[CaptureResult] = None
        self.last_at: Optional[float] = None
        self.last_error: Optional[str] = None
        r = registry
        self.m_last_time = Gauge("blendmatch_checkpoint_last_time_seconds",
                                 "unix time of the last checkpoint written", registry=r)
        self.m_duration = Gauge("blendmatch_checkpoint_duration_seconds",
                                "wall time of the last checkpoint, pause to rename", registry=r)
        self.m_bytes = Gauge("blendmatch_checkpoint_bytes", "size of the last checkpoint file", registry=r)
        self.m_pause = Gauge("blendmatch_checkpoint_ingest_pause_seconds",
                             "ingest pause of the last checkpoint (directory lock held)", registry=r)
        self.m_written = Counter("blendmatch_checkpoints", "checkpoints attempted", ["outcome"], registry=r)
        self.m_restore = Gauge("blendmatch_checkpoint_restore_seconds",
                               "time the start-up restore took (0: cold start)", registry=r)
        self.m_restore_fail = Counter("blendmatch_checkpoint_restore_failures",
                                      "checkpoints that could not be restored", ["reason"], registry=r)

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def register_section(self, name: str, snapshot: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        """Add a JSON section (``registry``, ``stream_position``, ...); see the module docstring."""
        if name in ("meta", "gate", "directory", "index"):
            raise ValueError(f"section name {name!r} is reserved")
        self._sections[name] = SectionHooks(snapshot, restore)

    # ------------------------------------------------------------------ restore
    def restore_at_start(self) -> None:
        """Restore the checkpoint into the (empty) directory, or start cold; see the module
        docstring. Raises :class:`CheckpointRequired` when the server must not start."""
        if not self.path:
            self.restored = True
            return
        self._restore()
        remove_stale_temporaries(self.path)
        self.restored = True

    def _restore(self) -> None:
        path = self.path
        try:
            ckpt = read_checkpoint(path)
        except FileNotFoundError:
            if self.require:
                raise CheckpointRequired(f"--require-checkpoint: no checkpoint at {path}") from None
            log.info("no checkpoint at %s: cold start", path)
            self.m_restore.set(0)
            return
        except CheckpointError as exc:
            self._set_aside(exc)
            return
        except OSError as exc:
            self._set_aside(CheckpointError(f"cannot read: {exc}"))
            return
        directory = self._directory()
        try:
            with ckpt:
                result = restore_directory(directory, ckpt)
        except IncompatibleCheckpoint as exc:
            self.m_restore_fail.labels(exc.reason).inc()
            raise CheckpointRequired(f"checkpoint {path} cannot be restored here: {exc} "
                                     "(start with the same settings, or move the file away)") from None
        except CheckpointError as exc:
            directory.clear()
            self._set_aside(exc)
            return
        for name, hooks in self._sections.items():
            if name in result.extra:
                hooks.restore(result.extra[name])
        self.restore_result = result
        self.m_restore.set(result.seconds)
        log.info("restored checkpoint %s (written %s): %s in %.2f s, %d bytes", path,
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(result.created)), result.info,
                 result.seconds, result.bytes)

    def _set_aside(self, exc: CheckpointError) -> None:
        reason = exc.reason
        self.m_restore_fail.labels(reason).inc()
        aside = f"{self.path}.corrupt-{int(time.time())}"
        try:
            os.replace(self.path, aside)
        except OSError as move_exc:
            aside = f"(could not rename: {move_exc})"
        if self.require:
            raise CheckpointRequired(f"--require-checkpoint: checkpoint {self.path} is unusable ({reason}: {exc}); "
                                     f"set aside as {aside}")
        log.error("checkpoint %s is unusable (%s: %s); set aside as %s; cold start", self.path, reason, exc, aside)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_now(self, why: str = "on demand") -> CaptureResult:
        """Write a checkpoint now (blocking; serialized with every other checkpoint).
        Raises ``RuntimeError`` when disabled or not restored yet, ``OSError`` /
        ``RuntimeError`` when the write failed (the previous checkpoint stands)."""
        if not self.path:
            raise RuntimeError("checkpoints are off (--checkpoint-path is empty)")
        if not self.restored:
            raise RuntimeError("the start-up restore has not finished")
        with self._lock:
            extra = {name: hooks.snapshot for name, hooks in self._sections.items()}
            try:
                result = capture(self._directory(), self.path,
                                 extra=lambda: {name: snap() for name, snap in extra.items()})
            except Exception as exc:
                self.m_written.labels("failed").inc()
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("checkpoint (%s) to %s failed: %s; the previous one stands", why, self.path, exc)
                raise
            self.last, self.last_at, self.last_error = result, time.time(), None
            self.m_written.labels("written").inc()
            self.m_last_time.set(self.last_at)
            self.m_duration.set(result.total_s)
            self.m_bytes.set(result.bytes)
            self.m_pause.set(result.pause_s)
            log.info("checkpoint (%s): %d bytes in %.2f s, ingest paused %.1f ms (%s)", why, result.bytes,
                     result.total_s, result.pause_s * 1e3, result.info)
            return result

    def start_periodic(self) -> None:
        if not self.path or self.interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="blendmatch-checkpoint", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.restored:
                continue
            try:
                self.checkpoint_now("periodic")
            except Exception:  # noqa: BLE001 - logged and counted; the next one may succeed
                pass

    def stop_periodic(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------------ readiness
    def readiness(self) -> tuple[bool, list[str]]:
        """``(ready, reasons not ready)``: restored, and the log lag within bounds."""
        reasons = []
        if not self.restored:
            reasons.append("restoring checkpoint")
        lag_fn = self.lag
        if lag_fn is not None:
            try:
                lag = lag_fn()
            except Exception as exc:  # noqa: BLE001 - not ready, and say why
                reasons.append(f"event log lag unknown ({type(exc).__name__})")
            else:
                if lag is None:
                    reasons.append("event log lag unknown")
                elif lag > self.max_ready_lag:
                    reasons.append(f"event log lag {lag} > --max-ready-lag {self.max_ready_lag}")
        return not reasons, reasons

    def status(self) -> dict[str, Any]:
        last = self.last
        return {"path": self.path or None, "interval_s": self.interval_s, "restored": self.restored,
                "restore": None if self.restore_result is None else
                {"seconds": self.restore_result.seconds, "bytes": self.restore_result.bytes,
                 "created": self.restore_result.created, "info": self.restore_result.info},
                "last": None if last is None else {"time": self.last_at, "bytes": last.bytes,
                                                   "seconds": last.total_s, "pause_s": last.pause_s,
                                                   "info": last.info},
                "last_error": self.last_error}
