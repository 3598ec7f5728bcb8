"""A line in the log when a Kafka replica dies without stopping, naming its topic.

Question answered: "a replica vanished with exit status 139 and nothing in its log: what
happened?" librdkafka (2.5.0 to at least 2.16.x, confluent-kafka's wheels) can crash the
process with SIGSEGV in its own threads (``rd_kafka_metadata_update_op``: measured when the
topic is deleted under a consuming replica on tansu; upstream issue
confluentinc/librdkafka#5280 for the same function on Apache Kafka). Those threads block
every signal, so the kernel ends the process at once: no handler runs, ``faulthandler``
included, and nothing in the process can write a last line.

So a small watcher process does: :func:`start_watch` starts ``python -c`` with a pipe from
this process on its stdin. A clean stop writes ``stopped`` and closes it (:meth:`Watch.stop`);
when the pipe closes without that word, this process died abruptly (a native crash, SIGKILL,
the OOM killer) and the watcher writes one CRITICAL line to the same stderr, naming the
replica, its pid, the topic and the broker, then exits. The exit status stays the signal's
(non-zero), so an orchestrator restarts the replica, which resumes from its checkpoint (and
finds the topic missing or recreated: ``kafka.py``). Cost: one idle Python process per
replica (about 10 MB), blocked on a read.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Optional

__all__ = ["Watch", "start_watch"]

log = logging.getLogger("blendmatch.service.kafka")

#: The watcher's whole program (no import of this package: it must start in milliseconds and
#: outlive a broken interpreter). argv: pid, replica id, topic, bootstrap servers.
_WATCHER = r"""
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)  # a terminal's Ctrl-C or the group's TERM: wait for the pipe instead
got = b""
while True:
    chunk = os.read(0, 64)
    if not chunk:
        break
    got += chunk
if b"stopped" not in got:
    pid, replica, topic, bootstrap = sys.argv[1:5]
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + ",%03d" % (now % 1 * 1000)
    os.write(2, ("%s CRITICAL blendmatch.service.kafka: replica %s (pid %s) died without stopping while following "
                 "topic %s on %s: a native crash (librdkafka, e.g. the topic deleted under it: docs/fleet.md), "
                 "SIGKILL or the OOM killer; its exit status is non-zero, restart it (it resumes from its checkpoint)\n"
                 % (stamp, replica, pid, topic, bootstrap)).encode())
"""


class Watch:
    """The watcher of one source; :meth:`stop` before a clean exit."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def stop(self) -> None:
        """Tell the watcher this is a clean stop, and let it go. Idempotent."""
        stdin = self.proc.stdin
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(b"stopped\n")
            stdin.close()
        except OSError:  # the watcher is gone already: nothing to tell
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_watch(pid: int, replica_id: str, topic: str, bootstrap: str) -> Optional[Watch]:
    """Start the watcher of process ``pid`` (this one); None, logged, when it cannot start
    (the replica runs without it: a crash is then silent, as before)."""
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, str(pid), replica_id, topic, bootstrap],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=None, close_fds=True,
                                start_new_session=True)
    except OSError as exc:
        log.warning("the crash watcher did not start (%s): a native crash of this replica would leave no line in "
                    "its log", exc)
        return None
    return Watch(proc)
