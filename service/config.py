"""Service settings: one typed object that the CLI fills and tests override.

``ServiceConfig`` is a frozen pydantic model, so a bad value fails at start-up with a message
that names the field, never at the first request. Tests build one directly
(``ServiceConfig(max_batch_tokens=8192)``) or derive one (``config.model_copy(update=...)``)
and hand it to :func:`blendmatch.service.app.create_app`.

Limits and why they exist:

- ``max_request_tokens`` bounds the tokens one HTTP request may carry (a single lookup, or
  the sum over a batch lookup). Over it -> 413. One request must not be able to hold the
  engine for seconds while every other caller waits behind it.
- ``max_body_bytes`` bounds the raw body, checked *before* parsing (Content-Length and the
  streamed byte count). Derived from ``max_request_tokens`` when not given: 16 bytes per
  token covers a JSON ``token_ids`` list of 10-digit ids with separators, plus 1 MiB of slack
  for the envelope. Event batches are bounded by the same number.
- ``max_batch_tokens`` bounds the tokens in one engine batch (not the number of requests:
  a batch's cost is its windows, i.e. its tokens). A single request larger than the budget
  still runs, alone. Setting it to one request's size turns batching off, which is what the
  load test's "no batching" configuration does.
- ``engine_threads`` (default: CPUs - 1, at least 1) is how many threads the CPU engine's
  parallel probe may use. The event loop needs a core of its own under load: on a 2-core
  machine a 2-thread probe runs half its work on the loop's core and took 1.5x longer than a
  1-thread probe while the server was saturated.
- ``access_file`` (default None: protected mode, loopback peers only) and the ``ssl_*``
  files: see ``service/access.py`` and docs/security.md. A key file may be omitted when the
  certificate file also holds the key (as uvicorn allows).
- ``max_batch_wait_ms`` (default 0) is how long the batcher may wait for more requests once
  it has one: 0 means "take whatever is queued when the engine becomes free", which already
  forms large batches under load and adds no latency when idle.
- ``gc_freeze_ingest_bytes`` (default 64 MiB, about 35k stored 256-token entries; 0: never):
  after that many bytes of event bodies the service moves the live objects into the
  collector's permanent generation, so that full collections stop walking the directory
  (docs/service.md). One default for ``serve`` and for an app built in-process.
  ``release_free_heap`` (default on) makes each such freeze also return the C allocator's
  free pages to the OS (``service/heap.py``: 47-67 B less resident per chunk at 1M chunks).

- ``max_placements_per_match`` (default 16) and ``max_placement_answer_bytes`` (default
  4 MiB) bound a lookup's ``include_placements`` answer (``service/routing.py``,
  docs/routing.md). 16 copies: the requester's own, then enough live peers and pools for a
  router to spread load over (a router picks one; more than 16 candidates for one chunk
  adds bytes, not choice), about 1.1 KB per match. 4 MiB: 16 copies for every match of a
  request of about 3,900 aligned 256-token chunks (a 1M-token request, the default
  ``max_request_tokens``), and about 0.4 s of a 100 Mbit/s link; one shared prompt held by
  1,000 instances had made one 200-chunk answer 11 MB.

- ``max_header_bytes``, ``header_timeout``, ``body_timeout``, ``max_connections`` and
  ``max_bytes_in_flight`` bound what hostile or broken clients can hold: see
  ``service/limits.py`` and docs/security.md.

Each field is also a ``serve`` flag: see the class docstring and ``service/flags.py``.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blendmatch.gpu import EngineName
from blendmatch.index.token_hasher import ALGORITHMS, DEFAULT_ALGORITHM, UnknownHashAlgorithm
from blendmatch.index.tokens import DEFAULT_MAX_REQUEST_TOKENS

__all__ = ["ServiceConfig", "LogLevel", "BODY_BYTES_PER_TOKEN", "BODY_SLACK_BYTES"]

LogLevel = Literal["critical", "error", "warning", "info", "debug"]

#: Body bytes allowed per token of ``max_request_tokens``: a JSON id of up to 10 digits plus
#: ", " separators is at most 12 bytes; 16 leaves room without allowing anything absurd.
BODY_BYTES_PER_TOKEN = 16
#: Fixed allowance for the JSON envelope (field names, namespaces, keys of event entries).
BODY_SLACK_BYTES = 1 << 20

# ``serve --help`` sections (``group`` of a field's ``json_schema_extra``).
_ACCESS = "access and TLS (docs/security.md)"
_UPSTREAM = "in front of an LMCache coordinator (docs/lmcache.md)"
_DURABILITY = "durability (docs/operations.md)"
_FLEET = "fleet transport (docs/fleet.md)"
_KV_EVENTS = "vLLM KV events for routers (docs/kv-events.md)"
_LIMITS = "HTTP limits, enforced while reading (docs/security.md)"


class ServiceConfig(BaseModel):
    """Everything ``blendmatch serve`` can be told. Immutable; see the module docstring.

    Each field is also its ``serve`` flag (``--field-name``; ``service/flags.py`` builds the
    parser from these definitions): ``description`` is the help text, the default is the
    flag's, and ``json_schema_extra`` may add ``lmcache`` (the LMCache equivalent; a value
    starting with ``--`` names the coordinator's flag), ``shown`` (the default as the help
    states it, when the value alone says little), ``group`` (the help section), ``metavar``,
    ``off`` (for a default-on bool: the help of its ``--disable-...`` twin) and
    ``flag: False`` (no flag). A new setting is a new field: its flag follows.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(default="0.0.0.0", description="address to bind", json_schema_extra={"lmcache": "--host"})
    port: int = Field(default=9300, ge=0, le=65535, description="TCP port", json_schema_extra={"lmcache": "--port"})
    chunk_size: int = Field(default=256, ge=1,
                            description="tokens per KV chunk (the match window); must equal the MP servers' "
                                        "--chunk-size", json_schema_extra={"lmcache": "--chunk-size"})
    blend_probe_stride: int = Field(default=1, ge=1,
                                    description="query positions between probes; 1 probes every position, for "
                                                "full recall", json_schema_extra={"lmcache": "--blend-probe-stride"})
    enable_blend_lookup: bool = Field(
        default=True, description="index chunk content for blend lookups",
        json_schema_extra={"lmcache": "--enable-blend-lookup, which is off by default there",
                           "off": "do not index content; blend lookups answer no matches",
                           "off_lmcache": "the coordinator's default"})
    hash_algorithm: str = Field(default=DEFAULT_ALGORITHM,
                                description="the fleet's token hash (LMCache's --hash-algorithm): "
                                            + ", ".join(ALGORITHMS) + "; resolves the token form of "
                                            "/directory/lookup to keys; must equal the MP servers'; vLLM's functions seed with "
                                            "PYTHONHASHSEED as vLLM does",
                                json_schema_extra={"lmcache": "--hash-algorithm"})
    engine: EngineName = Field(default="auto", description="probe engine: auto = the GPU if a trial launch "
                                                           "succeeds, else the CPU")
    # at most 2^31 - 1: the GPU engine's scans (CuPy) take lengths as a C int (docs/performance.md, "Memory, passes and failover")
    max_batch_tokens: int = Field(default=1 << 18, ge=1, le=2**31 - 1, description="token budget of one engine batch; one "
                                                                     "request's size disables batching")
    max_batch_wait_ms: float = Field(default=0.0, ge=0.0, le=10_000.0,
                                     description="once a lookup is queued, wait up to this long for more; 0 = "
                                                 "batch whatever is queued when the engine is free")
    max_request_tokens: int = Field(default=DEFAULT_MAX_REQUEST_TOKENS, ge=1,
                                    description="most tokens one request may carry (a batch: the sum); more is a 413")
    max_body_bytes: int | None = Field(default=None, ge=1024, description="largest request body; more is a 413",
                                       json_schema_extra={"shown": "16 bytes per --max-request-tokens token + 1 MiB"})
    engine_threads: int | None = Field(default=None, ge=1, description="threads of the CPU engine's parallel probe",
                                       json_schema_extra={"shown": "CPUs - 1, at least 1: the event loop keeps a core"})
    log_level: LogLevel = Field(default="info", description="log level",
                                json_schema_extra={"lmcache": "the LMCACHE_LOG_LEVEL environment variable"})
    access_log: bool = Field(default=False, description="log every request (costs CPU at high request rates)")
    health_check_interval: float = Field(
        default=10.0, ge=0.0, description="seconds between sweeps that expire silent instances; 0 disables",
        json_schema_extra={"lmcache": "--health-check-interval"})
    instance_timeout: float = Field(
        default=30.0, gt=0.0, description="seconds without a heartbeat after which an instance expires and its L1 "
                                          "placements are fenced", json_schema_extra={"lmcache": "--instance-timeout"})
    timeout_keep_alive: float = Field(
        default=10.0, gt=0.0,
        description="seconds idle HTTP connections stay open; keep it above the servers' heartbeat interval (5 s), "
                    "or heartbeats race the server closing the connection",
        json_schema_extra={"lmcache": "--timeout-keep-alive"})
    gc_freeze_ingest_bytes: int = Field(
        default=64 << 20, ge=0,
        description="after this many bytes of POST /events bodies, move the live objects into the collector's "
                    "permanent generation (about 35k stored 256-token entries per 64 MiB); 0 = never",
        json_schema_extra={"shown": "64 MiB"})
    release_free_heap: bool = Field(
        default=True,
        description="with each --gc-freeze-ingest-bytes freeze, also hand the C allocator's free pages back to "
                    "the OS (glibc malloc_trim, on the events thread between runs; service/heap.py)",
        json_schema_extra={"off": "keep them (the allocator's own policy)"})

    max_instances: int = Field(
        default=10_000, ge=1,
        description="distinct instance ids tracked (event cursors, registrations); a request that would add one "
                    "more is a 429 with nothing applied; ids leave when their instance deregisters or expires")
    cache_dir: str = Field(
        default="", description="folder of the compile cache (numba's files in DIR/numba); never inside the "
                                "installed package. blendmatch warmup --cache-dir DIR fills it ahead",
        json_schema_extra={"shown": "$BLENDMATCH_CACHE_DIR, else $XDG_CACHE_HOME/blendmatch, else "
                                    "~/.cache/blendmatch", "metavar": "DIR"})
    max_placements_per_match: int = Field(
        default=16, ge=1, le=1 << 16,
        description="with include_placements: usable copies listed per match, best first; the others are counted "
                    "in the match's placements_omitted (docs/routing.md)")
    max_placement_answer_bytes: int = Field(
        default=4 << 20, ge=1024,
        description="with include_placements: bytes of placements in one answer (a batch: all its queries); past "
                    "it later matches list none, count them in placements_omitted and say placements_truncated",
        json_schema_extra={"shown": "4 MiB"})

    # access and TLS (service/access.py, docs/security.md)
    access_file: str | None = Field(
        default=None,
        description="TOML access file: hashed API keys and CIDR allowlists per role (producer, reader, admin, "
                    "metrics); reloaded on SIGHUP. Without it: protected mode, only loopback peers are served",
        json_schema_extra={"shown": "none: protected mode", "group": _ACCESS, "metavar": "FILE"})
    ssl_certfile: str | None = Field(default=None, description="serve HTTPS with this certificate",
                                     json_schema_extra={"shown": "plain HTTP", "group": _ACCESS, "metavar": "PEM"})
    ssl_keyfile: str | None = Field(default=None, description="the certificate's private key",
                                    json_schema_extra={"shown": "none", "group": _ACCESS, "metavar": "PEM"})
    ssl_ca_certs: str | None = Field(default=None,
                                     description="require client certificates signed by these CAs (mutual TLS)",
                                     json_schema_extra={"shown": "none", "group": _ACCESS, "metavar": "PEM"})

    # running in front of an existing LMCache coordinator (service/upstream.py)
    upstream_coordinator: str = Field(
        default="", description="an existing LMCache coordinator to run in front of (http:// is assumed without "
                                "a scheme): endpoints not served here (quotas, pins, prefetch, eviction) are "
                                "proxied to it, events and registry calls are applied here and forwarded to it; "
                                "lookups never wait on it",
        json_schema_extra={"shown": "none", "group": _UPSTREAM, "metavar": "URL"})
    upstream_timeout: float = Field(default=5.0, gt=0.0,
                                    description="seconds one call to the upstream may take in all; a proxied call "
                                                "past it is a 504", json_schema_extra={"group": _UPSTREAM})
    upstream_connect_timeout: float = Field(
        default=2.0, gt=0.0, description="seconds to connect to the upstream; an unreachable upstream is a 502",
        json_schema_extra={"group": _UPSTREAM})
    upstream_queue_size: int = Field(default=10_000, ge=1,
                                     description="forwards waiting for the upstream; when full the oldest is "
                                                 "dropped and counted", json_schema_extra={"group": _UPSTREAM})
    upstream_queue_bytes: int = Field(default=256 << 20, ge=1,
                                      description="body bytes of the forwards waiting for the upstream; past it the "
                                                  "oldest are dropped and counted",
                                      json_schema_extra={"shown": "256 MiB", "group": _UPSTREAM})

    # HTTP limits enforced while reading (service/limits.py, docs/security.md)
    max_header_bytes: int = Field(default=64 << 10, ge=1024, le=16 << 20,
                                  description="bytes of one request's line and headers; more is a 431",
                                  json_schema_extra={"group": _LIMITS, "shown": "64 KiB"})
    header_timeout: float = Field(default=10.0, gt=0.0, le=300.0,
                                  description="seconds to receive a request's headers, from connect or its first "
                                              "byte; then a 408 (a connection that sent nothing is closed)",
                                  json_schema_extra={"group": _LIMITS})
    body_timeout: float = Field(default=30.0, gt=0.0, le=3600.0,
                                description="seconds to receive a request's whole body after its headers; then a 408",
                                json_schema_extra={"group": _LIMITS})
    max_connections: int = Field(default=1000, ge=1,
                                 description="open HTTP connections; one more is answered 503 and closed",
                                 json_schema_extra={"group": _LIMITS})
    max_bytes_in_flight: int = Field(default=256 << 20, ge=1 << 16,
                                     description="request body bytes held for unanswered requests plus response "
                                                 "bytes not yet read by clients, over all connections; more is a 503 "
                                                 "and close (a connection not reading its responses is aborted)",
                                     json_schema_extra={"group": _LIMITS, "shown": "256 MiB"})

    # durability (service/durability.py); LMCache 0.5.6's names and defaults for the first two
    checkpoint_path: str = Field(default="", description="checkpoint file, restored at start and written "
                                                         "periodically and on a clean stop; empty = off",
                                 json_schema_extra={"lmcache": "--checkpoint-path", "shown": "off",
                                                    "group": _DURABILITY})
    checkpoint_interval: float = Field(default=60.0, ge=0.0,
                                       description="seconds between checkpoints; 0 = only on a clean stop",
                                       json_schema_extra={"lmcache": "--checkpoint-interval", "group": _DURABILITY})
    require_checkpoint: bool = Field(default=False, description="exit non-zero instead of starting cold when the "
                                                                "checkpoint is missing, corrupt or of an unknown "
                                                                "version", json_schema_extra={"group": _DURABILITY})
    graceful_timeout: float = Field(default=30.0, gt=0.0,
                                    description="seconds a SIGTERM/SIGINT stop may take: drain, final checkpoint",
                                    json_schema_extra={"group": _DURABILITY})
    max_ready_lag: int = Field(default=1000, ge=0,
                               description="with events from a log: /readyz answers 503 while the lag exceeds this "
                                           "many records", json_schema_extra={"group": _DURABILITY})
    refuse_lookups_until_ready: bool = Field(
        default=False, description="answer lookups 503 until /readyz first says ready, instead of from a partly "
                                   "restored or caught-up index (on for --workers children: the kernel cannot route "
                                   "by readiness)", json_schema_extra={"group": _DURABILITY})

    # event transport (service/sources/kafka.py, docs/fleet.md); LMCache 0.5.6's names and
    # defaults for the first four
    event_transport: Literal["http", "kafka"] = Field(
        default="http", description="http: POST /events applies here; kafka: follow the topic, and POST /events "
                                    "and the registry calls append to it",
        json_schema_extra={"lmcache": "--event-transport", "group": _FLEET})
    kafka_bootstrap_servers: str = Field(
        default="", description="Kafka brokers, host:port[,host:port]; required with --event-transport kafka",
        json_schema_extra={"lmcache": "--kafka-bootstrap-servers", "shown": "none", "group": _FLEET})
    kafka_topic: str = Field(default="lmcache-cache-events", min_length=1,
                             description="cache-event topic; must match the MP servers' --coordinator-kafka-topic",
                             json_schema_extra={"lmcache": "--kafka-topic", "group": _FLEET})
    kafka_group_id: str = Field(default="lmcache-coordinator", min_length=1,
                                description="prefix of this replica's offset-commit group (<id>-<replica id>) and "
                                            "of the reaper-role group (<id>-reaper)",
                                json_schema_extra={"lmcache": "--kafka-group-id", "group": _FLEET})
    replica_id: str = Field(default="", description="this replica's name; keep it stable across restarts (a "
                                                    "StatefulSet pod name)",
                            json_schema_extra={"shown": "the host name", "group": _FLEET})
    kafka_reaper_topic: str = Field(default="", description="one-partition topic whose owner holds the reaper role",
                                    json_schema_extra={"shown": "<topic>-reaper", "group": _FLEET})
    kafka_session_timeout_ms: int = Field(default=10_000, ge=1000, le=300_000,
                                          description="the reaper role moves this long after its holder died",
                                          json_schema_extra={"group": _FLEET})
    kafka_produce_timeout: float = Field(
        default=5.0, gt=0.0, le=300.0, description="seconds POST /events and the registry calls wait for the broker to "
        "acknowledge their records; then a 503 (a producer that broke is replaced)",
        json_schema_extra={"group": _FLEET})
    on_log_reset: Literal["fail", "resync"] = Field(
        default="fail", description="when the broker lost records this replica applied (restarted empty, topic "
        "recreated, offsets rewound, fewer partitions): fail = stop following the log, /readyz and /healthz 503 "
        "with the reason, until an operator acts; resync = forget the index and registry and rebuild them from the "
        "new log's start (not ready meanwhile)", json_schema_extra={"group": _FLEET})
    kafka_create_topic: bool = Field(
        default=False, description="create --kafka-topic (one partition) when the broker does not have it; without "
        "this a missing topic is never created: /readyz answers 503 naming it, and appends 503, until it appears",
        json_schema_extra={"group": _FLEET})

    # the admitted stream republished as vLLM KV events (service/publish/,
    # docs/kv-events.md); vLLM's KVEventsConfig names and defaults
    kv_events_endpoint: str = Field(
        default="", description="ZMQ PUB endpoint for vLLM KV events (binds a wildcard or IPv6-any address, ipc:// "
        "and inproc://, else connects, as vLLM; beyond loopback only with the access file's [kv_events] "
        "grant)",
        json_schema_extra={"shown": "off", "group": _KV_EVENTS, "metavar": "ZMQ"})
    kv_events_replay_endpoint: str = Field(
        default="", description="ZMQ ROUTER endpoint (bound) answering replay requests",
        json_schema_extra={"shown": "no replay", "group": _KV_EVENTS, "metavar": "ZMQ"})
    kv_events_buffer_steps: int = Field(default=10_000, ge=1, description="messages kept for replay",
                                        json_schema_extra={"group": _KV_EVENTS})
    kv_events_hwm: int = Field(default=100_000, ge=0, description="ZMQ send high-water mark of the PUB socket",
                               json_schema_extra={"group": _KV_EVENTS})
    kv_events_max_queue_size: int = Field(
        default=100_000, ge=1, description="messages waiting to be sent; past it they are dropped (counted), "
        "never blocking ingest", json_schema_extra={"group": _KV_EVENTS})
    kv_events_encoding: Literal["map", "array"] = Field(
        default="map", description="map: tagged maps (newer vLLM: 0.30, 0.32, 0.33 checked); array: tagged arrays "
        "(older vLLM, e.g. 0.20)",
        json_schema_extra={"group": _KV_EVENTS})
    kv_events_int_hashes: bool = Field(
        default=False, description="block hashes as the low 64 bits (int), as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; "
        "else bytes", json_schema_extra={"group": _KV_EVENTS})
    kv_events_legacy_replay: bool = Field(
        default=False, description="replay answers without the topic frame (vLLM before #45177)",
        json_schema_extra={"group": _KV_EVENTS})
    # every KV-events buffer is bounded in bytes (docs/kv-events.md#bounds)
    kv_events_buffer_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1, description="bytes of messages kept for replay (with --kv-events-buffer-steps, "
        "whichever bites first): the oldest are dropped", json_schema_extra={"group": _KV_EVENTS})
    kv_events_max_queue_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1, description="bytes of token rows and hashes waiting to be sent (with "
        "--kv-events-max-queue-size); past it messages are dropped (counted, a seq gap), never blocking ingest",
        json_schema_extra={"group": _KV_EVENTS})
    kv_events_max_message_bytes: int = Field(
        default=256 * 1024, ge=4096, description="a batch whose events would exceed this is split into several "
        "messages (each its own seq)", json_schema_extra={"group": _KV_EVENTS})
    kv_events_subscriber_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1, description="bytes queued per slow PUB subscriber: the PUB socket's high-"
        "water mark becomes min(--kv-events-hwm, this / --kv-events-max-message-bytes) messages",
        json_schema_extra={"group": _KV_EVENTS})
    kv_events_replay_client_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1, description="bytes queued to one replay client and not yet taken by it; "
        "its replay waits past it", json_schema_extra={"group": _KV_EVENTS})
    kv_events_replay_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1, description="bytes queued to all replay clients together",
        json_schema_extra={"group": _KV_EVENTS})
    kv_events_max_replays: int = Field(
        default=8, ge=1, description="clients replaying at once; a request from one more is answered at once with "
        "the end-of-replay marker (counted as refused)", json_schema_extra={"group": _KV_EVENTS})
    kv_events_snapshot_page_blocks: int = Field(
        default=1024, ge=1, description="blocks per snapshot page (a snapshot: the holder set at one seq, asked on "
        "the replay socket; docs/kv-events.md#snapshots)", json_schema_extra={"group": _KV_EVENTS})
    kv_events_snapshot_page_bytes: int = Field(
        default=1024 * 1024, ge=4096, description="encoded bytes per snapshot page (a single block larger goes "
        "alone); snapshot clients share the replay byte budgets", json_schema_extra={"group": _KV_EVENTS})
    kv_events_max_snapshots: int = Field(
        default=2, ge=1, description="snapshots at once (each a forked writer); a request past it is answered "
        "at once with the end marker and an empty payload (counted as refused)",
        json_schema_extra={"group": _KV_EVENTS})

    @field_validator("hash_algorithm")
    @classmethod
    def _check_hash_algorithm(cls, name: str) -> str:
        if name not in ALGORITHMS:
            raise ValueError(str(UnknownHashAlgorithm(name)))
        return name

    @field_validator("upstream_coordinator")
    @classmethod
    def _check_upstream(cls, url: str) -> str:
        url = url.strip()
        if url and "://" not in url:
            url = f"http://{url}"  # host:port, as ``blendmatch lookup --url`` takes it
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, got {url!r}")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _check(self) -> "ServiceConfig":
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("ssl_keyfile needs ssl_certfile")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs (client certificates) needs ssl_certfile (the server's certificate)")
        if self.event_transport == "kafka" and not self.kafka_bootstrap_servers.strip():
            raise ValueError("--event-transport kafka needs --kafka-bootstrap-servers")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.max_body_bytes is None:
            object.__setattr__(self, "max_body_bytes",
                               self.max_request_tokens * BODY_BYTES_PER_TOKEN + BODY_SLACK_BYTES)
        if self.max_bytes_in_flight < self.max_body_bytes:
            raise ValueError(f"max_bytes_in_flight ({self.max_bytes_in_flight}) must be at least max_body_bytes "
                             f"({self.max_body_bytes}): a request of the largest allowed body could never be read")
        return self

    @property
    def effective_engine_threads(self) -> int:
        """``engine_threads``, or one less than the machine's CPUs (at least 1)."""
        if self.engine_threads is not None:
            return self.engine_threads
        return max(1, (os.cpu_count() or 2) - 1)

    @property
    def max_batch_wait_s(self) -> float:
        return self.max_batch_wait_ms / 1000.0
