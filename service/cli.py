"""``blendmatch`` (and ``python -m blendmatch``): serve, lookup, bench, loadtest, openapi.

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

``blendmatch lookup`` sends one blend lookup from a token file and prints the matches; its
exit status says what went wrong (``EXIT_*`` below, after the BSD ``sysexits.h`` codes).

Help text is plain prose (the ``--help`` screens below), not this docstring: a terminal does
not render reStructuredText.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from blendmatch import __version__

__all__ = ["main", "build_parser", "config_from_args", "uvicorn_tls_kwargs", "read_token_file", "EXIT_DATAERR", "EXIT_NOINPUT",
           "EXIT_PROTOCOL", "EXIT_UNAVAILABLE"]

_SUBCOMMANDS = ("serve", "lookup", "bench", "loadtest", "openapi", "checkpoint", "access-key")

#: ``blendmatch lookup`` exit statuses (BSD sysexits.h; 2 stays argparse's usage error).
EXIT_DATAERR = 65      # the token file is not a list of token ids
EXIT_NOINPUT = 66      # the token file does not exist or cannot be read
EXIT_UNAVAILABLE = 69  # no answer from the server (refused, unreachable, timed out)
EXIT_PROTOCOL = 76     # the server answered with an error status or a malformed body

_DESCRIPTION = """blendmatch: fragment lookups for LLM KV-cache reuse.

Follows a vLLM + LMCache fleet's cache-event stream and answers CacheBlend-style
blend lookups (which stored chunks does this request contain, and where?) over
LMCache's coordinator HTTP contract. With no subcommand, the flags go to serve,
as with LMCache's coordinator command line."""

_EPILOG = """examples:
  blendmatch serve                              listen on 0.0.0.0:9300, engine auto
  blendmatch --port 9300 --chunk-size 256       LMCache-style: flags only means serve
  blendmatch lookup --model MODEL tokens.json   one lookup against a running server
  blendmatch serve --help                       every serve flag, its default and its
                                                LMCache equivalent"""

_SERVE_DESCRIPTION = """Run the blendmatch HTTP service: LMCache's coordinator wire shapes, port 9300.

Flags shared with LMCache's coordinator (lmcache coordinator, python -m
lmcache.v1.mp_coordinator) have the same names and meanings; the others are
blendmatch's own. Blend lookup is on by default here (the service exists for
it): --enable-blend-lookup is accepted for compatibility, --disable-blend-lookup
turns it off. No configuration is needed: without a GPU the CPU engine is
chosen, and the first log line says which engine runs and why."""

_LOOKUP_DESCRIPTION = """Send one blend lookup to a running server and print the matches.

FILE holds the query's token ids: a JSON list of integers, or a .npy file with a
1-D integer array (use - to read JSON from standard input). The answer lists, for
every stored chunk found in the query, where it starts in the query (cur_st),
where it sat when it was stored (old_st) and its chunk hash, in ascending
cur_st; matches may overlap."""

_LOOKUP_EPILOG = f"""exit status:
  0   the lookup was answered (with or without matches)
  2   usage error (bad or missing flag)
  {EXIT_DATAERR}  FILE is not a 1-D list of token ids in 0..2^32-1
  {EXIT_NOINPUT}  FILE does not exist or cannot be read
  {EXIT_UNAVAILABLE}  no answer from the server (refused, unreachable, timed out)
  {EXIT_PROTOCOL}  the server answered with an error status or a malformed body"""


