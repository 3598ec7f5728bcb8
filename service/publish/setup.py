"""The publisher as the service configures it: flags plus the access file's ``[kv_events]``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .publisher import KVEventsPublisher, KVEventsSettings

__all__ = ["build_publisher", "settings_from_config"]


def settings_from_config(config: Any) -> KVEventsSettings:
    """``ServiceConfig`` -> :class:`KVEventsSettings`; the grant and CurveZMQ paths come from
    the access file (paths relative to it). Raises ``AccessFileError`` for a bad file."""
    grant: dict[str, Any] = {}
    if config.access_file:
        from ..access import AccessPolicy

        grant = AccessPolicy.from_file(config.access_file).kv_events
    base = Path(config.access_file).parent if config.access_file else Path(".")

    def path(name: str) -> str | None:
        value = grant.get(name)
        return str(base / value) if value else None

    return KVEventsSettings(
        endpoint=config.kv_events_endpoint, replay_endpoint=config.kv_events_replay_endpoint or None,
        buffer_steps=config.kv_events_buffer_steps, hwm=config.kv_events_hwm, encoding=config.kv_events_encoding,
        int_hashes=config.kv_events_int_hashes, legacy_replay=config.kv_events_legacy_replay,
        max_queue=config.kv_events_max_queue_size, expose=bool(grant.get("expose", False)),
        curve_secret_key_file=path("curve_secret_key_file"), curve_clients_dir=path("curve_clients_dir"),
        buffer_bytes=config.kv_events_buffer_bytes, max_queue_bytes=config.kv_events_max_queue_bytes,
        max_message_bytes=config.kv_events_max_message_bytes, subscriber_bytes=config.kv_events_subscriber_bytes,
        replay_client_bytes=config.kv_events_replay_client_bytes, replay_bytes=config.kv_events_replay_bytes,
        max_replays=config.kv_events_max_replays, snapshot_page_blocks=config.kv_events_snapshot_page_blocks,
        snapshot_page_bytes=config.kv_events_snapshot_page_bytes, max_snapshots=config.kv_events_max_snapshots)


def build_publisher(config: Any, registry: Any = None) -> KVEventsPublisher:
    return KVEventsPublisher(settings_from_config(config), registry=registry)
