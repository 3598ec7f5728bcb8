"""``blendmatch`` (and ``python -m blendmatch``): serve, bench, loadtest, openapi.

``blendmatch serve`` mirrors LMCache's coordinator flags where they overlap (``--host``,
``--port``, ``--chunk-size``, ``--blend-probe-stride``, ``--enable-blend-lookup``) and adds
ours (``--engine``, batching knobs, limits). Blend lookup is *on* by default here (the
service exists for it); ``--enable-blend-lookup`` is accepted for compatibility and
``--disable-blend-lookup`` turns it off. With no subcommand, flags go to ``serve``, so
``python -m blendmatch --port 9300`` works like LMCache's coordinator command line. It needs
no configuration at all: ``blendmatch serve`` on a laptop without a GPU picks the CPU engine
and says so in one start-up line.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import Sequence

from pydantic import ValidationError

__all__ = ["main", "build_parser", "config_from_args"]

_SUBCOMMANDS = ("serve", "bench", "loadtest", "openapi", "checkpoint")


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    from blendmatch.gpu import ENGINE_NAMES

    from .config import ServiceConfig

    d = ServiceConfig.model_fields
    p.add_argument("--host", default=d["host"].default, help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=d["port"].default, help="TCP port (default %(default)s)")
    p.add_argument("--chunk-size", type=int, default=d["chunk_size"].default,
                   help="tokens per KV chunk; must equal the servers' --chunk-size (default %(default)s)")
    p.add_argument("--blend-probe-stride", type=int, default=d["blend_probe_stride"].default,
                   help="query positions between probes; 1 = full recall (default %(default)s)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--enable-blend-lookup", dest="enable_blend_lookup", action="store_true", default=True,
                   help="index chunk content for blend lookups (the default; accepted for LMCache compatibility)")
    g.add_argument("--disable-blend-lookup", dest="enable_blend_lookup", action="store_false",
                   help="do not index content; blend lookups answer no matches")
    p.add_argument("--engine", choices=ENGINE_NAMES, default=d["engine"].default,
                   help="probe engine: auto = GPU if a trial launch succeeds, else CPU (default %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=d["max_batch_tokens"].default,
                   help="token budget of one engine batch; one request's size disables batching (default %(default)s)")
    p.add_argument("--max-batch-wait-ms", type=float, default=d["max_batch_wait_ms"].default,
                   help="wait up to this long for more lookups once one is queued; 0 = batch whatever is "
                        "queued when the engine is free (default %(default)s)")
    p.add_argument("--max-request-tokens", type=int, default=d["max_request_tokens"].default,
                   help="most tokens one request may carry; more -> 413 (default %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body; more -> 413 (default: 16 bytes per --max-request-tokens + 1 MiB)")
    p.add_argument("--engine-threads", type=int, default=None,
                   help="threads of the CPU engine's parallel probe (default: CPUs - 1, at least 1: the event "
                        "loop keeps a core)")
    p.add_argument("--log-level", default=d["log_level"].default,
                   choices=("critical", "error", "warning", "info", "debug"), help="(default %(default)s)")
    p.add_argument("--access-log", action="store_true", help="log every request (costs CPU at high rates)")
    g = p.add_argument_group("durability (docs/operations.md)")
    g.add_argument("--checkpoint-path", default=d["checkpoint_path"].default,
                   help="checkpoint file, restored at start and written periodically and on a clean stop; "
                        "empty = off (LMCache's flag; default off)")
    g.add_argument("--checkpoint-interval", type=float, default=d["checkpoint_interval"].default,
                   help="seconds between checkpoints; 0 = only on a clean stop (default %(default)s)")
    g.add_argument("--require-checkpoint", action="store_true",
                   help="exit non-zero instead of starting cold when the checkpoint is missing, corrupt or "
                        "of an unknown version")
    g.add_argument("--graceful-timeout", type=float, default=d["graceful_timeout"].default,
                   help="seconds a SIGTERM/SIGINT stop may take: drain, final checkpoint (default %(default)s)")
    g.add_argument("--max-ready-lag", type=int, default=d["max_ready_lag"].default,
                   help="with events from a log: /readyz answers 503 while the lag exceeds this many records "
                        "(default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blendmatch", description="Fragment lookups for KV-cache reuse.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,bench,loadtest,openapi,checkpoint}")
    serve = sub.add_parser("serve", help="run the HTTP service", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_flags(serve)
    sub.add_parser("bench", help="core benchmark (blendmatch bench --help)", add_help=False)
    sub.add_parser("loadtest", help="HTTP load test (blendmatch loadtest --help)", add_help=False)
    sub.add_parser("openapi", help="print the OpenAPI schema (JSON)")
    ck = sub.add_parser("checkpoint", help="checkpoint tools (blendmatch checkpoint inspect PATH)")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", metavar="{inspect}", required=True)
    ins = ck_sub.add_parser("inspect", help="print version, time, counts and stream position; verify every checksum")
    ins.add_argument("path")
    return parser


#: ``serve`` parks what event ingestion built in the collector's permanent generation after
#: every 64 MiB of event bodies (~35k stored 256-token entries): see ``ServiceContext``.
GC_FREEZE_INGEST_BYTES = 64 << 20


def config_from_args(args: argparse.Namespace):  # -> ServiceConfig
    """The ``ServiceConfig`` the parsed ``serve`` flags describe (raises ValidationError)."""
    from .config import ServiceConfig

    return ServiceConfig(
        host=args.host, port=args.port, chunk_size=args.chunk_size, blend_probe_stride=args.blend_probe_stride,
        enable_blend_lookup=args.enable_blend_lookup, engine=args.engine, max_batch_tokens=args.max_batch_tokens,
        max_batch_wait_ms=args.max_batch_wait_ms, max_request_tokens=args.max_request_tokens,
        max_body_bytes=args.max_body_bytes, engine_threads=args.engine_threads, log_level=args.log_level,
        gc_freeze_ingest_bytes=GC_FREEZE_INGEST_BYTES, checkpoint_path=args.checkpoint_path,
        checkpoint_interval=args.checkpoint_interval, require_checkpoint=args.require_checkpoint,
        graceful_timeout=args.graceful_timeout, max_ready_lag=args.max_ready_lag,
    )


def _serve(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="blendmatch serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_flags(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(str(x) for x in e['loc']).replace('_', '-')}: {e['msg']}"
                             for e in exc.errors())
        parser.error(problems)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from .app import create_app

    app = create_app(config)
    # A long-running server: park the start-up objects (numba, pydantic, FastAPI; ~150k of
    # them) in the permanent generation so that the collector's full passes stop walking them.
    gc.collect()
    gc.freeze()
    # The lookup thread re-takes the GIL after every nogil engine call; under load the event
    # loop thread rarely blocks, so the default 5 ms switch interval made each batch wait
    # 5 ms several times (batches took ~15 ms instead of ~1 ms). 0.1 ms bounds that wait
    # (measured against 0.5 ms: 10-15% more lookups/s under the load test).
    sys.setswitchinterval(float(os.environ.get("BLENDMATCH_SWITCH_INTERVAL_S", "0.0001")))
    # Half of --graceful-timeout for in-flight requests; the rest is for the events thread
    # and the final checkpoint (the watchdog in _GracefulServer bounds the whole stop).
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               access_log=args.access_log, proxy_headers=False,
                               timeout_graceful_shutdown=max(1, int(config.graceful_timeout / 2)))
    server = _graceful_server_class(uvicorn.Server)(uv_config, config.graceful_timeout)
    context = app.state.blendmatch_context
    context.on_fatal = server.fail
    server.run()
    if context.fatal is not None or server.exit_code:
        return server.exit_code or 1
    return 0


def _graceful_server_class(base: type) -> type:
    """uvicorn's Server with the stop this service promises (docs/operations.md):

    - the first SIGTERM/SIGINT starts a graceful stop: stop accepting connections, let
      in-flight requests finish, apply admitted event batches, write the final checkpoint,
      exit 0; a watchdog exits 1 when that takes longer than ``--graceful-timeout``;
    - a second signal exits at once (``os._exit``): a checkpoint being written dies with
      the process (its writer is a child that gets ``SIGKILL`` with its parent), so the
      previous checkpoint stands.

    uvicorn's own handler re-raises the signal after shutdown (exit status 143/130); this
    one does not, so a clean stop exits 0.
    """

    class _GracefulServer(base):  # type: ignore[misc, valid-type]
        def __init__(self, config, graceful_timeout: float) -> None:
            super().__init__(config)
            self.graceful_timeout = graceful_timeout
            self.exit_code = 0
            self._signals = 0

        def handle_exit(self, sig, frame) -> None:  # noqa: ANN001 - uvicorn's signature
            import signal as _signal
            import threading

            self._signals += 1
            if self._signals > 1:
                logging.getLogger("blendmatch.service").warning("second signal (%s): exiting now", sig)
                os._exit(128 + int(sig))
            logging.getLogger("blendmatch.service").info(
                "signal %s: graceful stop (at most %g s; a second signal exits at once)", _signal.Signals(sig).name,
                self.graceful_timeout)
            timer = threading.Timer(self.graceful_timeout, self._too_slow)
            timer.daemon = True
            timer.start()
            self.should_exit = True

        def _too_slow(self) -> None:
            logging.getLogger("blendmatch.service").error("graceful stop took longer than --graceful-timeout %g s; "
                                                          "exiting now", self.graceful_timeout)
            os._exit(1)

        def fail(self, exc: BaseException) -> None:
            """The service cannot go on (``ServiceContext.on_fatal``): stop, exit 1."""
            self.exit_code = 1
            self.should_exit = True

    return _GracefulServer


def _checkpoint_inspect(path: str) -> int:
    """``blendmatch checkpoint inspect PATH``: JSON on stdout; exit 1 (reason on stderr) when
    the file is missing or unusable."""
    import json

    from blendmatch.index.checkpoint import inspect_checkpoint
    from blendmatch.index.ckpt_file import CheckpointError

    try:
        report = inspect_checkpoint(path)
    except (OSError, CheckpointError) as exc:
        print(f"blendmatch checkpoint inspect: {path}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blendmatch`` console script and ``python -m blendmatch``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        return _serve(argv)  # LMCache style: flags only
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return _serve(rest)
    if command == "bench":
        from blendmatch.bench import engine as engine_bench  # bench is imported by nothing else

        return int(engine_bench.main(rest) or 0)
    if command == "loadtest":
        from blendmatch.bench import loadtest

        return int(loadtest.main(rest) or 0)
    if command == "checkpoint":
        args = build_parser().parse_args(argv)
        return _checkpoint_inspect(args.path)
    if command == "openapi":
        from .openapi import main as openapi_main

        return int(openapi_main(rest) or 0)
    build_parser().parse_args(argv)  # prints help, or the usage error for an unknown command
    return 0
