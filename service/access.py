"""Who may call what: roles, hashed API keys, CIDR allowlists, and the one place they are checked.

Question answered: "may this peer, with these headers, call this method on this path?"

Modes (stated in the service's first log line, :meth:`AccessPolicy.describe`):

- **protected** (no ``--access-file``; like Redis's protected mode): loopback peers
  (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104) hold every role; any other peer gets 403 with a
  body that says how to grant access. ``pip install . && blendmatch serve`` is therefore
  safe on any network, even though it binds 0.0.0.0.
- **access file** (``--access-file FILE``, TOML, format below): only what the file grants.
  Loopback gets nothing implicitly; list ``127.0.0.0/8`` in a ``[[network]]`` to keep it.

Roles (what each may call is :data:`ROUTE_POLICY`, the single table; docs/security.md):
``producer`` (events, instance register/heartbeat), ``reader`` (blend lookups), ``admin``
(directory contents, token ids, instance listing/deletion, checkpoints, and every route the
table does not name: deny by default), ``metrics`` (``/metrics``, stats, usage). A credential
may carry several roles. ``/healthz`` and ``/readyz`` are open.

Credentials, combined per request (the union of what the peer address and the key grant):

- bearer API keys (``Authorization: Bearer <key>``), stored as SHA-256 hex digests, never in
  clear; the presented key's digest is compared with every stored digest with
  ``hmac.compare_digest`` (no early exit), so timing says nothing about which key or how
  much of it matched. Keys are random 256-bit strings (``blendmatch access-key``), so a fast
  hash is enough: there is no password to brute-force. A key that matches nothing is a 401.
- CIDR allowlists per role, because LMCache's MP servers and clients send no headers: an
  allowlist of the servers' subnet is the drop-in path for an LMCache fleet.

A ``producer`` grant may be limited to instance-id patterns (``fnmatch``, case-sensitive):
every batch of ``POST /events`` and the id of every registry call must match, so one server
cannot fence (a forged incarnation) or forge another's placements. :func:`instance_filter`
gives a route the check for the current request.

Cost per request: one dict lookup for the route (templated routes: a few regexes), one dict
lookup of the peer address (its grants are computed once per address and cached), and a
SHA-256 only when an ``Authorization`` header is present.

Access file::

    [[key]]
    name = "ops-alice"                  # for logs and 403 bodies; never the key itself
    sha256 = "<64 hex digits>"          # sha256 of the key (blendmatch access-key prints it)
    roles = ["admin", "metrics"]

    [[key]]
    name = "gpu-a"
    sha256 = "..."
    roles = ["producer", "reader"]
    instances = ["gpu-a-*"]             # optional: producer calls only for these instance ids

    [[network]]
    name = "lmcache-servers"
    cidrs = ["10.20.0.0/24", "fd00:20::/64"]
    roles = ["producer", "reader"]

    [kv_events]                         # optional (docs/kv-events.md)
    expose = true                       # allow KV-events endpoints beyond loopback
    curve_secret_key_file = "server.key_secret"   # optional: CurveZMQ (zmq.auth certificate)
    curve_clients_dir = "clients/"      # optional: only these clients' public keys may connect

The ``[kv_events]`` table is read when the server starts (its sockets exist from then on);
a SIGHUP reload does not rebind them.

Reloaded on SIGHUP (``AccessControl.reload``): a file that does not load leaves the old policy
in force and is logged; no state is dropped either way.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Optional, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from blendmatch.index.logsafe import log_safe

from .http_rules import json_body, send_json

import tomllib

__all__ = [
    "ROLES",
    "Role",
    "OPEN",
    "ROUTE_POLICY",
    "RouteRule",
    "Grant",
    "AccessPolicy",
    "AccessFileError",
    "AccessControl",
    "Refusal",
    "rule_for",
    "instance_filter",
    "hash_key",
    "new_key",
    "SCOPE_KEY",
]

log = logging.getLogger(__name__)

Role = Literal["producer", "reader", "admin", "metrics"]
#: Every role, in the order documented.
ROLES: tuple[Role, ...] = ("producer", "reader", "admin", "metrics")
#: Roles of a rule that anyone may call.
OPEN: frozenset[str] = frozenset()
_ANY: frozenset[str] = frozenset(ROLES)

#: Key under which the request's grants travel in the ASGI scope (read by the routes).
SCOPE_KEY = "blendmatch.access"


@dataclasses.dataclass(frozen=True)
class RouteRule:
    """One row of the policy: ``method path`` may be called by any of ``roles`` (empty: open).
    ``instance_param``: the path parameter holding an instance id that a producer grant
    limited to instance patterns must match."""

    method: str
    path: str
    roles: frozenset[str]
    instance_param: Optional[str] = None

    @property
    def open(self) -> bool:
        return not self.roles


def _rule(method: str, path: str, *roles: str, instance_param: str | None = None) -> RouteRule:
    return RouteRule(method, path, frozenset(roles), instance_param)


#: THE route -> role table, by method and path pattern. Routes that do not exist yet are listed
#: so that they are protected the moment they land (the instance registry, /readyz,
#: checkpoints). Anything not listed needs ``admin`` (deny by default).
ROUTE_POLICY: tuple[RouteRule, ...] = (
    # open: liveness and readiness probes carry no data
    _rule("GET", "/healthz"),
    _rule("GET", "/readyz"),
    # producer: the cache-event stream and the instance registry's own calls
    _rule("POST", "/events", "producer"),
    _rule("POST", "/instances", "producer"),
    _rule("PUT", "/instances/{instance_id}/heartbeat", "producer", instance_param="instance_id"),
    # reader: blend lookups answer chunk hashes and positions, never token ids
    _rule("POST", "/directory/blend-lookup", "reader"),
    _rule("POST", "/directory/blend-lookup/batch", "reader"),
    _rule("POST", "/route/score", "reader"),  # counts of tokens per instance: a lookup's information
    # admin: tenants' keys and token ids (prompt text), fleet membership, deletion, checkpoints
    _rule("POST", "/directory/lookup", "admin"),
    _rule("GET", "/directory/keys", "admin"),
    _rule("GET", "/instances", "admin"),
    _rule("DELETE", "/instances/{instance_id}", "admin"),
    _rule("POST", "/admin/checkpoint", "admin"),
    _rule("GET", "/admin/checkpoint", "admin"),
    # metrics: counts only (no keys, no tokens, no salts)
    _rule("GET", "/metrics", "metrics"),
    _rule("GET", "/directory/stats", "metrics", "admin"),
    _rule("GET", "/instances/usage", "metrics", "admin"),
    _rule("GET", "/instances/{instance_id}/usage", "metrics", "admin"),
    # the HTTP contract itself: any role (it is committed as docs/openapi.json anyway)
    _rule("GET", "/openapi.json", *ROLES),
    _rule("GET", "/docs", *ROLES),
    _rule("GET", "/docs/oauth2-redirect", *ROLES),
    _rule("GET", "/redoc", *ROLES),
)

_DEFAULT_RULE = RouteRule("*", "*", frozenset({"admin"}))
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _compile(rules: Sequence[RouteRule]) -> tuple[dict[tuple[str, str], RouteRule],
                                                   list[tuple[str, re.Pattern[str], RouteRule]]]:
    exact: dict[tuple[str, str], RouteRule] = {}
    templated: list[tuple[str, re.Pattern[str], RouteRule]] = []
    for r in rules:
        if "{" not in r.path:
            exact[(r.method, r.path)] = r
            continue
        parts = _PARAM.split(r.path)  # literal, name, literal, name, ..., literal
        pattern = "".join(re.escape(x) if i % 2 == 0 else f"(?P<{x}>[^/]+)" for i, x in enumerate(parts))
        templated.append((r.method, re.compile(f"^{pattern}$"), r))
    return exact, templated


_EXACT, _TEMPLATED = _compile(ROUTE_POLICY)


def rule_for(method: str, path: str) -> tuple[RouteRule, dict[str, str]]:
    """The rule for ``method path`` and the path parameters it captured. Exact paths win over
    templates, so ``GET /instances/usage`` is its own rule, never ``/instances/{instance_id}/...``."""
    hit = _EXACT.get((method, path))
    if hit is not None:
        return hit, {}
    for m, pattern, r in _TEMPLATED:
        if m == method:
            found = pattern.match(path)
            if found is not None:
                return r, found.groupdict()
    return _DEFAULT_RULE, {}


# ---------------------------------------------------------------------------- credentials
@dataclasses.dataclass(frozen=True)
class Grant:
    """What one credential (a key, a network entry, loopback in protected mode) grants.
    ``instances``: fnmatch patterns a producer call's instance id must match; None = any."""

    name: str
    roles: frozenset[str]
    instances: Optional[tuple[str, ...]] = None

    def may_produce_for(self, instance_id: str) -> bool:
        if "producer" not in self.roles:
            return False
        if self.instances is None:
            return True
        return any(fnmatch.fnmatchcase(instance_id, p) for p in self.instances)


