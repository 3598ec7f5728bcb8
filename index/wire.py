"""Cache events: LMCache's ``POST /events`` wire shape and its fast validating parser.

Question answered: "is this request of cache events well formed, and what does it say?"
(Which batches to apply is the gate's question, ``gate.py``; the same shape as pydantic
models for the OpenAPI schema is ``wire_models.py``; token rules are ``tokens.py``.)

The wire shape (LMCache-compatible JSON; unknown fields are ignored so that newer senders
keep working)::

    {"batches": [{
        "instance_id": str (non-empty), "incarnation": int >= 0, "seq": int >= 1,
        "event_type": "store" | "delete" | "access" | "config",
        "tier": "l1" | "l2",                  # nothing else, "all" included
        "backend": str (non-empty except for access; default ""),
        "shared": bool = false, "ts": number >= 0 = 0,
        "capacity_bytes": int >= 0 = 0, "capacity_revision": int >= 0 = 0,
        "entries": [{                        # config batches carry none; default []
            "key": {"chunk_hash_hex": hex (even length, either case, 1..128 bytes),
                    "model_name": str (non-empty, no "@"),
                    "kv_rank": int in 0..2^32-1 (packed, see types.pack_kv_rank),
                    "object_group_id": int >= 0 = 0,
                    "cache_salt": str = "" (at most 128 chars, none of "@", "/", "\\", NUL)},
            "size_bytes": int >= 0 = 0,       # meaningful on store only
            "token_ids": [int, ...] = [],     # in-process also packed, see below
            "tokens_b64": str | null = null,  # ours, not LMCache's: see below
            "token_offset": int >= -1 = -1}]}]}

Capacity fields: LMCache 0.5.6's serializer writes ``capacity_bytes`` and
``capacity_revision`` (0 and 0) on *every* batch, so any non-negative value is accepted on
every event type; they mean something only on ``config`` batches (the directory's
declared-capacity rule). ``size_bytes`` defaults to 0 as in LMCache (its DELETE and ACCESS
entries carry 0; the value is ignored there). Rejected exactly as LMCache rejects them:
an empty ``instance_id``; an empty ``backend`` except on access batches; a config batch
with entries; a negative size, capacity, revision, incarnation or ``ts``; ``seq < 1``;
``tier`` other than ``l1``/``l2`` (``all`` included); ``token_offset < -1``; a bad key
(bad hex, ``@`` in the model name, a bad salt).

``tokens_b64`` (a blendmatch extension; LMCache senders send ``token_ids``): the entry's
token ids as standard base64 of little-endian uint32, the form the blend-lookup endpoint
takes, decoded by the same strict decoder (``tokens.decode_b64_many``): a character
outside ``A-Z a-z 0-9 + /`` (whitespace included), wrong padding, or a decoded length that
is not a multiple of 4 bytes is an error naming ``...tokens_b64``; a non-string is an error;
``""`` or ``null`` means no tokens. An entry gives ``token_ids`` or ``tokens_b64``, not both
non-empty (``give token_ids or tokens_b64, not both``). Otherwise it means exactly what the
same ids in ``token_ids`` mean. Why: over HTTP, parsing a 256-token entry's JSON list
costs about 22 us on the 2-core dev VM, parsing and decoding its base64 string about 7 us
(``pydantic_core.from_json`` through ``KeyDirectory.apply``, 1,000-entry batches: 30 us vs
12 us per entry in all, 33k vs 81k entries/s, measured side by side).

Packed tokens (in-process producers, a future binary transport): ``token_ids`` may also be
a 1-D numpy integer array or ``bytes`` of little-endian uint32 (4 bytes per id). JSON cannot
carry these, so the wire schema is unchanged; the same rules apply (ids outside uint32 leave
the binding unfilled, a non-integer dtype or a length that is not a multiple of 4 is an
error), and the batch's tokens are copied, so the producer may reuse its buffers.

How it is fast: the norm, LMCache's STORE entries in a body, never becomes Python objects
field by field: one ``nogil`` pass (``wire_scan.py``) parses every ``"entries"`` array from
the bytes straight into the columns below, and only the batch fields go to the JSON parser;
it takes only what it can say exactly, and hands anything else to the path described next.
There, validation is hand-written, because pydantic on 1,000 entries x 256 tokens
costs more than the whole ingest budget. A batch is checked column by column with C loops
(``map`` with ``itemgetter``, ``set``, ``sum``, ``min``/``max``; no Python statement per
entry), and its tokens are converted in one go: lists with ``array('I').fromlist`` (a C loop
that range-checks for free; it is bound by reading the Python ints, 1.5-3 us per 256-token
entry on the 2-core dev VM depending on how cold they are), packed tokens with one buffer
copy (no per-token work), ``tokens_b64`` strings with one call of the strict base64
decoder for the whole batch, whose arrays then take the packed path. Only a batch with something
unusual (a missing field, a bad value, a first-seen key scope, ids outside uint32, token
forms mixed in one batch, ``tokens_b64`` beside non-empty ``token_ids``) takes
the entry-by-entry path that names the bad field. The pydantic models in
``wire_models.py`` describe the same shape for OpenAPI; a test checks that both accept and
reject the same payloads.

Token ids outside ``0..2^32-1`` are *valid on the wire*: such an entry is applied (its
placement counts) but it fills no token binding (the directory logs a warning). Any other
non-integer token id is a validation error. Known leniency: JSON ``true``/``false`` inside
``token_ids`` read as 1/0 (bool is an int in Python; checking would cost a Python loop).

Errors: :class:`EventValidationError` (a ``ValueError``) names the field by its path,
e.g. ``batches[0].entries[3].key.chunk_hash_hex``. A request is validated whole before
anything is applied, so a bad batch rejects the request and nothing of it is applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .tokens import TokenArrays, split_token_arrays
from .wire_scan import EntrySplit, entry_columns, split_entries
from .types import whole_number
from .wire_entries import (_INTERN, _NO_TOKENS, INT64_MAX, KV_RANK_MAX, MAX_CACHE_SALT_CHARS,  # noqa: F401 - re-exported
                           MAX_CHUNK_HASH_BYTES, EntryColumns, KeyScope, TokenColumn, _Bad, _empty_entries, _int_reason,
                           _parse_entries, _type_name)

__all__ = [
    "EVENT_TYPES",
    "TIERS",
    "MAX_CHUNK_HASH_BYTES",
    "MAX_CACHE_SALT_CHARS",
    "EventValidationError",
    "KeyScope",
    "TokenColumn",
    "EntryColumns",
    "EventBatch",
    "EventRequest",
    "parse_event_request",
    "split_event_body",
    "parse_event_batch",
    "parse_event_body",
    "INT64_MAX",
    "KV_RANK_MAX",
]


EVENT_TYPES: tuple[str, ...] = ("store", "delete", "access", "config")
TIERS: tuple[str, ...] = ("l1", "l2")



class EventValidationError(ValueError):
    """A request of cache events is malformed; nothing of it was applied.

    ``field`` is the path of the bad value (``batches[0].entries[3].key.model_name``),
    ``loc`` the same as a tuple (``("batches", 0, "entries", 3, "key", "model_name")``, the
    shape FastAPI puts in a 422 body), ``reason`` what is wrong with it.
    """

    def __init__(self, loc: Sequence[str | int], reason: str) -> None:
        self.loc: tuple[str | int, ...] = tuple(loc)
        self.field: str = _loc_to_path(self.loc)
        self.reason: str = reason
        super().__init__(f"{self.field}: {reason}" if self.field else reason)


def _loc_to_path(loc: Sequence[str | int]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(f".{item}" if parts else item)
    return "".join(parts)


# --------------------------------------------------------------------------- batches


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One validated batch of cache events from one instance (see the module docstring).

    A ``shared`` batch reports placements in a shared pool (deduplicated across reporters);
    ``capacity_bytes``/``capacity_revision`` are carried on every batch (LMCache sends 0, 0)
    and mean something only on config batches.
    """

    instance_id: str
    incarnation: int
    seq: int
    event_type: str
    tier: str
    backend: str
    shared: bool
    ts: float
    entries: EntryColumns
    capacity_bytes: int = 0
    capacity_revision: int = 0


