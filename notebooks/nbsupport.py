"""What the profiling notebooks share (not part of the ``blendmatch`` package).

- :func:`machine_lines` names the machine a notebook ran on (CPU, cores, memory, GPU,
  library versions); every notebook prints it in a cell of its own.
- :class:`ServerThread` serves a ``blendmatch`` app in-process: uvicorn in a background
  thread on a free loopback port, configured the way ``blendmatch serve`` configures itself.
- :func:`histogram_buckets` reads one Prometheus histogram from a ``GET /metrics`` body.
- :func:`save_figure` writes a notebook's main figure as a PNG (for ``docs/figures/``);
  :func:`plain_log_ticks` labels a log axis 1, 2, 5, 10, ... instead of powers of ten.

Only public names of ``blendmatch`` are imported here, and only where they are used.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ServerThread", "cpu_model", "gpu_names", "histogram_buckets", "machine_lines", "plain_log_ticks",
           "save_figure"]


# ---------------------------------------------------------------------------- the machine
def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def gpu_names() -> list[str]:
    """Names of the NVIDIA GPUs ``nvidia-smi`` lists (empty when there is none or no driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine_lines(engines: list[str] | None = None, gpu_used: bool | None = None) -> list[str]:
    """Lines that name this machine; ``engines``: the engines the notebook measured;
    ``gpu_used``: whether it used a GPU (None: not known yet, said later)."""
    import numba
    import numpy

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    mem = _memory_gib()
    gpus = gpu_names()
    lines = [
        f"run at      {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"CPU         {cpu_model()}, {os.cpu_count()} logical CPUs ({usable} usable by this process)",
        f"memory      {mem:.1f} GiB" if mem is not None else "memory      unknown",
        "load        " + ("average {:.2f} / {:.2f} / {:.2f} (1 / 5 / 15 min) when this cell ran".format(*os.getloadavg())
                          if hasattr(os, "getloadavg") else "unknown"),
        f"OS          {platform.platform()}",
        f"software    Python {platform.python_version()}, numpy {numpy.__version__}, numba {numba.__version__}",
    ]
    if gpus:
        used = "" if gpu_used is None else " (used)" if gpu_used else " (present, not used)"
        lines.append(f"GPU         {'; '.join(gpus)}{used}")
    else:
        lines.append("GPU         none visible (no nvidia-smi or no device)")
    if engines is not None:
        lines.append(f"engines     {', '.join(engines) if engines else 'none'}")
    return lines


# ---------------------------------------------------------------------------- the service
#: ``blendmatch serve`` sets the GIL switch interval to 0.1 ms (see ``service/cli.py``): the
#: lookup thread re-takes the GIL after every engine call, and 5 ms waits per hand-over would
#: dominate each batch. An in-process server gets the same setting while it runs.
SERVE_SWITCH_INTERVAL_S = 0.0001
#: ``blendmatch serve`` freezes the collector's generations after every 64 MiB of event bodies.
SERVE_GC_FREEZE_INGEST_BYTES = 64 << 20


class ServerThread:
    """``create_app(config)`` served by uvicorn on a free ``127.0.0.1`` port, in a thread.

    ``with ServerThread(config) as url: ...`` starts it (lifespan included: the engine is
    chosen and warmed up before the first request) and stops it gracefully on exit.

    The listening socket is created with ``IPPROTO_TCP`` on purpose: asyncio sets
    ``TCP_NODELAY`` on accepted connections only when the listening socket's protocol is
    ``IPPROTO_TCP``, and a plain ``socket.socket()`` reports protocol 0. Without
    ``TCP_NODELAY``, uvicorn's two writes per response meet the client's delayed ACK and every
    keep-alive request takes about 40 ms (measured: 44 ms per lookup instead of 0.7 ms).
    """

    def __init__(self, config: Any) -> None:
        import uvicorn

        from blendmatch.service import create_app

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                    access_log=False, timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"blendmatch-server-{self.port}")
        self._switch = sys.getswitchinterval()

    def __enter__(self) -> str:
        gc.collect()
        gc.freeze()  # as ``blendmatch serve`` does with its start-up objects
        sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.__exit__()
                raise RuntimeError("the in-process server did not start (see the log above)")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        sys.setswitchinterval(self._switch)
        gc.unfreeze()


def histogram_buckets(metrics_text: str, name: str) -> dict[float, float]:
    """``{upper bound: cumulative count}`` of the histogram ``name`` in a Prometheus text body
    (``+Inf`` included). Raises ``KeyError`` naming the histogram when it is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        if family.name == name and family.type == "histogram":
            return {float(s.labels["le"]): float(s.value) for s in family.samples
                    if s.name == f"{name}_bucket"}
    raise KeyError(f"histogram {name!r} not in the metrics")


# ---------------------------------------------------------------------------- figures
def save_figure(fig: Any, directory: str | os.PathLike, name: str) -> Path:
    """Write ``fig`` as ``directory/name`` (PNG, 120 dpi); returns the path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plain_log_ticks(axis: Any) -> None:
    """Ticks at 1, 2, 5 x 10^k on a log-scaled ``axis`` (``ax.yaxis``), labelled as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=30))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.6g}"))
    axis.set_minor_formatter(NullFormatter())