def _help(text: str, lmcache: str | None = None, default: str = "%(default)s") -> str:
    """A flag's help: what it does, its default, and its LMCache equivalent if there is one."""
    where = f"; LMCache: {lmcache}" if lmcache else ""
    return f"{text} (default: {default}{where})"


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    from blendmatch.gpu import ENGINE_NAMES

    from .config import ServiceConfig

    d = ServiceConfig.model_fields
    coord = "the coordinator's"
    p.add_argument("--host", default=d["host"].default, help=_help("address to bind", f"{coord} --host"))
    p.add_argument("--port", type=int, default=d["port"].default, help=_help("TCP port", f"{coord} --port"))
    p.add_argument("--chunk-size", type=int, default=d["chunk_size"].default,
                   help=_help("tokens per KV chunk; must equal the MP servers' --chunk-size",
                              f"{coord} --chunk-size"))
    p.add_argument("--blend-probe-stride", type=int, default=d["blend_probe_stride"].default,
                   help=_help("query positions between probes; 1 probes every position, for full recall",
                              f"{coord} --blend-probe-stride"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--enable-blend-lookup", dest="enable_blend_lookup", action="store_true", default=True,
                   help=_help("index chunk content for blend lookups", f"{coord} --enable-blend-lookup, "
                              "which is off by default there", default="on"))
    g.add_argument("--disable-blend-lookup", dest="enable_blend_lookup", action="store_false",
                   help=_help("do not index content; blend lookups answer no matches",
                              "the coordinator's default", default="off"))
    p.add_argument("--engine", choices=ENGINE_NAMES, default=d["engine"].default,
                   help=_help("probe engine: auto = the GPU if a trial launch succeeds, else the CPU"))
    p.add_argument("--max-batch-tokens", type=int, default=d["max_batch_tokens"].default,
                   help=_help("token budget of one engine batch; one request's size disables batching"))
    p.add_argument("--max-batch-wait-ms", type=float, default=d["max_batch_wait_ms"].default,
                   help=_help("once a lookup is queued, wait up to this long for more; 0 = batch "
                              "whatever is queued when the engine is free"))
    p.add_argument("--max-request-tokens", type=int, default=d["max_request_tokens"].default,
                   help=_help("most tokens one request may carry (a batch: the sum); more is a 413"))
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help=_help("largest request body; more is a 413",
                              default="16 bytes per --max-request-tokens token + 1 MiB"))
    p.add_argument("--engine-threads", type=int, default=None,
                   help=_help("threads of the CPU engine's parallel probe",
                              default="CPUs - 1, at least 1: the event loop keeps a core"))
    p.add_argument("--log-level", default=d["log_level"].default,
                   choices=("critical", "error", "warning", "info", "debug"),
                   help=_help("log level", "the LMCACHE_LOG_LEVEL environment variable"))
    p.add_argument("--access-log", action="store_true",
                   help=_help("log every request (costs CPU at high request rates)", default="off"))

    p.add_argument("--health-check-interval", type=float, default=d["health_check_interval"].default,
                   help=_help("seconds between sweeps that expire silent instances; 0 disables",
                              f"{coord} --health-check-interval"))
    p.add_argument("--instance-timeout", type=float, default=d["instance_timeout"].default,
                   help=_help("seconds without a heartbeat after which an instance expires and its L1 "
                              "placements are fenced", f"{coord} --instance-timeout"))
    p.add_argument("--timeout-keep-alive", type=float, default=d["timeout_keep_alive"].default,
                   help=_help("seconds idle HTTP connections stay open; keep it above the servers' heartbeat "
                              "interval (5 s)", f"{coord} --timeout-keep-alive"))
    a = p.add_argument_group("access and TLS (docs/security.md)")
    a.add_argument("--access-file", default=None, metavar="FILE",
                   help=_help("TOML access file: hashed API keys and CIDR allowlists per role (producer, reader, "
                              "admin, metrics); reloaded on SIGHUP. Without it: protected mode, only loopback "
                              "peers are served", default="none: protected mode"))
    a.add_argument("--ssl-certfile", default=None, metavar="PEM",
                   help=_help("serve HTTPS with this certificate", default="plain HTTP"))
    a.add_argument("--ssl-keyfile", default=None, metavar="PEM", help=_help("the certificate's private key",
                                                                          default="none"))
    a.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                   help=_help("require client certificates signed by these CAs (mutual TLS)", default="none"))
    g = p.add_argument_group("in front of an LMCache coordinator (docs/lmcache.md)")
    g.add_argument("--upstream-coordinator", metavar="URL", default=d["upstream_coordinator"].default,
                   help=_help("an existing LMCache coordinator to run in front of: endpoints not served here "
                              "(quotas, pins, prefetch, eviction) are proxied to it, events and registry calls "
                              "are applied here and forwarded to it; lookups never wait on it", default="none"))
    g.add_argument("--upstream-timeout", type=float, default=d["upstream_timeout"].default,
                   help=_help("seconds one call to the upstream may take in all; a proxied call past it is a 504"))
    g.add_argument("--upstream-connect-timeout", type=float, default=d["upstream_connect_timeout"].default,
                   help=_help("seconds to connect to the upstream; an unreachable upstream is a 502"))
    g.add_argument("--upstream-queue-size", type=int, default=d["upstream_queue_size"].default,
                   help=_help("forwards waiting for the upstream; when full the oldest is dropped and counted"))
    g.add_argument("--upstream-queue-bytes", type=int, default=d["upstream_queue_bytes"].default,
                   help=_help("body bytes of the forwards waiting for the upstream; past it the oldest are "
                              "dropped and counted", default="256 MiB"))
    g = p.add_argument_group("durability (docs/operations.md)")
    g.add_argument("--checkpoint-path", default=d["checkpoint_path"].default,
                   help=_help("checkpoint file, restored at start and written periodically and on a clean "
                              "stop; empty = off", f"{coord} --checkpoint-path", default="off"))
    g.add_argument("--checkpoint-interval", type=float, default=d["checkpoint_interval"].default,
                   help=_help("seconds between checkpoints; 0 = only on a clean stop", f"{coord} --checkpoint-interval"))
    g.add_argument("--require-checkpoint", action="store_true",
                   help=_help("exit non-zero instead of starting cold when the checkpoint is missing, corrupt "
                              "or of an unknown version", default="off"))
    g.add_argument("--graceful-timeout", type=float, default=d["graceful_timeout"].default,
                   help=_help("seconds a SIGTERM/SIGINT stop may take: drain, final checkpoint"))
    g.add_argument("--max-ready-lag", type=int, default=d["max_ready_lag"].default,
                   help=_help("with events from a log: /readyz answers 503 while the lag exceeds this many records"))
    g.add_argument("--refuse-lookups-until-ready", action="store_true",
                   help=_help("answer lookups 503 until /readyz first says ready, instead of from a partly restored "
                              "or caught-up index (on for --workers children: the kernel cannot route by readiness)",
                              default="off"))
    g = p.add_argument_group("fleet transport (docs/fleet.md)")
    g.add_argument("--event-transport", choices=("http", "kafka"), default=d["event_transport"].default,
                   help=_help("http: POST /events applies here; kafka: follow the topic, and POST /events and the "
                              "registry calls append to it", f"{coord} --event-transport"))
    g.add_argument("--kafka-bootstrap-servers", default=d["kafka_bootstrap_servers"].default,
                   help=_help("Kafka brokers, host:port[,host:port]; required with --event-transport kafka",
                              f"{coord} --kafka-bootstrap-servers", default="none"))
    g.add_argument("--kafka-topic", default=d["kafka_topic"].default,
                   help=_help("cache-event topic; must match the MP servers' --coordinator-kafka-topic",
                              f"{coord} --kafka-topic"))
    g.add_argument("--kafka-group-id", default=d["kafka_group_id"].default,
                   help=_help("prefix of this replica's offset-commit group (<id>-<replica id>) and of the "
                              "reaper-role group (<id>-reaper)", f"{coord} --kafka-group-id"))
    g.add_argument("--replica-id", default=d["replica_id"].default,
                   help=_help("this replica's name; keep it stable across restarts (a StatefulSet pod name)",
                              default="the host name"))
    g.add_argument("--kafka-reaper-topic", default=d["kafka_reaper_topic"].default,
                   help=_help("one-partition topic whose owner holds the reaper role", default="<topic>-reaper"))
    g.add_argument("--kafka-session-timeout-ms", type=int, default=d["kafka_session_timeout_ms"].default,
                   help=_help("the reaper role moves this long after its holder died"))
    g.add_argument("--workers", type=int, default=1,
                   help=_help("replica processes sharing --port (SO_REUSEPORT), each following the topic: "
                              "needs --event-transport kafka; replica ids <id>-w<i>, checkpoints <path>.w<i>"))
    g.add_argument("--worker-ports-from", type=int, default=0,
                   help=_help("with --workers: worker i also serves alone on this port + i, so that metrics "
                              "scrapes and readiness probes can reach each worker (0: off)", default="off"))
    # issue 24 flags
    p.add_argument("--hash-algorithm", default=d["hash_algorithm"].default,
                   help=_help(d["hash_algorithm"].description + "; must equal the MP servers'; vLLM's functions "
                              "seed with PYTHONHASHSEED as vLLM does", f"{coord} --hash-algorithm"))
    g.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set on --workers children
    g.add_argument("--own-port", type=int, default=0, help=argparse.SUPPRESS)  # a child's --worker-ports-from port


