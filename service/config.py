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


class ServiceConfig(BaseModel):
    """Everything ``blendmatch serve`` can be told. Immutable; see the module docstring."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "0.0.0.0"
    port: int = Field(default=9300, ge=0, le=65535)
    chunk_size: int = Field(default=256, ge=1, description="tokens per KV chunk (the match window)")
    blend_probe_stride: int = Field(default=1, ge=1, description="query positions between probes")
    enable_blend_lookup: bool = Field(default=True, description="index chunk content for blend lookups")
    hash_algorithm: str = Field(default=DEFAULT_ALGORITHM,
                                description="the fleet's token hash (LMCache's --hash-algorithm): "
                                            + ", ".join(ALGORITHMS) + "; resolves the token form of "
                                            "/directory/lookup to keys")
    engine: EngineName = "auto"
    max_batch_tokens: int = Field(default=1 << 18, ge=1, description="token budget of one engine batch")
    max_batch_wait_ms: float = Field(default=0.0, ge=0.0, le=10_000.0)
    max_request_tokens: int = Field(default=DEFAULT_MAX_REQUEST_TOKENS, ge=1)
    max_body_bytes: int | None = Field(default=None, ge=1024, description="None: derived from max_request_tokens")
    engine_threads: int | None = Field(default=None, ge=1,
                                       description="CPU engine threads; None: one less than the CPUs (min 1)")
    log_level: LogLevel = "info"
    health_check_interval: float = Field(
        default=10.0, ge=0.0,
        description="seconds between registry sweeps that expire silent instances; 0 disables the reaper")
    instance_timeout: float = Field(
        default=30.0, gt=0.0, description="seconds without a heartbeat after which an instance expires")
    timeout_keep_alive: float = Field(
        default=10.0, gt=0.0,
        description="seconds an idle HTTP connection stays open; must exceed the servers' heartbeat interval "
                    "(LMCache: 5 s), or heartbeats race the server closing the connection")
    access_file: str | None = Field(
        default=None,
        description="TOML access file (API keys, CIDR allowlists per role; docs/security.md). None: protected "
                    "mode, only loopback peers are served")
    ssl_certfile: str | None = Field(default=None, description="serve HTTPS with this certificate (PEM)")
    ssl_keyfile: str | None = Field(default=None, description="private key of ssl_certfile (PEM)")
    ssl_ca_certs: str | None = Field(default=None,
                                     description="require client certificates signed by these CAs (PEM)")
    gc_freeze_ingest_bytes: int = Field(
        default=0, ge=0,
        description="after this many bytes of POST /events bodies, move the live objects into the "
                    "collector's permanent generation (0: never; `blendmatch serve` uses 64 MiB)")

    # durability (service/durability.py); LMCache 0.5.6's names and defaults for the first two
    checkpoint_path: str = Field(default="", description="checkpoint file; empty: no checkpoints")
    checkpoint_interval: float = Field(default=60.0, ge=0.0,
                                       description="seconds between checkpoints; 0: only on a clean stop")
    require_checkpoint: bool = Field(default=False, description="exit non-zero instead of a cold start when the "
                                                                "checkpoint is missing, corrupt or of another version")
    graceful_timeout: float = Field(default=30.0, gt=0.0,
                                    description="seconds a SIGTERM/SIGINT stop may take (drain, final checkpoint)")
    max_ready_lag: int = Field(default=1000, ge=0,
                               description="with events from a log: /readyz is 503 while the lag exceeds this")
    refuse_lookups_until_ready: bool = Field(
        default=False, description="answer lookups 503 until /readyz first says ready (the restore is done and the "
                                   "log caught up); set for --workers children, which no Service routes by readiness")

    # running in front of an existing LMCache coordinator (service/upstream.py)
    upstream_coordinator: str = Field(
        default="", description="URL of an LMCache coordinator to proxy unknown endpoints to and to forward "
                                "events and registry calls to; empty: none")
    upstream_timeout: float = Field(default=5.0, gt=0.0,
                                    description="seconds one call to the upstream coordinator may take in all")
    upstream_connect_timeout: float = Field(default=2.0, gt=0.0,
                                            description="seconds to connect to the upstream coordinator")
    upstream_queue_size: int = Field(default=10_000, ge=1,
                                     description="forwards waiting for the upstream; when full the oldest is dropped")
    upstream_queue_bytes: int = Field(default=256 << 20, ge=1,
                                      description="body bytes of the forwards waiting for the upstream; past it "
                                                  "the oldest are dropped")

    # event transport (service/sources/kafka.py, docs/fleet.md); LMCache 0.5.6's names and
    # defaults for the first four
    event_transport: Literal["http", "kafka"] = Field(
        default="http", description="http: POST /events applies; kafka: follow the topic (POST /events appends)")
    kafka_bootstrap_servers: str = Field(default="", description="required with event_transport kafka")
    kafka_topic: str = Field(default="lmcache-cache-events", min_length=1)
    kafka_group_id: str = Field(default="lmcache-coordinator", min_length=1,
                                description="prefix: offsets are committed under <group>-<replica id>, and "
                                            "the reaper role is held in <group>-reaper")
    replica_id: str = Field(default="", description="this replica's name in the fleet; empty: the host name")
    kafka_reaper_topic: str = Field(default="", description="one-partition topic whose owner holds the reaper "
                                                            "role; empty: <topic>-reaper")
    kafka_session_timeout_ms: int = Field(default=10_000, ge=1000, le=300_000,
                                          description="the reaper role moves this long after its holder died")

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
        if self.max_body_bytes is None:
            object.__setattr__(self, "max_body_bytes",
                               self.max_request_tokens * BODY_BYTES_PER_TOKEN + BODY_SLACK_BYTES)
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
