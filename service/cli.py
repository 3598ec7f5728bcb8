"""``blendmatch`` (and ``python -m blendmatch``): serve, warmup, lookup, bench, loadtest, openapi.

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
and says so in its start-up line (``blendmatch serving: engine cpu (...)``). A start it
refuses is one line on stderr and a non-zero exit (``main``; ``service/startcheck.py``).

``blendmatch lookup`` sends one blend lookup from a token file and prints the matches; its
exit status says what went wrong (``EXIT_*`` below, after the BSD ``sysexits.h`` codes).

Help text is plain prose (the ``--help`` screens below), not this docstring: a terminal does
not render reStructuredText.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from blendmatch import __version__

from .flags import (LMCACHE_IGNORED_FLAGS, add_config_flags, add_lmcache_only_flags, config_from_args, flag_help,
                    flag_name, ignored_flag_warnings)
from .startcheck import (OneLineArgumentParser, StartError, bind_sockets, check_engine, check_optional_modules,
                         check_tls_files, engine_error, error_line)

__all__ = ["main", "build_parser", "config_from_args", "ignored_flag_warnings", "uvicorn_tls_kwargs", "read_token_file",
           "LMCACHE_IGNORED_FLAGS", "EXIT_DATAERR", "EXIT_NOINPUT", "EXIT_PROTOCOL", "EXIT_UNAVAILABLE"]

_SUBCOMMANDS = ("serve", "warmup", "lookup", "bench", "loadtest", "openapi", "checkpoint", "access-key")

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
chosen. The first log line states the access mode; the start-up line
"blendmatch serving: engine NAME (WHY)" says which engine runs and why. A
refused start is one line on stderr: exit 1, or 2 for a bad command line."""

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


_help = flag_help


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    """``serve``'s flags: one per ``ServiceConfig`` field (``service/flags.py``), then the
    process flags, which are the supervisor's and not service settings."""
    add_config_flags(p)
    g = p.add_argument_group("worker processes (docs/fleet.md)")
    g.add_argument("--workers", type=int, default=1,
                   help=_help("replica processes sharing --port (SO_REUSEPORT), each following the topic: "
                              "needs --event-transport kafka; replica ids <id>-w<i>, checkpoints <path>.w<i>"))
    g.add_argument("--worker-ports-from", type=int, default=0,
                   help=_help("with --workers: worker i also serves alone on this port + i, so that metrics "
                              "scrapes and readiness probes can reach each worker (0: off)", default="off"))
    g.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set on --workers children
    g.add_argument("--own-port", type=int, default=0, help=argparse.SUPPRESS)  # a child's --worker-ports-from port


_add_lmcache_only_flags = add_lmcache_only_flags


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
    parser = OneLineArgumentParser(prog="blendmatch", description=_DESCRIPTION, epilog=_EPILOG,
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
    _add_warmup_flags(sub.add_parser("warmup", help="compile every kernel into the compile cache, without serving",
                                     description=_WARMUP_DESCRIPTION))
    sub.add_parser("bench", help="core benchmark (blendmatch bench --help)", add_help=False)
    sub.add_parser("loadtest", help="HTTP load test (blendmatch loadtest --help)", add_help=False)
    sub.add_parser("openapi", help="print the OpenAPI schema (JSON)")
    ck = sub.add_parser("checkpoint", help="checkpoint tools (blendmatch checkpoint inspect PATH)")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", metavar="{inspect}", required=True)
    ins = ck_sub.add_parser("inspect", help="print version, time, counts and stream position; verify every checksum")
    ins.add_argument("path")
    _add_access_key_parser(sub.add_parser("access-key", help="print a new API key and its access-file entry"))
    return parser


_WARMUP_DESCRIPTION = """Compile every kernel blendmatch serve runs into the compile cache, without serving.

For image builds and first installs: run it once as the user that will serve (or with the
same --cache-dir), and each later start loads the compiled code in about a second instead
of compiling for tens of seconds. Prints each step, the time and the cache folder; exits 1
when the cache folder cannot be written (nothing would be kept)."""


def _add_warmup_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default="", metavar="DIR",
                   help=_help("the compile cache folder (numba's files in DIR/numba)",
                              default="$BLENDMATCH_CACHE_DIR, else $XDG_CACHE_HOME/blendmatch, else ~/.cache/blendmatch"))