@dataclass(frozen=True, slots=True)
class EventRequest:
    """A validated ``POST /events`` body: the batches, in the order they are to be applied."""

    batches: tuple[EventBatch, ...]

    @property
    def num_entries(self) -> int:
        return sum(len(b.entries) for b in self.batches)


#: ``parse_event_body``'s default: split the token arrays out of the body itself.
_SPLIT_HERE: Any = object()


def split_event_body(raw: bytes) -> Optional[EntrySplit | TokenArrays]:
    """The first stage of :func:`parse_event_body`, for a caller that runs it elsewhere:
    the ``"entries"`` arrays taken out of ``raw`` as columns (``wire_scan.split_entries``),
    or where that pass gives up the ``token_ids`` arrays (``tokens.split_token_arrays``).
    Either runs without the GIL and builds no Python object per entry or token, so a Kafka
    replica splits run k+1 on its fetch thread while the apply thread validates and applies
    run k. Pass the result to ``parse_event_body(raw, arrays=...)``."""
    got = split_entries(raw)
    return got if got is not None else split_token_arrays(raw)


def parse_event_body(raw: bytes, *, arrays: Optional[EntrySplit | TokenArrays] = _SPLIT_HERE) -> EventRequest:
    """Decode and validate a raw ``POST /events`` body (JSON bytes) as a whole.

    The norm, LMCache's STORE entries, is parsed straight from the bytes into columns
    (``wire_scan.py``: no Python object per entry field or token, no GIL); the few batch
    fields left are decoded by pydantic-core's parser and validated by
    :func:`parse_event_request`. A body that pass does not take has its ``token_ids``
    arrays parsed straight into one uint32 buffer (``tokens.split_token_arrays``: no Python
    int per token) and the rest decoded by pydantic-core; either way with the same rules
    and the same errors as a body decoded whole. ``arrays``: what :func:`split_event_body`
    returned for ``raw``, when the split ran elsewhere. Raises :class:`EventValidationError`
    for a body that is not a valid request and a plain ``ValueError`` (from the JSON
    parser, with its message) for one that is not JSON.
    """
    from pydantic_core import from_json

    if arrays is _SPLIT_HERE:
        arrays = split_event_body(raw)
    if isinstance(arrays, EntrySplit):
        try:
            columns = entry_columns(arrays)
            payload = from_json(arrays.text)
        except (ValueError, _Bad):  # a scope the interner refuses, bad UTF-8, not JSON: as it is
            arrays = split_token_arrays(raw)
        else:
            return parse_event_request(payload, entries=columns)
    payload: Any = None
    if arrays is not None:
        try:
            payload = from_json(arrays.text)
        except ValueError:
            arrays = None  # not JSON: parse the body as sent, for the message's positions
    if arrays is None:
        payload = from_json(raw)
    return parse_event_request(payload, arrays=arrays)