class AccessFileError(ValueError):
    """The access file does not load: names the file, the entry and the field."""


def hash_key(key: str) -> str:
    """The SHA-256 hex digest stored in the access file for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random API key (256 bits, URL-safe)."""
    return "bm_" + secrets.token_urlsafe(32)


_LOOPBACK = Grant("loopback (protected mode)", _ANY)
_MAX_PEER_CACHE = 65_536


def _is_loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def _parse_ip(host: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not isinstance(host, str):
        return None
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


class AccessPolicy:
    """An immutable, loaded policy (protected mode, or one access file). Thread-safe reads."""

    def __init__(self, *, source: str | None, keys: Sequence[tuple[bytes, Grant]] = (),
                 networks: Sequence[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, Grant]] = (),
                 kv_events: Optional[Mapping[str, Any]] = None) -> None:
        self.source = source
        #: the ``[kv_events]`` table: ``expose``, ``curve_secret_key_file``, ``curve_clients_dir``
        self.kv_events: dict[str, Any] = dict(kv_events or {})
        self.keys = tuple(keys)
        self.networks = tuple(networks)
        self._peer_cache: dict[str, tuple[tuple[Grant, ...], frozenset[str]]] = {}

    @property
    def protected(self) -> bool:
        """True in protected mode (no access file: loopback only)."""
        return self.source is None

    @classmethod
    def protected_mode(cls) -> "AccessPolicy":
        return cls(source=None)

    @classmethod
    def from_file(cls, path: str | Path) -> "AccessPolicy":
        """Load an access file (format in the module docstring). Raises AccessFileError."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise AccessFileError(f"access file {p}: cannot read it ({exc.strerror or exc})") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise AccessFileError(f"access file {p}: not valid TOML ({exc})") from None
        return cls.from_mapping(data, source=str(p))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str) -> "AccessPolicy":
        unknown = set(data) - {"key", "network", "kv_events"}
        if unknown:
            raise AccessFileError(f"access file {source}: unknown tables {sorted(unknown)} (expected [[key]], "
                                  f"[[network]], [kv_events])")
        kv_events = data.get("kv_events", {})
        if not isinstance(kv_events, dict):
            raise AccessFileError(f"access file {source}: kv_events must be a table ([kv_events])")
        _only(kv_events, {"expose", "curve_secret_key_file", "curve_clients_dir"}, f"access file {source}: [kv_events]")
        if not isinstance(kv_events.get("expose", False), bool):
            raise AccessFileError(f"access file {source}: [kv_events] expose must be true or false")
        for name in ("curve_secret_key_file", "curve_clients_dir"):
            if not isinstance(kv_events.get(name, ""), str):
                raise AccessFileError(f"access file {source}: [kv_events] {name} must be a path string")
        keys: list[tuple[bytes, Grant]] = []
        seen_digests: set[bytes] = set()
        for i, entry in enumerate(_table_list(data, "key", source)):
            where = f"access file {source}: [[key]] #{i + 1}"
            _only(entry, {"name", "sha256", "roles", "instances"}, where)
            digest_hex = entry.get("sha256")
            if not (isinstance(digest_hex, str) and re.fullmatch(r"[0-9a-fA-F]{64}", digest_hex)):
                raise AccessFileError(f"{where}: sha256 must be 64 hex digits (the key's SHA-256, from "
                                      f"`blendmatch access-key`), got {_show(digest_hex)}")
            digest = bytes.fromhex(digest_hex)
            if digest in seen_digests:
                raise AccessFileError(f"{where}: the same key is listed twice")
            seen_digests.add(digest)
            keys.append((digest, _grant(entry, where, default_name=f"key #{i + 1}")))
        networks: list[tuple[Any, Grant]] = []
        for i, entry in enumerate(_table_list(data, "network", source)):
            where = f"access file {source}: [[network]] #{i + 1}"
            _only(entry, {"name", "cidrs", "roles", "instances"}, where)
            cidrs = entry.get("cidrs")
            if not (isinstance(cidrs, list) and cidrs and all(isinstance(c, str) for c in cidrs)):
                raise AccessFileError(f"{where}: cidrs must be a non-empty list of strings, got {_show(cidrs)}")
            grant = _grant(entry, where, default_name=f"network #{i + 1}")
            for c in cidrs:
                try:
                    net = ipaddress.ip_network(c, strict=True)
                except ValueError as exc:
                    raise AccessFileError(f"{where}: cidrs: {exc}") from None
                networks.append((net, grant))
        return cls(source=source, keys=keys, networks=networks, kv_events=kv_events)

    def describe(self) -> str:
        """One line: the access mode (the service's first log line)."""
        if self.protected:
            return ("access: protected mode (no --access-file): only loopback peers are served; every other "
                    "peer gets 403 (see docs/security.md to grant access)")
        roles: dict[str, int] = {}
        for _, g in (*self.keys, *self.networks):
            for r in g.roles:
                roles[r] = roles.get(r, 0) + 1
        return (f"access: access file {self.source}: {len(self.keys)} API keys, {len(self.networks)} CIDR "
                f"allowlist entries; grants per role {json.dumps(dict(sorted(roles.items())))}; loopback has "
                f"only what the file grants")

    def peer_access(self, host: Any) -> tuple[tuple[Grant, ...], frozenset[str]]:
        """``(grants, union of their roles)`` of a peer address; computed once per address."""
        key = host if isinstance(host, str) else ""
        hit = self._peer_cache.get(key)
        if hit is not None:
            return hit
        addr = _parse_ip(host)
        if addr is None:
            grants: tuple[Grant, ...] = ()
        elif self.protected:
            grants = (_LOOPBACK,) if _is_loopback(addr) else ()
        else:
            grants = tuple(g for net, g in self.networks if addr.version == net.version and addr in net)
        if len(self._peer_cache) >= _MAX_PEER_CACHE:
            self._peer_cache.clear()
        entry = (grants, frozenset(r for g in grants for r in g.roles))
        self._peer_cache[key] = entry
        return entry

    def key_grant(self, key: str) -> Grant | None:
        """The grant of a presented API key, or None. Compares with every stored digest."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: Grant | None = None
        for stored, grant in self.keys:
            if hmac.compare_digest(stored, digest) and found is None:
                found = grant
        return found


def _table_list(data: Mapping[str, Any], name: str, source: str) -> list[dict[str, Any]]:
    raw = data.get(name, [])
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise AccessFileError(f"access file {source}: {name} must be an array of tables ([[{name}]])")
    return raw


def _only(entry: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = set(entry) - allowed
    if extra:
        raise AccessFileError(f"{where}: unknown fields {sorted(extra)} (allowed: {sorted(allowed)})")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _grant(entry: Mapping[str, Any], where: str, default_name: str) -> Grant:
    name = entry.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise AccessFileError(f"{where}: name must be a non-empty string, got {_show(name)}")
    roles = entry.get("roles")
    if not (isinstance(roles, list) and roles and all(r in ROLES for r in roles)):
        raise AccessFileError(f"{where}: roles must be a non-empty list of {list(ROLES)}, got {_show(roles)}")
    instances = entry.get("instances")
    if instances is not None:
        if not (isinstance(instances, list) and instances and all(isinstance(p, str) and p for p in instances)):
            raise AccessFileError(f"{where}: instances must be a non-empty list of fnmatch patterns, "
                                  f"got {_show(instances)}")
        if "producer" not in roles:
            raise AccessFileError(f"{where}: instances limits producer calls, but roles has no producer")
        instances = tuple(instances)
    return Grant(name, frozenset(roles), instances)


# ---------------------------------------------------------------------------- the check
def instance_filter(scope: Mapping[str, Any]) -> Callable[[str], bool] | None:
    """For a producer route: a predicate that says whether this request may act for an
    instance id, or None when it may act for any (the common case: no per-batch cost).
    Requests that never passed :class:`AccessControl` (in-process tests of a bare router)
    are unrestricted."""
    grants: tuple[Grant, ...] | None = scope.get(SCOPE_KEY)
    if grants is None:
        return None
    producers = [g for g in grants if "producer" in g.roles]
    if any(g.instances is None for g in producers):
        return None
    return lambda instance_id: any(g.may_produce_for(instance_id) for g in producers)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """What access control answers instead of the route: ``status`` (401 or 403), a
    ``detail`` for the JSON body, extra response headers."""

    status: int
    detail: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


class AccessControl:
    """Pure ASGI middleware, outermost (before the fast path and FastAPI), so that no route,
    present or future, is reachable without passing :data:`ROUTE_POLICY`.

    ``on_reject(status)`` counts each 401/403 answered here. The policy can be swapped at run
    time (:meth:`reload`, SIGHUP); a request sees one policy from start to end.
    """

    def __init__(self, app: ASGIApp, policy: AccessPolicy,
                 on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.policy = policy
        self._on_reject = on_reject

    def reload(self, path: str | Path | None = None) -> bool:
        """Re-read the access file (the current one unless ``path``). On failure the old
        policy stays in force and the error is logged. Returns whether it reloaded."""
        source = path if path is not None else self.policy.source
        if source is None:
            log.info("SIGHUP: protected mode has no access file to reload")
            return False
        try:
            policy = AccessPolicy.from_file(source)
        except AccessFileError as exc:
            log.error("access file not reloaded, the previous policy stays in force: %s", exc)
            return False
        self.policy = policy
        log.info("reloaded %s", policy.describe())
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        if kind != "http":  # no websocket routes exist; refuse rather than route
            await send({"type": "websocket.close", "code": 1008})
            return
        verdict = self.check(scope)
        if isinstance(verdict, Refusal):
            await self._reply(send, verdict.status, verdict.detail, verdict.headers)
            return
        if verdict is not None:
            scope[SCOPE_KEY] = verdict
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> "Refusal | tuple[Grant, ...] | None":
        """The policy's answer to an HTTP request, from its method, path, peer and headers:
        None for an open route (nothing checked), the grants that admit it, or the
        :class:`Refusal` to answer. The one decision of this layer: the lookup lane
        (``lane.py``) asks it too, and takes only what it admits."""
        method, path = scope["method"], scope["path"]
        rule, params = rule_for(method, path)
        if rule.open:
            return None
        policy = self.policy
        client = scope.get("client")
        host = client[0] if client else None
        grants, roles = policy.peer_access(host)
        key_name = "none"
        if policy.keys:
            token = _bearer(scope)
            if token is not None:
                grant = policy.key_grant(token)
                if grant is None:
                    return Refusal(401, "unauthorized: the bearer API key is not in the access file "
                                   "(was it revoked, or is the file not reloaded? see docs/security.md)",
                                   ((b"www-authenticate", b'Bearer realm="blendmatch"'),))
                key_name = grant.name
                grants, roles = (*grants, grant), roles | grant.roles
        if rule.roles.isdisjoint(roles):
            return Refusal(403, self._deny_detail(policy, method, path, rule, grants, host, key_name))
        if rule.instance_param is not None and "producer" in rule.roles:
            instance_id = params.get(rule.instance_param, "")
            allowed = [g for g in grants if g.roles & rule.roles]
            if not any("producer" not in g.roles or g.may_produce_for(instance_id) for g in allowed):
                return Refusal(403, f"forbidden: this credential may not act for instance "
                               f"{json.dumps(log_safe(instance_id))} (its instance patterns "
                               f"do not match; see docs/security.md)")
        return tuple(grants)

    @staticmethod
    def _deny_detail(policy: AccessPolicy, method: str, path: str, rule: RouteRule, grants: Iterable[Grant],
                     host: Any, key_name: str) -> str:
        need = " or ".join(sorted(rule.roles))
        if policy.protected:
            return (f"forbidden: blendmatch is in protected mode (started without --access-file), so it serves "
                    f"only loopback peers, and this request came from {host}. To grant access, start it with "
                    f"--access-file FILE listing API keys and/or CIDR allowlists per role (producer, reader, "
                    f"admin, metrics); see docs/security.md. {method} needs role {need}.")
        have = sorted({r for g in grants for r in g.roles})
        return (f"forbidden: this route needs role {need}; this request has roles {have} (peer {host}, API key "
                f"{key_name}). Grant it in the access file {policy.source} (a [[key]] or [[network]] entry; "
                f"docs/security.md), then send SIGHUP to reload.")

    async def _reply(self, send: Send, status: int, detail: str,
                     headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        if self._on_reject is not None:
            self._on_reject(status)
        await send_json(send, status, json_body({"detail": detail}), headers)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return ""  # present but not a bearer key: never matches -> 401
    return None