def _apply_cache_dir(argv: Sequence[str]) -> None:
    """``--cache-dir`` of ``serve``/``warmup``, applied before anything imports a kernel
    (building ``serve``'s parser imports the engines: numba picks a function's cache
    folder when the function is defined)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--cache-dir", default="")
    known, _ = pre.parse_known_args(argv)
    if known.cache_dir:
        from blendmatch.compile_cache import configure

        configure(known.cache_dir)


def _warmup(argv: Sequence[str]) -> int:
    import time

    from blendmatch.compile_cache import current

    p = OneLineArgumentParser(prog="blendmatch warmup", description=_WARMUP_DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_warmup_flags(p)
    p.parse_args(argv)
    cache = current()
    if not cache.persistent:
        return _fail("blendmatch warmup", 1, f"compile cache {cache.chosen} (from {cache.source}) is not writable "
                                             f"({cache.problem}); set --cache-dir or BLENDMATCH_CACHE_DIR")
    print(f"blendmatch warmup: compile cache {cache.folder} (from {cache.source})", flush=True)
    t0 = time.perf_counter()
    from .config import ServiceConfig
    from .warmup import WarmupFailed, compile_everything

    try:
        compile_everything(ServiceConfig(), progress=lambda line: print(f"  {line}", flush=True))
    except WarmupFailed as exc:  # a bug: the same request would fail for a client
        return _fail("blendmatch warmup", 1, str(exc))
    print(f"blendmatch warmup: compiled in {time.perf_counter() - t0:.1f} s into {cache.folder}", flush=True)
    return 0


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

    p = OneLineArgumentParser(prog="blendmatch access-key",
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
    from pydantic import ValidationError

    parser = OneLineArgumentParser(prog="blendmatch serve", description=_SERVE_DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_flags(parser)
    _add_lmcache_only_flags(parser)  # last: a flag defined with a meaning elsewhere wins
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        problems = "; ".join((f"{flag_name('_'.join(str(x) for x in e['loc']))}: " if e["loc"] else "")
                             + e["msg"] for e in exc.errors())
        parser.error(problems)
    if config.cache_dir:  # main() applied it before the parser imported the engines; a direct call here
        from blendmatch.compile_cache import configure

        configure(config.cache_dir)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.worker_ports_from <= 65535 - max(0, args.workers - 1):
        parser.error(f"--worker-ports-from {args.worker_ports_from}: the ports from there to +{args.workers - 1} "
                     "must lie in 1..65535 (0: off)")
    if args.worker_ports_from and args.workers < 2:
        parser.error("--worker-ports-from needs --workers 2 or more")
    if args.workers > 1 and config.kv_events_endpoint:
        parser.error("--kv-events-endpoint with --workers: the workers would publish one stream N times; run the "
                     "publishing replica as its own process (docs/kv-events.md)")
    if args.workers > 1 and config.event_transport != "kafka":
        parser.error("--workers needs --event-transport kafka: the workers share nothing but the event log, "
                     "so each must follow it (docs/fleet.md)")
    from .access import AccessFileError, AccessPolicy

    try:
        access = AccessPolicy.from_file(config.access_file) if config.access_file else AccessPolicy.protected_mode()
    except AccessFileError as exc:
        parser.error(str(exc))
    if config.kv_events_endpoint:  # refuse an ungranted exposure before anything starts (a usage error)
        from .publish import EndpointNotAllowed, KVEventsPublisher
        from .publish.setup import settings_from_config

        try:
            KVEventsPublisher(settings_from_config(config))
        except (EndpointNotAllowed, ValueError) as exc:
            parser.error(str(exc))

    # Before the start-up work, and before the first log line: the port first (bound here and
    # handed to uvicorn, so nothing can take it meanwhile), then the files and modules asked
    # for. Each failure is a StartError: one line from main(), exit 1 (service/startcheck.py).
    sockets = [] if args.workers > 1 else bind_sockets(  # --workers: each child binds the shared port
        config.host, [(config.port, args.reuse_port), *([(args.own_port, False)] if args.own_port else [])])
    check_tls_files(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
    check_optional_modules(config)
    check_engine(config.engine)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    from .transport_support import fallback_uvicorn_options, raise_open_file_limit, tested_range, transport_support

    import signal

    from blendmatch.gpu import EngineUnavailable

    try:
        app = create_app(config, access=access)
    except EngineUnavailable as exc:  # --engine gpu whose trial launch failed after check_engine
        raise StartError(engine_error(exc)) from None
    # compile after the port opened: /readyz says "compiling" meanwhile (service/warmup.py)
    app.state.blendmatch_context.compile_mode = "background"
    control = app.access  # type: ignore[attr-defined]
    if hasattr(signal, "SIGHUP"):
        # uvicorn captures SIGINT/SIGTERM only; SIGHUP stays ours. The handler runs on the
        # main thread between bytecodes and swaps one attribute: no request sees half a policy.
        signal.signal(signal.SIGHUP, lambda signum, frame: control.reload())
    # A crash in native code (numba kernels, librdkafka, numpy) would end the process with a
    # bare exit status; with faulthandler it first writes every thread's Python stack to
    # stderr (the server's log), so the crash names where each thread was.
    faulthandler.enable()
    # A long-running server: park the start-up objects (numba, pydantic, FastAPI; ~150k of
    # them) in the permanent generation so that the collector's full passes stop walking them.
    gc.collect()
    gc.freeze()
    # The lookup thread re-takes the GIL after every nogil engine call; under load the event
    # loop thread rarely blocks, so the default 5 ms switch interval made each batch wait
    # 5 ms several times (batches took ~15 ms instead of ~1 ms). 0.1 ms bounds that wait
    # (measured against 0.5 ms: 10-15% more lookups/s under the load test).
    sys.setswitchinterval(float(os.environ.get("BLENDMATCH_SWITCH_INTERVAL_S", "0.0001")))
    # The HTTP limits (header bytes, read timeouts, connections, bytes in flight) live in the
    # protocol uvicorn runs per connection, so they bite while reading (service/limits.py),
    # and the lookup lane with them (lane.py): both on uvicorn's private protocol, checked
    # here (transport_support.py); without it, plain uvicorn and what its options keep.
    missing = transport_support()
    if missing:
        http_options = fallback_uvicorn_options(config)
        logging.getLogger("blendmatch.service").warning(
            "uvicorn %s lacks what the HTTP limits and the lookup lane use (%s): serving with plain uvicorn (h11), "
            "the same answers, slower; kept: --max-header-bytes (as a 400), --max-connections (uvicorn's "
            "limit_concurrency); not enforced: --header-timeout, --body-timeout, --max-bytes-in-flight; tested: %s",
            uvicorn.__version__, ", ".join(missing), tested_range())
    else:
        from .limits import HttpLimits

        metrics = app.state.blendmatch_context.metrics
        limits = HttpLimits.from_config(config, registry=metrics.registry,
                                        on_reject=lambda status: metrics.rejected.labels(str(status)).inc())
        http_options = {"http": limits.protocol_class}
    raise_open_file_limit(config.max_connections)
    # Half of --graceful-timeout for in-flight requests; the rest is for the events thread
    # and the final checkpoint (the watchdog in _GracefulServer bounds the whole stop).
    # proxy_headers=False: the peer address that the allowlists check is the socket's, never a
    # header a client could write.
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               access_log=config.access_log, proxy_headers=False, **uvicorn_tls_kwargs(config),
                               **http_options, ws="none",  # no WebSocket routes here
                               timeout_graceful_shutdown=max(1, int(config.graceful_timeout / 2)),
                               timeout_keep_alive=int(config.timeout_keep_alive) if config.timeout_keep_alive.is_integer()
                               else config.timeout_keep_alive)
    server = _graceful_server_class(uvicorn.Server)(uv_config, config.graceful_timeout)
    context = app.state.blendmatch_context
    context.add_fatal_listener(server.fail)
    from .durability import CheckpointRequired

    try:  # before the port listens: a directory, a file not ours, a path another server holds
        context.durability.prepare()
    except CheckpointRequired as exc:
        raise StartError(str(exc)) from None
    server.run(sockets=sockets)  # they listen from here (uvicorn's loop calls listen())
    if context.fatal is not None or server.exit_code:
        return server.exit_code or 1
    if context.durability.final_error is not None:  # logged at ERROR by the stop
        return 1
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

        async def startup(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
            await super().startup(sockets)
            if sockets and not self.should_exit:  # uvicorn names the address only of sockets it opened
                scheme = "https" if self.config.is_ssl else "http"
                for sock in sockets:
                    host, port = sock.getsockname()[:2]
                    logging.getLogger("blendmatch.service").info("listening on %s://%s:%d", scheme,
                                                                 f"[{host}]" if ":" in host else host, port)

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
            """The service cannot go on (``ServiceContext.add_fatal_listener``): stop, exit 1."""
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
    as a read-only uint32 array. Raises ``OSError`` when it cannot be read,
    :class:`TokenFileError` when its content is not token ids (the message names what is
    wrong). The file format is this function's; what a token id is, ``index/tokens.py``'s."""
    from blendmatch.index.tokens import TokenDecodeError, decode_token_ids

    if path != "-" and path.endswith(".npy"):
        try:
            values: Any = np.load(path, allow_pickle=False)
        except (ValueError, EOFError) as exc:  # not an .npy file, truncated, or object dtype
            raise TokenFileError(f"not a readable .npy array: {exc}") from None
    else:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8", errors="strict")
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise TokenFileError(f"not JSON: {exc}") from None
        if not isinstance(values, list):
            raise TokenFileError(f"expected a JSON list of token ids, got a JSON {type(values).__name__}")
    try:
        return decode_token_ids(values, field="")
    except TokenDecodeError as exc:
        raise TokenFileError(str(exc)) from None


def _fail(prog: str, code: int, message: str) -> int:
    print(error_line(prog, message), file=sys.stderr)
    return code


def _lookup(argv: Sequence[str]) -> int:
    prog = "blendmatch lookup"
    parser = OneLineArgumentParser(prog=prog, description=_LOOKUP_DESCRIPTION, epilog=_LOOKUP_EPILOG,
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
    """Entry point of the ``blendmatch`` console script and ``python -m blendmatch``.

    The one place where a refused start becomes its line: a :class:`StartError` from any
    subcommand is printed as ``blendmatch <command>: error: <why>`` on stderr, with its exit
    status (1; 2 for a bad command line, which argparse reports the same way through
    :class:`OneLineArgumentParser`), and no traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else "serve"
    try:
        return _main(argv)
    except StartError as exc:
        print(error_line(f"blendmatch {command}", str(exc)), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before uvicorn took over the signals (e.g. while compiling)
        print(error_line(f"blendmatch {command}", "interrupted"), file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("serve", "warmup") or argv[0].startswith("-"):
        _apply_cache_dir(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-V", "--version")):
        return _serve(argv)  # LMCache style: flags only
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return _serve(rest)
    if command == "warmup":
        return _warmup(rest)
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
