"""``blendmatch serve --workers N``: N replica processes on one port, fed by one Kafka topic.

Why: one server process is bound by its own GIL. At 4,500 lookups/s the event loop and the
lookup thread together hold the GIL about two thirds of the time and wait on each other for
the rest, while the second core has room (docs/performance.md, "Front end"). Several
processes share nothing but the log: each is a full replica (``--event-transport kafka``,
docs/fleet.md), so each answers every lookup from its own index, exactly as replicas
behind a Kubernetes Service do, only on one host and one port.

Shape:
- the parent validates the flags (the same parser and config as one process), then starts
  N children: ``blendmatch serve`` with the same flags plus ``--replica-id <id>-w<i>``,
  ``--checkpoint-path <path>.w<i>`` when checkpoints are on, ``--engine-threads`` (CPUs
  split between the workers, unless given), ``--reuse-port`` and
  ``--refuse-lookups-until-ready``;
- each child binds its own listening socket with ``SO_REUSEPORT``; the kernel spreads new
  connections over them (Linux allows this only between sockets of the same user, so no
  other user's process can join the port);
- children run in their own process group (a terminal's Ctrl-C reaches the parent, which
  forwards it once) and get SIGTERM if the parent dies, even by SIGKILL;
- the parent forwards SIGTERM, SIGINT and SIGHUP (access-file reload) to every child. When
  one child exits, the parent stops the others and exits with the first non-zero status
  (0 if all stopped cleanly): a supervisor above (systemd, Kubernetes) restarts the whole,
  which is simpler to reason about than a partly running set.

The kernel spreads connections without asking ``/readyz``, so a worker still restoring or
catching up with the log answers lookups 503 (``--refuse-lookups-until-ready``) instead
of from a partial index; once it has been ready it answers as any replica does.

Each worker answers ``/readyz``, ``/metrics`` and ``/directory/stats`` for itself (a scrape
through the shared port reaches one of them; ``replica_id`` in the stats says which).
With ``--worker-ports-from P`` worker ``i`` also serves alone on port ``P + i``: scrape
and probe those.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Sequence

log = logging.getLogger("blendmatch.service.workers")

__all__ = ["worker_argv", "supervise"]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """``prctl(PR_SET_PDEATHSIG, SIGTERM)`` where the C library has it (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_argv(argv: Sequence[str], index: int, *, replica_id: str, checkpoint_path: str | None,
                engine_threads: int | None, workers: int, own_ports_from: int = 0) -> list[str]:
    """The ``serve`` flags of worker ``index``: the parent's, then this worker's own. argparse
    keeps the last value of a repeated flag, so what is appended wins however the parent's
    flags were spelled (abbreviated, ``--flag=value``)."""
    out = [*argv, "--workers", "1", "--worker-ports-from", "0",
           "--replica-id", f"{replica_id}-w{index}", "--reuse-port", "--refuse-lookups-until-ready"]
    if checkpoint_path:
        out += ["--checkpoint-path", f"{checkpoint_path}.w{index}"]
    if engine_threads is None:
        out += ["--engine-threads", str(max(1, (os.cpu_count() or 1) // workers))]
    if own_ports_from:
        out += ["--own-port", str(own_ports_from + index)]
    return out


def supervise(argv: Sequence[str], workers: int, *, replica_id: str, checkpoint_path: str | None,
              engine_threads: int | None, own_ports_from: int = 0) -> int:
    """Run ``workers`` children until one exits; returns the exit status (see module doc)."""
    procs: list[subprocess.Popen] = []
    stopping = {"signal": 0}

    def forward(signum: int, _frame: object) -> None:
        if signum != getattr(signal, "SIGHUP", None):
            stopping["signal"] = signum
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    handled = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {s: signal.signal(s, forward) for s in handled}
    try:
        for i in range(workers):
            child = [sys.executable, "-m", "blendmatch", "serve",
                     *worker_argv(argv, i, replica_id=replica_id, checkpoint_path=checkpoint_path,
                                  engine_threads=engine_threads, workers=workers, own_ports_from=own_ports_from)]
            # Own process group: a terminal's Ctrl-C reaches the parent only, which forwards
            # it once (two SIGINTs would make a child skip its graceful stop). SIGTERM to
            # the child if the parent dies, even by SIGKILL: no orphaned workers on the port.
            procs.append(subprocess.Popen(child, process_group=0, preexec_fn=_die_with_parent))
        log.info("started %d workers (replicas %s-w0..w%d), pids %s", workers, replica_id, workers - 1,
                 [p.pid for p in procs])
        first = None
        while first is None:
            for p in procs:
                if p.poll() is not None:
                    first = p
                    break
            else:
                time.sleep(0.2)
        on_its_own = not stopping["signal"]  # read before forward() below records its own SIGTERM
        if on_its_own:
            log.error("worker pid %d exited with status %s: stopping the others", first.pid, first.returncode)
            forward(signal.SIGTERM, None)
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, h in previous.items():
            signal.signal(s, h)
    # The worker that stopped on its own decides the status (the others were stopped by us,
    # and one still starting dies of our SIGTERM with 143, which says nothing); after a
    # forwarded signal, the first non-zero status in start order. A child killed by a
    # signal counts as 128+sig.
    if on_its_own and first.returncode != 0:
        codes = [first.returncode]
    return next((c if c > 0 else 128 - c for c in codes if c != 0), 0)
