"""Durable state for the service: restore at start, periodic and on-demand checkpoints,
the final checkpoint of a graceful stop, and readiness.

Question answered: "after a restart, does this server answer exactly as before, and does it
say when it is ready?" The file format and what goes in it are ``index/ckpt_file.py`` and
``index/checkpoint.py``; this module decides *when*.

LMCache 0.5.6's flags, same names and defaults: ``--checkpoint-path`` (empty: off) and
``--checkpoint-interval`` (60 s; 0: only on a clean stop). Ours: ``--require-checkpoint``
(a missing, corrupt or unknown-version file is fatal instead of a cold start) and
``--max-ready-lag`` (readiness while events come from a log).

- **Compiling** (``warmup.py``): ``blendmatch serve`` opens its port, then compiles (or
  loads from the compile cache) every kernel it runs; ``/readyz`` answers 503
  ``compiling`` until that is done, and lookups and event posts answer 503 with
  ``Retry-After`` (never a first request that waits tens of seconds for a compilation).
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
- **The path is checked and locked before anything is read** (:meth:`Durability.prepare`,
  called by ``blendmatch serve`` before the port opens and again by the lifespan): a
  path naming a directory, or whose directory does not exist, is a start error; so is a
  file that does not begin with the checkpoint magic (this server did not write it, so it
  is never renamed, moved or overwritten). ``<path>.lock`` is then locked exclusively
  (``flock``) for the process's life: a second server on the same path refuses to start
  and names the holder's pid. The lock file stays (removing it would race a starting
  server); the lock goes with the process, even after ``SIGKILL``. Only a file that
  begins with the magic and then fails to read (truncated, checksum, unknown version) is
  set aside as ``<path>.corrupt-<unix time>``.
- **Checkpoints** (periodic thread, ``POST /admin/checkpoint``, the graceful stop) are
  serialized by one lock; each pauses ingest only while the process forks
  (``index/checkpoint.py``). Extra sections (the instance registry, a log position) are
  registered with :meth:`Durability.register_section`: ``snapshot()`` is called with
  ingest paused and must return a JSON-able document; ``restore(doc)`` is called after the
  directory was restored, before the server reports ready.
- **A failing disk** (full, read-only, gone): every failed checkpoint is logged at ERROR and
  counted (``blendmatch_checkpoints_total{outcome="failed"}``);
  ``blendmatch_checkpoint_failing`` is 1 and ``blendmatch_checkpoint_consecutive_failures``
  counts while the latest attempt failed, and ``/readyz`` names the failure in a
  ``warnings`` list while staying 200: the replica still answers every lookup correctly,
  and taking every replica of a fleet whose shared volume filled up out of rotation would
  turn lost durability into an outage. Alert on the gauge. A stop whose final checkpoint
  failed logs an ERROR saying what is lost and exits non-zero (``final_error``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from prometheus_client import Counter, Gauge

from blendmatch.index.checkpoint import CaptureResult, IncompatibleCheckpoint, RestoreResult, capture, restore_directory
from blendmatch.index.ckpt_file import MAGIC, CheckpointError, read_checkpoint, remove_stale_temporaries
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
    """One per service, for its one directory (a failed restore clears it in place)."""

    def __init__(self, path: str, interval_s: float, *, require: bool, max_ready_lag: int,
                 directory: KeyDirectory, registry: Any, lag: Optional[Callable[[], Optional[int]]] = None,
                 log_reasons: Optional[Callable[[], list[str]]] = None,
                 log_warnings: Optional[Callable[[], list[str]]] = None) -> None:
        self.path = path
        self.interval_s = interval_s
        self.require = require
        self.max_ready_lag = max_ready_lag
        self._directory = directory
        self._sections: dict[str, SectionHooks] = {}
        #: Records the log is ahead of what was applied, or None when events do not come
        #: from a log (HTTP push): the log transport's ``lag``.
        self.lag = lag
        #: The log transport's own reasons not to be ready (a log reset, a cold start's
        #: catch-up) and its warnings (an unreachable broker).
        self.log_reasons = log_reasons
        self.log_warnings = log_warnings
        self._lock = threading.Lock()  # one checkpoint at a time
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.restored = not path  # nothing to restore: ready at once
        #: True while the start-up compiles the kernels (``warmup.py``; set by the service).
        self.compiling = False
        self.restore_result: Optional[RestoreResult] = None
        self.last: Optional[CaptureResult] = None
        self.last_at: Optional[float] = None
        self.last_error: Optional[str] = None
        #: Failed attempts since the last checkpoint written, and when the first of them failed.
        self.consecutive_failures = 0
        self.failing_since: Optional[float] = None
        #: Why the final checkpoint of the stop failed (None: it did not fail, or none was due).
        self.final_error: Optional[str] = None
        self._lock_fd: Optional[int] = None
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
        self.m_failing = Gauge("blendmatch_checkpoint_failing",
                               "1 while the latest checkpoint attempt failed (the previous file stands)", registry=r)
        self.m_consecutive = Gauge("blendmatch_checkpoint_consecutive_failures",
                                   "checkpoint attempts failed in a row since the last one written", registry=r)

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def register_section(self, name: str, snapshot: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        """Add a JSON section (``registry``, ``stream_position``, ...); see the module docstring."""
        if name in ("meta", "gate", "directory", "index"):
            raise ValueError(f"section name {name!r} is reserved")
        self._sections[name] = SectionHooks(snapshot, restore)

    # ------------------------------------------------------------------ path and lock
    @property
    def lock_path(self) -> str:
        return f"{self.path}.lock"

    def prepare(self) -> None:
        """Check the path and take ``<path>.lock`` (module docstring); idempotent. Raises
        :class:`CheckpointRequired` with the reason when the server must not start."""
        if not self.path or self._lock_fd is not None:
            return
        path = self.path
        if os.path.isdir(path):
            raise CheckpointRequired(f"--checkpoint-path {path} is a directory; name a file in it (for example "
                                     f"{os.path.join(path, 'blendmatch.ckpt')}); nothing was moved")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise CheckpointRequired(f"--checkpoint-path {path}: {parent} is not a directory (create it first)")
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CheckpointRequired(f"--checkpoint-path {path}: cannot open the lock file {self.lock_path}: "
                                     f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointRequired(f"--checkpoint-path {path} is in use by another blendmatch server (pid "
                                         f"{holder} holds {self.lock_path}); give each server its own path") from None
            raise CheckpointRequired(f"--checkpoint-path {path}: cannot lock {self.lock_path}: "
                                     f"{exc.strerror or exc}") from None
        try:
            self._check_ours(path)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    @staticmethod
    def _check_ours(path: str) -> None:
        """A file at ``path`` that does not begin with the checkpoint magic was not written
        by a blendmatch server: never set it aside or overwrite it."""
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC))
        except FileNotFoundError:
            return
        except OSError as exc:  # unreadable: the restore reports it (and sets the file aside)
            log.debug("cannot read the head of %s: %s", path, exc)
            return
        if head != MAGIC:
            what = "empty" if not head else "not a blendmatch checkpoint (no checkpoint magic)"
            raise CheckpointRequired(f"--checkpoint-path {path} names a file that is {what}; this server did not "
                                     "write it, so it will not move or overwrite it: move it away or name another "
                                     "path")

    def release(self) -> None:
        """Drop ``<path>.lock`` (the stop's last step; the file stays)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    # ------------------------------------------------------------------ restore
    def restore_at_start(self) -> None:
        """Restore the checkpoint into the (empty) directory, or start cold; see the module
        docstring. Raises :class:`CheckpointRequired` when the server must not start."""
        if not self.path:
            self.restored = True
            return
        self.prepare()
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
        except OSError as exc:  # nothing says whose file it is: never moved (start error)
            self.m_restore_fail.labels("unreadable").inc()
            raise CheckpointRequired(f"checkpoint {path} cannot be read: {exc.strerror or exc}; fix its permissions "
                                     "or storage, or move it away") from None
        directory = self._directory
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
                result = capture(self._directory, self.path,
                                 extra=lambda: {name: snap() for name, snap in extra.items()})
            except Exception as exc:
                self.m_written.labels("failed").inc()
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.consecutive_failures += 1
                if self.failing_since is None:
                    self.failing_since = time.time()
                self.m_failing.set(1)
                self.m_consecutive.set(self.consecutive_failures)
                log.error("checkpoint (%s) to %s failed (%d in a row): %s; the previous one stands", why, self.path,
                          self.consecutive_failures, exc)
                raise
            self.last, self.last_at, self.last_error = result, time.time(), None
            self.consecutive_failures, self.failing_since = 0, None
            self.m_failing.set(0)
            self.m_consecutive.set(0)
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
        """``(ready, reasons not ready)``: compiled, restored, and the log lag within bounds."""
        reasons = []
        if self.compiling:
            reasons.append("compiling")
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
        if self.log_reasons is not None:
            reasons.extend(self.log_reasons())
        return not reasons, reasons

    def warnings(self) -> list[str]:
        """What ``/readyz`` reports without going not-ready: failing checkpoints, an
        unreachable event-log broker."""
        out = self.log_warnings() if self.log_warnings is not None else []
        if not self.consecutive_failures:
            return out
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.failing_since or time.time()))
        last_ok = ("none written by this process" if self.last_at is None else
                   time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.last_at)))
        return out + [f"checkpoint failing: {self.consecutive_failures} attempts in a row since {since} "
                      f"({self.last_error}); last written: {last_ok}; a restart now loses what was applied since"]

    def status(self) -> dict[str, Any]:
        last = self.last
        return {"path": self.path or None, "interval_s": self.interval_s, "restored": self.restored,
                "restore": None if self.restore_result is None else
                {"seconds": self.restore_result.seconds, "bytes": self.restore_result.bytes,
                 "created": self.restore_result.created, "info": self.restore_result.info},
                "last": None if last is None else {"time": self.last_at, "bytes": last.bytes,
                                                   "seconds": last.total_s, "pause_s": last.pause_s,
                                                   "info": last.info},
                "last_error": self.last_error, "consecutive_failures": self.consecutive_failures}