#: LMCache 0.5.6 coordinator flags that mean nothing here: accepted (so that an existing
#: launch command works unchanged) and answered with one warning line each at start-up.
#: ``(flag, argparse kwargs, why it is ignored)``.
LMCACHE_IGNORED_FLAGS: tuple[tuple[str, dict, str], ...] = (
    ("--eviction-check-interval", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--eviction-ratio", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--trigger-watermark", {"type": float}, "blendmatch runs no L2 eviction controller"),
    ("--extra-config", {}, "blendmatch loads no out-of-tree controllers (run in front of an LMCache coordinator "
                           "with --upstream-coordinator to keep them)"),
    ("--metadata-path", {}, "blendmatch keeps no pins or quotas (--upstream-coordinator proxies them to an LMCache "
                            "coordinator)"),
    ("--disable-metrics", {"action": "store_true"}, "blendmatch serves Prometheus metrics at /metrics"),
    ("--otlp-endpoint", {}, "blendmatch serves Prometheus metrics at /metrics (no OTLP push)"),
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_lookup_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="token ids: a JSON list, a .npy array, or - for JSON on stdin")
    p.add_argument("--url", default="http://127.0.0.1:9300",
                   help=_help("server base URL (http:// is assumed without a scheme)",
                              "the MP server's --coordinator-url or LMCACHE_COORDINATOR_URL"))
    p.add_argument("--model", required=True,
                   help="model name the KV was stored under (required; LMCache: the key's model_name)")
    p.add_argument("--world-size", type=_positive_int, default=1,
                   help=_help("parallel world size (TP x PP) of the requester",
                              "the world size packed in the key's kv_rank"))
    p.add_argument("--cache-salt", default="", help=_help("per-tenant isolation salt", "the request's cache_salt",
                                                          default="none"))
    p.add_argument("--timeout", type=_positive_float, default=10.0, help=_help("seconds to wait for the answer"))
    p.add_argument("--json", action="store_true",
                   help=_help("print the server's answer as JSON, {\"matches\": [...]}", default="a table"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blendmatch", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"blendmatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    serve = sub.add_parser("serve", help="run the HTTP service", description=_SERVE_DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_flags(serve)
    _add_lmcache_only_flags(serve)  # last: a flag defined with a meaning elsewhere wins
    lookup = sub.add_parser("lookup", help="send one blend lookup from a token file and print the matches",
                            description=_LOOKUP_DESCRIPTION, epilog=_LOOKUP_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_lookup_flags(lookup)
    sub.add_parser("bench", help="core benchmark (blendmatch bench --help)", add_help=False)
    sub.add_parser("loadtest", help="HTTP load test (blendmatch loadtest --help)", add_help=False)
    sub.add_parser("openapi", help="print the OpenAPI schema (JSON)")
    ck = sub.add_parser("checkpoint", help="checkpoint tools (blendmatch checkpoint inspect PATH)")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", metavar="{inspect}", required=True)
    ins = ck_sub.add_parser("inspect", help="print version, time, counts and stream position; verify every checksum")
    ins.add_argument("path")
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
        enable_blend_lookup=args.enable_blend_lookup, hash_algorithm=args.hash_algorithm, engine=args.engine, max_batch_tokens=args.max_batch_tokens,
        max_batch_wait_ms=args.max_batch_wait_ms, max_request_tokens=args.max_request_tokens,
        max_body_bytes=args.max_body_bytes, engine_threads=args.engine_threads, log_level=args.log_level,
        gc_freeze_ingest_bytes=GC_FREEZE_INGEST_BYTES,
        health_check_interval=args.health_check_interval, instance_timeout=args.instance_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        checkpoint_path=args.checkpoint_path,
        checkpoint_interval=args.checkpoint_interval, require_checkpoint=args.require_checkpoint,
        graceful_timeout=args.graceful_timeout, max_ready_lag=args.max_ready_lag,
        refuse_lookups_until_ready=args.refuse_lookups_until_ready,
        upstream_coordinator=_with_scheme(args.upstream_coordinator), upstream_timeout=args.upstream_timeout,
        upstream_connect_timeout=args.upstream_connect_timeout, upstream_queue_size=args.upstream_queue_size,
        upstream_queue_bytes=args.upstream_queue_bytes,
        access_file=args.access_file, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs, **_fleet_args(args),
    )


def _with_scheme(url: str) -> str:
    """``host:port`` -> ``http://host:port`` (as ``lookup --url``); empty stays empty."""
    url = url.strip()
    return url if not url or "://" in url else f"http://{url}"


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


def _fleet_args(args: argparse.Namespace) -> dict[str, Any]:
    """The fleet-transport fields (absent on parsers built without those flags)."""
    names = ("event_transport", "kafka_bootstrap_servers", "kafka_topic", "kafka_group_id", "replica_id",
             "kafka_reaper_topic", "kafka_session_timeout_ms")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _serve(argv: Sequence[str]) -> int:
    from pydantic import ValidationError

    parser = argparse.ArgumentParser(prog="blendmatch serve", description=_SERVE_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_flags(parser)
    _add_lmcache_only_flags(parser)  # last: a flag defined with a meaning elsewhere wins
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        problems = "; ".join((f"--{'-'.join(str(x) for x in e['loc']).replace('_', '-')}: " if e["loc"] else "")
                             + e["msg"] for e in exc.errors())
        parser.error(problems)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.worker_ports_from <= 65535 - max(0, args.workers - 1):
        parser.error(f"--worker-ports-from {args.worker_ports_from}: the ports from there to +{args.workers - 1} "
                     "must lie in 1..65535 (0: off)")
    if args.worker_ports_from and args.workers < 2:
        parser.error("--worker-ports-from needs --workers 2 or more")
    if args.workers > 1 and config.event_transport != "kafka":
        parser.error("--workers needs --event-transport kafka: the workers share nothing but the event log, "
                     "so each must follow it (docs/fleet.md)")
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
    for line in ignored_flag_warnings(args, parser):
        logging.getLogger("blendmatch.service.cli").warning("%s", line)
    if args.workers > 1:
        import socket

        from .workers import supervise

        return supervise(argv, args.workers, replica_id=config.replica_id or socket.gethostname(),
                         checkpoint_path=config.checkpoint_path, engine_threads=config.engine_threads,
                         own_ports_from=args.worker_ports_from)

    import uvicorn

    from .app import create_app

    import signal

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
    # Half of --graceful-timeout for in-flight requests; the rest is for the events thread
    # and the final checkpoint (the watchdog in _GracefulServer bounds the whole stop).
    # proxy_headers=False: the peer address that the allowlists check is the socket's, never a
    # header a client could write.
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               access_log=args.access_log, proxy_headers=False, **uvicorn_tls_kwargs(config),
                               timeout_graceful_shutdown=max(1, int(config.graceful_timeout / 2)),
                               timeout_keep_alive=int(config.timeout_keep_alive) if config.timeout_keep_alive.is_integer()
                               else config.timeout_keep_alive)
    server = _graceful_server_class(uvicorn.Server)(uv_config, config.graceful_timeout)
    context = app.state.blendmatch_context
    context.on_fatal = server.fail
    if args.reuse_port:  # a --workers child: its own socket on the shared port
        from .workers import listen_socket

        sockets = []
        for port, shared in ((config.port, True), (args.own_port, False)):
            if not port:
                continue
            try:
                sockets.append(listen_socket(config.host, port, shared=shared))
            except OSError as exc:  # a port taken by a socket without SO_REUSEPORT, or another user's
                logging.getLogger("blendmatch.service").error("cannot listen on %s:%d: %s", config.host, port, exc)
                return 1
        server.run(sockets=sockets)
    else:
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


class TokenFileError(ValueError):
    """A token file that exists but does not hold a 1-D list of token ids."""


def read_token_file(path: str) -> np.ndarray:
    """The token ids in ``path`` (JSON list, ``.npy`` 1-D integer array, ``-`` = JSON on stdin)
    as uint32. Raises ``OSError`` when it cannot be read, :class:`TokenFileError` when its
    content is not token ids (the message names what is wrong)."""
    if path != "-" and path.endswith(".npy"):
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, EOFError) as exc:  # not an .npy file, truncated, or object dtype
            raise TokenFileError(f"not a readable .npy array: {exc}") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TokenFileError(f"expected a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        values: Any = arr
    else:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8", errors="strict")
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise TokenFileError(f"not JSON: {exc}") from None
        if not isinstance(values, list):
            raise TokenFileError(f"expected a JSON list of token ids, got a JSON {type(values).__name__}")
        bad = next((v for v in values if type(v) is not int), None)
        if bad is not None:
            raise TokenFileError(f"token ids must be integers, got {bad!r}")
    if len(values):
        lo, hi = int(min(values)), int(max(values))
        if lo < 0 or hi > 0xFFFFFFFF:
            raise TokenFileError(f"token ids must be in 0..{0xFFFFFFFF}, got {lo if lo < 0 else hi}")
    return np.asarray(values, dtype=np.uint32)


def _fail(prog: str, code: int, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def _lookup(argv: Sequence[str]) -> int:
    prog = "blendmatch lookup"
    parser = argparse.ArgumentParser(prog=prog, description=_LOOKUP_DESCRIPTION, epilog=_LOOKUP_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_lookup_flags(parser)
    args = parser.parse_args(argv)
    try:
        tokens = read_token_file(args.file)
    except TokenFileError as exc:
        return _fail(prog, EXIT_DATAERR, f"{args.file}: {exc}")
    except (OSError, UnicodeDecodeError) as exc:
        return _fail(prog, EXIT_NOINPUT, f"cannot read {args.file}: {getattr(exc, 'strerror', None) or exc}")

    from .client import BlendClient, BlendConnectionError, BlendHTTPError

    url = args.url if "://" in args.url else f"http://{args.url}"
    try:
        with BlendClient(url, timeout=args.timeout) as client:
            matches = client.lookup(tokens, args.model, world_size=args.world_size, cache_salt=args.cache_salt)
    except BlendConnectionError as exc:
        return _fail(prog, EXIT_UNAVAILABLE, f"no answer from {url}: {exc}")
    except BlendHTTPError as exc:
        return _fail(prog, EXIT_PROTOCOL, f"{url} refused the lookup: {exc}")
    except (ValueError, KeyError, TypeError) as exc:  # a body that is not a blend-lookup answer
        return _fail(prog, EXIT_PROTOCOL, f"{url} sent a malformed answer: {type(exc).__name__}: {exc}")
    _print_matches(matches, len(tokens), as_json=args.json)
    return 0


def _print_matches(matches: Sequence[Any], n_tokens: int, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"matches": [{"chunk_hash": m.chunk_hash.hex(), "old_st": m.old_st, "cur_st": m.cur_st}
                                      for m in matches]}))
        return
    noun = "match" if len(matches) == 1 else "matches"
    print(f"{len(matches) or 'no'} {noun} in a query of {n_tokens} tokens")
    if matches:
        print(f"{'cur_st':>10} {'old_st':>10}  chunk_hash")
        for m in matches:
            print(f"{m.cur_st:>10} {m.old_st:>10}  {m.chunk_hash.hex()}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blendmatch`` console script and ``python -m blendmatch``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-V", "--version")):
        return _serve(argv)  # LMCache style: flags only
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return _serve(rest)
    if command == "lookup":
        return _lookup(rest)
    if command == "bench":
        from blendmatch.bench import engine as engine_bench  # bench is imported by nothing else

        return int(engine_bench.main(rest) or 0)
    if command == "loadtest":
        from blendmatch.bench import loadtest

        return int(loadtest.main(rest) or 0)
    if command == "access-key":
        return _access_key(rest)
    if command == "checkpoint":
        args = build_parser().parse_args(argv)
        return _checkpoint_inspect(args.path)
    if command == "openapi":
        from .openapi import main as openapi_main

        return int(openapi_main(rest) or 0)
    build_parser().parse_args(argv)  # prints help, or the usage error for an unknown command
    return 0