def parse_event_request(payload: Any, *, arrays: Optional[TokenArrays] = None,
                        entries: Optional[list[EntryColumns]] = None) -> EventRequest:
    """Validate a decoded ``POST /events`` body (``{"batches": [...]}``) as a whole.

    Raises :class:`EventValidationError` naming the first bad field; then nothing of the
    request may be applied. Already-parsed input (:class:`EventRequest`) is returned as is.
    ``arrays``: the payload was decoded from ``arrays.text`` (see :func:`parse_event_body`),
    so each ``token_ids`` value is an ordinal into it. ``entries``: the payload was decoded
    from ``wire_scan.split_entries``'s text, so each ``"entries"`` value is an ordinal into
    this list of already validated columns.
    """
    if isinstance(payload, EventRequest):
        return payload
    if type(payload) is not dict:
        raise EventValidationError((), f"request must be an object with 'batches', got {_type_name(payload)}")
    raw = payload.get("batches")
    if type(raw) is not list:
        reason = "is required" if raw is None else f"must be a list, got {_type_name(raw)}"
        raise EventValidationError(("batches",), reason)
    return EventRequest(tuple(parse_event_batch(b, loc=("batches", i), arrays=arrays, entries=entries)
                              for i, b in enumerate(raw)))


def parse_event_batch(raw: Any, *, loc: tuple = (), arrays: Optional[TokenArrays] = None,
                      entries: Optional[list[EntryColumns]] = None) -> EventBatch:
    """Validate one batch (the unit a log transport such as Kafka would carry).

    ``loc`` prefixes field paths in errors; ``arrays`` and ``entries`` as in
    :func:`parse_event_request`. Raises :class:`EventValidationError`.
    """
    if isinstance(raw, EventBatch):
        return raw
    try:
        return _parse_batch(raw, arrays, entries)
    except _Bad as bad:
        raise EventValidationError(tuple(loc) + bad.loc, bad.reason) from None


