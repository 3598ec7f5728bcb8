"""``blendmatch`` (and ``python -m blendmatch``): serve, bench, loadtest, openapi.

``blendmatch serve`` accepts every LMCache 0.5.6 coordinator flag: those that overlap mean
the same (``--host``, ``--port``, ``--chunk-size``, ``--blend-probe-stride``,
``--enable-blend-lookup``, ``--health-check-interval``, ``--instance-timeout``,
``--timeout-keep-alive``); those with no meaning here are accepted with a one-line warning
(``LMCACHE_IGNORED_FLAGS``), so an existing launch command works unchanged. It adds
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

_SUBCOMMANDS = ("serve", "bench", "loadtest", "openapi")


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
    p.add_argument("--health-check-interval", type=float, default=d["health_check_interval"].default,
                   help="seconds between sweeps that expire silent instances; 0 disables (default %(default)s)")
    p.add_argument("--instance-timeout", type=float, default=d["instance_timeout"].default,
                   help="seconds without a heartbeat after which an instance expires and its L1 placements "
                        "are fenced (default %(default)s)")
    p.add_argument("--timeout-keep-alive", type=float, default=d["timeout_keep_alive"].default,
                   help="seconds idle HTTP connections stay open; keep it above the servers' heartbeat "
                        "interval (LMCache: 5 s) (default %(default)s)")


#: LMCache 0.5.6 coordinator flags that mean nothing here: accepted (so that an existing
#: launch command works unchanged) and answered with one warning line each at start-up.
#: ``(flag, argparse kwargs, why it is ignored)``.
LMCACHE_IGNORED_FLAGS: tuple[tuple[str, dict, str], ...] = (
    ("--eviction-check-interval", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--eviction-ratio", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--trigger-watermark", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--hash-algorithm", {}, "blendmatch has no token hasher (pins and the token form of /directory/lookup "
                             "are not served here)"),
    ("--checkpoint-path", {}, "this build of blendmatch does not checkpoint"),
    ("--checkpoint-interval", {"type": float}, "this build of blendmatch does not checkpoint"),
    ("--extra-config", {}, "blendmatch loads no out-of-tree controllers"),
    ("--metadata-path", {}, "blendmatch keeps no pins or quotas"),
    ("--disable-metrics", {"action": "store_true"}, "blendmatch serves Prometheus metrics at /metrics"),
    ("--otlp-endpoint", {}, "blendmatch serves Prometheus metrics at /metrics (no OTLP push)"),
    ("--event-transport", {"choices": ("http", "kafka")}, "blendmatch takes cache events on POST /events"),
    ("--kafka-bootstrap-servers", {}, "blendmatch takes cache events on POST /events"),
    ("--kafka-topic", {}, "blendmatch takes cache events on POST /events"),
    ("--kafka-group-id", {}, "blendmatch takes cache events on POST /events"),
)


def _add_lmcache_only_flags(p: argparse.ArgumentParser) -> None:
    """Accept every LMCache coordinator flag this build gives no meaning. A flag that some
    other part of blendmatch already defines (with a meaning) is left to that definition."""
    for flag, kwargs, why in LMCACHE_IGNORED_FLAGS:
        try:
            p.add_argument(flag, default=None, help=f"accepted for LMCache compatibility and ignored: {why}",
                           **kwargs)
        except argparse.ArgumentError:
            continue  # defined elsewhere, with a meaning


def ignored_flag_warnings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """One line per LMCache-only flag given on the command line (see LMCACHE_IGNORED_FLAGS)."""
    out = []
    for flag, _, why in LMCACHE_IGNORED_FLAGS:
        action = parser._option_string_actions.get(flag)  # noqa: SLF001 - argparse's one index of flags
        if action is None or not action.help or not action.help.startswith("accepted for LMCache"):
            continue
        value = getattr(args, action.dest, None)
        if value not in (None, False):
            out.append(f"{flag} is accepted for LMCache compatibility and ignored: {why}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blendmatch", description="Fragment lookups for KV-cache reuse.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,bench,loadtest,openapi}")
    serve = sub.add_parser("serve", help="run the HTTP service", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_flags(serve)
    _add_lmcache_only_flags(serve)  # last: a flag defined with a meaning elsewhere wins
    sub.add_parser("bench", help="core benchmark (blendmatch bench --help)", add_help=False)
    sub.add_parser("loadtest", help="HTTP load test (blendmatch loadtest --help)", add_help=False)
    sub.add_parser("openapi", help="print the OpenAPI schema (JSON)")
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
        gc_freeze_ingest_bytes=GC_FREEZE_INGEST_BYTES,
        health_check_interval=args.health_check_interval, instance_timeout=args.instance_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
    )


def _serve(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="blendmatch serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_flags(parser)
    _add_lmcache_only_flags(parser)  # last: a flag defined with a meaning elsewhere wins
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(str(x) for x in e['loc']).replace('_', '-')}: {e['msg']}"
                             for e in exc.errors())
        parser.error(problems)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for line in ignored_flag_warnings(args, parser):
        logging.getLogger("blendmatch.service.cli").warning("%s", line)

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
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, access_log=args.access_log,
                proxy_headers=False, timeout_graceful_shutdown=10,
                timeout_keep_alive=int(config.timeout_keep_alive) if config.timeout_keep_alive.is_integer()
                else config.timeout_keep_alive)
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
    if command == "openapi":
        from .openapi import main as openapi_main

        return int(openapi_main(rest) or 0)
    build_parser().parse_args(argv)  # prints help, or the usage error for an unknown command
    return 0
