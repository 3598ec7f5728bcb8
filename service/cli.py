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

__all__ = ["main", "build_parser", "config_from_args", "uvicorn_tls_kwargs"]

_SUBCOMMANDS = ("serve", "bench", "loadtest", "openapi", "access-key")


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
    p.add_argument("--access-file", default=None, metavar="FILE",
                   help="TOML access file: hashed API keys and CIDR allowlists per role (producer, reader, admin, "
                        "metrics); reloaded on SIGHUP. Without it: protected mode, only loopback peers are served "
                        "(docs/security.md)")
    p.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve HTTPS with this certificate")
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")
    p.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                   help="require client certificates signed by these CAs (mutual TLS)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blendmatch", description="Fragment lookups for KV-cache reuse.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,bench,loadtest,openapi,access-key}")
    serve = sub.add_parser("serve", help="run the HTTP service", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_flags(serve)
    sub.add_parser("bench", help="core benchmark (blendmatch bench --help)", add_help=False)
    sub.add_parser("loadtest", help="HTTP load test (blendmatch loadtest --help)", add_help=False)
    sub.add_parser("openapi", help="print the OpenAPI schema (JSON)")
    _add_access_key_parser(sub.add_parser("access-key", help="print a new API key and its access-file entry"))
    return parser


def _add_access_key_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="operator", help="the entry's name (default %(default)s)")
    p.add_argument("--role", action="append", dest="roles", default=None,
                   choices=("producer", "reader", "admin", "metrics"), help="a role of the key (repeatable)")
    p.add_argument("--instance", action="append", dest="instances", default=None, metavar="PATTERN",
                   help="limit producer calls to instance ids matching this fnmatch pattern (repeatable)")


def _access_key(argv: Sequence[str]) -> int:
    """Print a fresh key (to hand to its holder) and the [[key]] entry (for the access file)."""
    import json

    from .access import hash_key, new_key

    p = argparse.ArgumentParser(prog="blendmatch access-key",
                                description="Print a new random API key and the access-file entry that grants it. "
                                            "The file stores only the key's SHA-256.")
    _add_access_key_parser(p)
    args = p.parse_args(argv)
    key = new_key()
    lines = [f"# API key (give it to its holder; it is not stored): {key}", "[[key]]",
             f"name = {json.dumps(args.name)}", f'sha256 = "{hash_key(key)}"',
             f"roles = {json.dumps(args.roles or ['reader'])}"]
    if args.instances:
        lines.append(f"instances = {json.dumps(args.instances)}")
    print("\n".join(lines))
    return 0


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
        gc_freeze_ingest_bytes=GC_FREEZE_INGEST_BYTES, access_file=args.access_file,
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
    )


def uvicorn_tls_kwargs(config) -> dict[str, object]:  # config: ServiceConfig
    """uvicorn's TLS arguments for ``config`` (empty: plain HTTP). With ``ssl_ca_certs`` a
    client certificate signed by those CAs is required (``CERT_REQUIRED``)."""
    if config.ssl_certfile is None:
        return {}
    import ssl

    kw: dict[str, object] = {"ssl_certfile": config.ssl_certfile, "ssl_keyfile": config.ssl_keyfile}
    if config.ssl_ca_certs is not None:
        kw.update(ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return kw


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

    from .access import AccessFileError, AccessPolicy

    try:
        access = AccessPolicy.from_file(config.access_file) if config.access_file else AccessPolicy.protected_mode()
    except AccessFileError as exc:
        parser.error(str(exc))
    # The first log line states the access mode (and TLS), before anything else is logged.
    tls = ("off" if config.ssl_certfile is None else
           f"on ({config.ssl_certfile}; client certificates {'required' if config.ssl_ca_certs else 'not asked'})")
    logging.getLogger("blendmatch.service").info("%s; TLS %s", access.describe(), tls)

    import signal

    import uvicorn

    from .app import create_app

    app = create_app(config, access=access)
    control = app.access  # type: ignore[attr-defined]
    if hasattr(signal, "SIGHUP"):
        # uvicorn captures SIGINT/SIGTERM only; SIGHUP stays ours. The handler runs on the
        # main thread between bytecodes and swaps one attribute: no request sees half a policy.
        signal.signal(signal.SIGHUP, lambda signum, frame: control.reload())
    # A long-running server: park the start-up objects (numba, pydantic, FastAPI; ~150k of
    # them) in the permanent generation so that the collector's full passes stop walking them.
    gc.collect()
    gc.freeze()
    # The lookup thread re-takes the GIL after every nogil engine call; under load the event
    # loop thread rarely blocks, so the default 5 ms switch interval made each batch wait
    # 5 ms several times (batches took ~15 ms instead of ~1 ms). 0.1 ms bounds that wait
    # (measured against 0.5 ms: 10-15% more lookups/s under the load test).
    sys.setswitchinterval(float(os.environ.get("BLENDMATCH_SWITCH_INTERVAL_S", "0.0001")))
    tls_kw = uvicorn_tls_kwargs(config)
    # proxy_headers=False: the peer address that the allowlists check is the socket's, never a
    # header a client could write.
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, access_log=args.access_log,
                proxy_headers=False, timeout_graceful_shutdown=10, **tls_kw)  # type: ignore[arg-type]
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
    if command == "access-key":
        return _access_key(rest)
    if command == "openapi":
        from .openapi import main as openapi_main

        return int(openapi_main(rest) or 0)
    build_parser().parse_args(argv)  # prints help, or the usage error for an unknown command
    return 0