def _parse_batch(raw: Any, arrays: Optional[TokenArrays] = None,
                 entries_split: Optional[list[EntryColumns]] = None) -> EventBatch:
    if type(raw) is not dict:
        raise _Bad((), f"must be an object, got {_type_name(raw)}")
    instance_id = raw.get("instance_id")
    if type(instance_id) is not str or not instance_id:
        raise _Bad(("instance_id",), "must be a non-empty string" + _got(instance_id))
    incarnation = _required_int(raw, "incarnation", 0)
    seq = _required_int(raw, "seq", 1)
    event_type = raw.get("event_type")
    if event_type not in EVENT_TYPES or type(event_type) is not str:
        raise _Bad(("event_type",), f"must be one of {', '.join(EVENT_TYPES)}" + _got(event_type))
    tier = raw.get("tier")
    if tier not in TIERS or type(tier) is not str:
        raise _Bad(("tier",), f"must be one of {', '.join(TIERS)}" + _got(tier))
    backend = raw.get("backend", "")
    if type(backend) is not str:
        raise _Bad(("backend",), "must be a string" + _got(backend))
    if not backend and event_type != "access":
        raise _Bad(("backend",), f"must not be empty for {event_type} events")
    shared = raw.get("shared", False)
    if type(shared) is not bool:
        raise _Bad(("shared",), "must be a boolean" + _got(shared))
    ts = raw.get("ts", 0)
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise _Bad(("ts",), "must be a finite number >= 0" + _got(ts))
    capacity_bytes = _optional_int(raw, "capacity_bytes")
    capacity_revision = _optional_int(raw, "capacity_revision")
    raw_entries = raw.get("entries", _NO_TOKENS)
    if entries_split is not None and type(raw_entries) is int:  # an ordinal: that array, parsed
        raw_entries = entries_split[raw_entries] if len(entries_split[raw_entries]) else _NO_TOKENS
    if event_type == "config" and raw_entries == _NO_TOKENS:
        entries = _empty_entries()
    elif event_type == "config":
        raise _Bad(("entries",), "config batches carry no entries")
    elif type(raw_entries) is EntryColumns:
        entries = raw_entries
    else:
        entries = _parse_entries(raw_entries, arrays)
    return EventBatch(
        instance_id=_INTERN.name(instance_id), incarnation=incarnation, seq=seq,
        event_type=_INTERN.name(event_type), tier=_INTERN.name(tier), backend=_INTERN.name(backend),
        shared=shared, ts=float(ts), entries=entries,
        capacity_bytes=capacity_bytes, capacity_revision=capacity_revision,
    )


def _got(value: Any) -> str:
    return ", missing" if value is None else f", got {value!r}"[:100]


def _required_int(raw: dict, name: str, lo: int) -> int:
    value = whole_number(raw.get(name))
    if type(value) is not int or not lo <= value <= INT64_MAX:
        raise _Bad((name,), _int_reason(value, lo, INT64_MAX))
    return value


def _optional_int(raw: dict, name: str) -> int:
    """A non-negative integer field that defaults to 0 when absent. ``null`` is an error, as
    in LMCache's schema (an ``int`` field with a default is not nullable)."""
    value = whole_number(raw.get(name, 0))
    if type(value) is not int or not 0 <= value <= INT64_MAX:
        raise _Bad((name,), _int_reason(value, 0, INT64_MAX))
    return value


