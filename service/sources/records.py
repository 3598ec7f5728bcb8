"""What the fleet writes to and reads from the log: LMCache's cache-event records and our
registry control records.

Question answered: "which bytes does a record carry, and what does a replica do with one?"
Pure functions and plain data (no Kafka client), so the rules are testable without a broker;
:func:`split_run` and :func:`decode_run` take the client's message objects (their
``error``, ``headers`` and ``value``) and classify a consumed run.

Cache-event records are LMCache 0.5.6's (``KafkaCacheEventSink``): key = the batch's
``instance_id`` (UTF-8), value = ``{"batches": [batch]}`` in compact JSON with every field
present in LMCache's declaration order. :func:`lmcache_record_value` re-emits an HTTP
batch in that form (our ``tokens_b64`` entries are decoded into ``token_ids``), so a
LMCache coordinator following the same topic reads what we append.

Control records carry the instance registry (register, heartbeat, deregister) and the
reaper's expiry fences. They go to the *same* topic with the instance id as key, so they
land in the instance's partition and are totally ordered with its cache events (a fence
applies between the same two batches on every replica). They are told apart by the header
``blendmatch: registry``; LMCache's own coordinator has no header check and skips them as
undecodable (counted, harmless). Value: JSON ``{"op", "instance_id", "ts", ...}`` where
``ts`` is the producing replica's wall clock: every replica records *that* value as the
heartbeat time, so registries agree byte for byte whatever the apply time.

An expiry fence names the control record it judged stale (``last``: ``[partition,
offset]`` of the instance's last register/heartbeat record the reaper had applied). It
takes effect only if that is still the instance's last one when the fence is applied: a
heartbeat appended before the fence (in log order, identical on every replica) cancels it.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping, Optional

from blendmatch.index.tokens import decode_b64
from blendmatch.index.types import UNKNOWN_TOKEN_OFFSET
from blendmatch.index.wire import EventValidationError, parse_event_body, parse_event_request, split_event_body

__all__ = ["CONTROL_HEADER", "CONTROL_HEADER_VALUE", "CONTROL_OPS", "ControlRecordError", "control_value", "event_records",
           "decode_control", "decode_run", "is_control", "lmcache_record_value", "split_run"]

CONTROL_HEADER = "blendmatch"
CONTROL_HEADER_VALUE = b"registry"
CONTROL_OPS = ("register", "heartbeat", "deregister", "expire")


class ControlRecordError(ValueError):
    """A control record that does not decode (skipped and counted like any poison record)."""


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _entry(raw: Mapping[str, Any]) -> dict[str, Any]:
    key = raw["key"]
    if "tokens_b64" in raw and raw.get("tokens_b64") is not None:
        tokens = decode_b64(raw["tokens_b64"]).tolist()
    else:
        tokens = list(raw.get("token_ids") or [])
    return {"key": {"chunk_hash_hex": key["chunk_hash_hex"], "model_name": key["model_name"],
                    "kv_rank": key["kv_rank"], "object_group_id": key.get("object_group_id", 0),
                    "cache_salt": key.get("cache_salt", "")},
            "size_bytes": raw.get("size_bytes", 0), "token_ids": tokens,
            "token_offset": raw.get("token_offset", UNKNOWN_TOKEN_OFFSET)}


def lmcache_record_value(batch: Mapping[str, Any]) -> bytes:
    """One (already validated) batch as LMCache's Kafka record value ``{"batches":[batch]}``."""
    ts = batch.get("ts", 0.0)
    doc = {"instance_id": batch["instance_id"], "incarnation": batch["incarnation"], "seq": batch["seq"],
           "event_type": batch["event_type"], "tier": batch["tier"], "backend": batch["backend"],
           "entries": [_entry(e) for e in batch.get("entries") or ()], "shared": bool(batch.get("shared", False)),
           "ts": float(ts), "capacity_bytes": batch.get("capacity_bytes", 0),
           "capacity_revision": batch.get("capacity_revision", 0)}
    return _dumps({"batches": [doc]})


def is_control(headers: Optional[list[tuple[str, Optional[bytes]]]]) -> bool:
    """Whether a record's headers mark it as one of our control records."""
    if not headers:
        return False
    return any(k == CONTROL_HEADER and v == CONTROL_HEADER_VALUE for k, v in headers)


def control_value(op: str, instance_id: str, *, ts: Optional[float] = None, **fields: Any) -> bytes:
    """A control record's value (see the module docstring)."""
    if op not in CONTROL_OPS:
        raise ValueError(f"unknown control op {op!r}")
    return _dumps({"op": op, "instance_id": instance_id, "ts": time.time() if ts is None else float(ts), **fields})


def decode_control(value: Optional[bytes]) -> dict[str, Any]:
    """Decode and check a control record's value; raises :class:`ControlRecordError`."""
    try:
        doc = json.loads(value or b"")
    except ValueError as exc:
        raise ControlRecordError(f"not JSON: {exc}") from None
    if type(doc) is not dict:
        raise ControlRecordError("not an object")
    op, iid, ts = doc.get("op"), doc.get("instance_id"), doc.get("ts")
    if op not in CONTROL_OPS:
        raise ControlRecordError(f"unknown op {op!r}")
    if type(iid) is not str or not iid:
        raise ControlRecordError("instance_id must be a non-empty string")
    if type(ts) not in (int, float):
        raise ControlRecordError("ts must be a number")
    if op == "register":
        if type(doc.get("ip")) is not str or type(doc.get("http_port")) is not int:
            raise ControlRecordError("register needs ip (string) and http_port (integer)")
        if type(doc.get("metadata", {})) is not dict:
            raise ControlRecordError("metadata must be an object")
    if op == "expire":
        last = doc.get("last")
        if not (type(last) is list and len(last) == 2 and all(type(x) is int for x in last)):
            raise ControlRecordError("expire needs last = [partition, offset]")
    return doc


# ---------------------------------------------------------------------- a consumed run
def split_run(msgs: list) -> list[tuple[Any, str, Any]]:
    """The fetch thread's share of decoding: ``(message, kind, what)`` with kind
    ``fetch_error`` (the error), ``control`` or ``event`` (its token arrays, split out of
    the JSON without the GIL by ``wire.split_event_body``)."""
    out: list[tuple[Any, str, Any]] = []
    for m in msgs:
        err = m.error()
        if err is not None:
            out.append((m, "fetch_error", err))
        elif is_control(m.headers()):
            out.append((m, "control", None))
        else:
            out.append((m, "event", split_event_body(m.value() or b"")))
    return out

def decode_run(split: list[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
    """The rest of decoding, on the apply thread before it takes the lock: each event
    becomes its EventRequest, or ``skip`` with ``(reason, detail)``. The parser is
    ``POST /events``'s."""
    out: list[tuple[Any, str, Any]] = []
    for m, kind, what in split:
        if kind != "event":
            out.append((m, kind, what))
            continue
        try:
            out.append((m, "event", parse_event_body(m.value() or b"", arrays=what)))
        except EventValidationError as exc:  # nothing of the record applied
            out.append((m, "skip", ("invalid", str(exc))))
        except ValueError as exc:  # not JSON
            out.append((m, "skip", ("undecodable", str(exc))))
    return out


def event_records(payload: Any) -> list[tuple[bytes, bytes, None]]:
    """A ``POST /events`` body as the records the Kafka source appends: validated whole
    (raises ``EventValidationError`` -> 422, nothing appended), one LMCache record per batch
    keyed by its instance id. CPU work: call it off the event loop."""
    parse_event_request(payload)
    return [(str(b["instance_id"]).encode(), lmcache_record_value(b), None) for b in payload["batches"]]
