"""Access control: protected mode, the role table, keys, allowlists, instance patterns, and
the six attacks of issue #11, each refused. In-process over ASGI with a chosen peer address
(``httpx.ASGITransport(client=...)``); the real-network version of protected mode is
``tests/test_service_netns.py``."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from blendmatch.service.access import (
    ROLES,
    ROUTE_POLICY,
    AccessControl,
    AccessFileError,
    AccessPolicy,
    hash_key,
    new_key,
    rule_for,
)
from blendmatch.service.app import create_app
from service_support import C, MODEL, b64, chunks, config, events, hash_of, metric_samples, store

pytestmark = pytest.mark.anyio

OUTSIDE = ("203.0.113.9", 40000)  # TEST-NET-3: never loopback
INT64_MAX = (1 << 63) - 1


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.asynccontextmanager
async def client_for(app, peer=OUTSIDE, key: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=peer)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as c:
        yield c


@contextlib.asynccontextmanager
async def running(app):
    async with app.router.lifespan_context(app):
        yield app


def sample_request(method: str, path: str) -> dict[str, Any]:
    """A well-formed request for each route of the table (so a pass is a 2xx or a 404 for a
    route not built yet, never a 4xx of the body)."""
    path = path.replace("{instance_id}", "gpu-a-1")
    body: Any = None
    if path == "/events":
        body = events(store("gpu-a-1", 1, chunks(1)))
    elif path.startswith("/directory/blend-lookup"):
        q = {"tokens_b64": b64(chunks(1)[0]), "model_name": MODEL}
        body = {"queries": [q]} if path.endswith("batch") else q
    elif path == "/directory/lookup":
        body = {"keys": [{"chunk_hash_hex": hash_of(0).hex(), "model_name": MODEL, "kv_rank": 1 << 24}]}
    elif path == "/instances" and method == "POST":
        body = {"instance_id": "gpu-a-1"}
    return {"method": method, "url": path, **({"json": body} if body is not None else {})}


# ---------------------------------------------------------------------------- protected mode
async def test_protected_mode_refuses_every_non_loopback_peer_except_health():
    app = create_app(config())
    async with running(app), client_for(app) as outside:
        for rule in ROUTE_POLICY:
            r = await outside.request(**sample_request(rule.method, rule.path))
            if rule.path in ("/healthz", "/readyz"):
                assert r.status_code != 403, rule
            else:
                assert r.status_code == 403, rule
                detail = r.json()["detail"]
                assert "protected mode" in detail and "--access-file" in detail and "docs/security.md" in detail
        r = await outside.get("/some/route/nobody/wrote")
        assert r.status_code == 403
        assert (await outside.get("/healthz")).json() == {"status": "healthy"}
        # the fast path is behind the check too: a well-formed lookup is refused, not answered
        r = await outside.post("/directory/blend-lookup", json={"token_ids": [1] * C, "model_name": MODEL})
        assert r.status_code == 403


@pytest.mark.parametrize("peer", [("127.0.0.1", 1), ("127.3.4.5", 1), ("::1", 1), ("::ffff:127.0.0.1", 1)])
async def test_protected_mode_serves_loopback(peer):
    app = create_app(config())
    async with running(app), client_for(app, peer) as local:
        assert (await local.get("/directory/keys")).status_code == 200
        assert (await local.post("/events", json=events(store("i", 1, chunks(1))))).json()["applied"] == 1


@pytest.mark.parametrize("peer", [("10.0.0.1", 1), ("::ffff:10.0.0.1", 1), ("testclient", 1), ("fe80::1%eth0", 1)])
async def test_protected_mode_refuses_other_and_odd_peers(peer):
    app = create_app(config())
    async with running(app), client_for(app, peer) as c:
        assert (await c.get("/metrics")).status_code == 403


# ---------------------------------------------------------------------------- roles
KEYS = {role: new_key() for role in ROLES}
LIMITED = new_key()  # producer for gpu-a-* only


def write_access_file(path: Path, extra: str = "") -> Path:
    text = "".join(f'[[key]]\nname = "{role}-key"\nsha256 = "{hash_key(k)}"\nroles = ["{role}"]\n\n'
                   for role, k in KEYS.items())
    text += (f'[[key]]\nname = "gpu-a"\nsha256 = "{hash_key(LIMITED)}"\nroles = ["producer", "reader"]\n'
             f'instances = ["gpu-a-*"]\n\n')
    text += extra
    path.write_text(text)
    return path


async def test_each_role_can_do_exactly_its_own_list(tmp_path):
    app = create_app(config(access_file=str(write_access_file(tmp_path / "access.toml"))))
    async with running(app):
        for role, key in KEYS.items():
            async with client_for(app, key=key) as c:
                for rule in ROUTE_POLICY:
                    r = await c.request(**sample_request(rule.method, rule.path))
                    if rule.open or role in rule.roles:
                        assert r.status_code not in (401, 403), (role, rule, r.text)
                    else:
                        assert r.status_code == 403, (role, rule)
                        assert "needs role" in r.json()["detail"]
                unknown = await c.get("/not/in/the/table")
                assert unknown.status_code == (404 if role == "admin" else 403)


async def test_with_an_access_file_loopback_has_only_what_the_file_grants(tmp_path):
    app = create_app(config(access_file=str(write_access_file(tmp_path / "a.toml"))))
    async with running(app), client_for(app, ("127.0.0.1", 5)) as local:
        assert (await local.get("/directory/keys")).status_code == 403
        assert (await local.get("/healthz")).status_code == 200


async def test_a_wrong_key_is_401_and_keys_are_not_stored_in_clear(tmp_path):
    path = write_access_file(tmp_path / "a.toml")
    assert all(k not in path.read_text() for k in KEYS.values())
    app = create_app(config(access_file=str(path)))
    async with running(app):
        for bad in ("nope", KEYS["admin"][:-1], KEYS["admin"] + "x"):
            async with client_for(app, key=bad) as c:
                r = await c.get("/directory/keys")
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        async with client_for(app) as c:
            r = await c.get("/directory/keys", headers={"authorization": "Basic YWRtaW46YWRtaW4="})
            assert r.status_code == 401


async def test_cidr_allowlist_grants_roles_without_headers(tmp_path):
    extra = '[[network]]\nname = "lmcache"\ncidrs = ["10.20.0.0/24", "fd00:20::/64"]\nroles = ["producer", "reader"]\n'
    app = create_app(config(access_file=str(write_access_file(tmp_path / "a.toml", extra))))
    async with running(app):
        for peer in (("10.20.0.7", 1), ("fd00:20::7", 1), ("::ffff:10.20.0.8", 1)):
            async with client_for(app, peer) as server:
                assert (await server.post("/events", json=events(store(f"s{peer[0]}", 1, chunks(1))))).status_code == 200
                r = await server.post("/directory/blend-lookup", json={"tokens_b64": b64(chunks(1)[0]), "model_name": MODEL})
                assert r.status_code == 200
                assert (await server.get("/directory/keys")).status_code == 403
        async with client_for(app, ("10.20.1.7", 1)) as other:
            assert (await other.post("/events", json=events())).status_code == 403
        # an operator's key from the same subnet adds admin to what the network grants
        async with client_for(app, ("10.20.0.7", 1), key=KEYS["admin"]) as op:
            assert (await op.get("/directory/keys")).status_code == 200
            assert (await op.post("/events", json=events())).status_code == 200


@pytest.mark.parametrize("text, needle", [
    ('[[key]]\nsha256 = "abc"\nroles = ["admin"]\n', "64 hex"),
    (f'[[key]]\nsha256 = "{"0" * 64}"\nroles = ["root"]\n', "roles"),
    (f'[[key]]\nsha256 = "{"0" * 64}"\nroles = ["reader"]\ninstances = ["a*"]\n', "no producer"),
    ('[[network]]\ncidrs = ["10.0.0.1/24"]\nroles = ["reader"]\n', "host bits"),
    ('[[network]]\ncidrs = ["10.0.0.0/24"]\nroles = ["reader"]\nextra = 1\n', "unknown fields"),
    ('[allow]\nx = 1\n', "unknown tables"),
    ('not toml [', "TOML"),
])
def test_bad_access_files_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(AccessFileError, match=needle):
        AccessPolicy.from_file(path)


async def test_reload_swaps_the_policy_and_a_bad_file_keeps_the_old(tmp_path, caplog):
    path = write_access_file(tmp_path / "a.toml")
    app = create_app(config(access_file=str(path)))
    fresh = new_key()
    async with running(app):
        async with client_for(app, key=fresh) as c:
            assert (await c.get("/metrics")).status_code == 401
            assert (await c.post("/events", json=events(store("keep", 1, chunks(1))))).status_code == 401
        control: AccessControl = app.access
        write_access_file(path, f'[[key]]\nname = "new"\nsha256 = "{hash_key(fresh)}"\nroles = ["metrics"]\n')
        assert control.reload()
        async with client_for(app, key=fresh) as c:
            assert (await c.get("/metrics")).status_code == 200
        path.write_text("broken [")
        with caplog.at_level(logging.ERROR):
            assert not control.reload()
        assert "previous policy stays in force" in caplog.text
        async with client_for(app, key=fresh) as c:
            assert (await c.get("/metrics")).status_code == 200
        async with client_for(app, key=KEYS["admin"]) as c:  # state survived both reloads
            assert (await c.get("/directory/stats")).status_code == 200


def test_route_table_matches_templates_and_denies_by_default():
    assert rule_for("GET", "/instances/usage")[0].path == "/instances/usage"
    assert rule_for("GET", "/instances/x/usage")[0].path == "/instances/{instance_id}/usage"
    rule, params = rule_for("PUT", "/instances/gpu-a-1/heartbeat")
    assert rule.roles == {"producer"} and params == {"instance_id": "gpu-a-1"}
    assert rule_for("PUT", "/instances/a/b/heartbeat")[0].roles == {"admin"}
    assert rule_for("PATCH", "/events")[0].roles == {"admin"}
    assert rule_for("GET", "/healthz")[0].open and rule_for("GET", "/readyz")[0].open


# ---------------------------------------------------------------------------- the six attacks
async def test_attack_1_listing_every_tenants_keys_is_refused(tmp_path):
    app = create_app(config(access_file=str(write_access_file(tmp_path / "a.toml"))))
    async with running(app):
        for key in (None, KEYS["reader"], KEYS["producer"], KEYS["metrics"], LIMITED):
            async with client_for(app, key=key) as c:
                assert (await c.get("/directory/keys")).status_code == 403


async def test_attack_2_token_ids_only_reach_admin(tmp_path):
    app = create_app(config(access_file=str(write_access_file(tmp_path / "a.toml"))))
    async with running(app):
        rows = chunks(1, seed=7)
        async with client_for(app, key=KEYS["producer"]) as p:
            assert (await p.post("/events", json=events(store("s1", 1, rows, salt="tenant-a")))).status_code == 200
        lookup = sample_request("POST", "/directory/lookup")
        lookup["json"]["keys"][0]["cache_salt"] = "tenant-a"
        for key in (KEYS["reader"], KEYS["producer"], KEYS["metrics"]):
            async with client_for(app, key=key) as c:
                assert (await c.request(**lookup)).status_code == 403
        async with client_for(app, key=KEYS["reader"]) as reader:  # lookups answer positions, never tokens
            r = await reader.post("/directory/blend-lookup", json={"tokens_b64": b64(rows[0]), "model_name": MODEL,
                                                                    "cache_salt": "tenant-a"})
            assert r.status_code == 200 and set(r.json()["matches"][0]) == {"chunk_hash", "old_st", "cur_st"}
        async with client_for(app, key=KEYS["admin"]) as admin:
            got = (await admin.request(**lookup)).json()["results"][0]["token_ids"]
            assert got == rows[0].tolist()


async def test_attack_3_planting_chunks_needs_producer_and_the_right_instance(tmp_path):
    app = create_app(config(access_file=str(write_access_file(tmp_path / "a.toml"))))
    async with running(app):
        plant = events(store("gpu-a-1", 1, chunks(1)), store("gpu-b-1", 1, chunks(1, seed=3), salt="tenant-b"))
        for key in (None, KEYS["reader"], KEYS["metrics"], KEYS["admin"]):
            async with client_for(app, key=key) as c:
                assert (await c.post("/events", json=plant)).status_code == 403
        async with client_for(app, key=LIMITED) as a:
            r = await a.post("/events", json=plant)
            assert r.status_code == 403 and "body.batches.1.instance_id" in r.json()["detail"]
            assert (await a.post("/events", json=events(plant["batches"][0]))).json()["applied"] == 1
        assert app.state.blendmatch_context.directory.stats()["keys"] == 1  # nothing of the refused body


async def test_attack_4_a_forged_incarnation_is_refused_and_an_admin_can_undo_one(tmp_path):
    app = create_app(config(access_file=str(write_access_file(tmp_path / "a.toml"))))
    forged = events(store("gpu-b-1", 1, chunks(1), incarnation=INT64_MAX))
    honest = events(store("gpu-b-1", 2, chunks(1, seed=5), incarnation=3))
    async with running(app):
        async with client_for(app, key=LIMITED) as a:  # server A cannot fence server B
            assert (await a.post("/events", json=forged)).status_code == 403
            r = await a.put("/instances/gpu-b-1/heartbeat")
            assert r.status_code == 403 and "gpu-b-1" in r.json()["detail"]
        async with client_for(app, key=KEYS["producer"]) as p:  # an unrestricted producer can
            assert (await p.post("/events", json=forged)).json()["applied"] == 1
            assert (await p.post("/events", json=honest)).json()["stale"] == 1
        async with client_for(app, key=KEYS["admin"]) as admin:  # the documented undo: delete
            assert (await admin.delete("/instances/gpu-b-1")).status_code == 204
        async with client_for(app, key=KEYS["producer"]) as p:
            assert (await p.post("/events", json=honest)).json()["applied"] == 1
        cursors = app.state.blendmatch_context.directory.stats()
        assert json.dumps(cursors).find(str(INT64_MAX)) == -1


async def test_attack_5_deleting_instances_needs_admin(tmp_path):
    app = create_app(config(access_file=str(write_access_file(tmp_path / "a.toml"))))
    async with running(app):
        async with client_for(app, key=KEYS["producer"]) as p:
            await p.post("/events", json=events(store("victim", 1, chunks(2))))
        for key in (None, KEYS["reader"], KEYS["producer"], KEYS["metrics"], LIMITED):
            async with client_for(app, key=key) as c:
                assert (await c.delete("/instances/victim")).status_code == 403
        assert app.state.blendmatch_context.directory.stats()["keys"] == 2


async def test_attack_6_control_characters_never_reach_a_log_line(caplog):
    app = create_app(config())
    forged = "x\n2030-01-01 00:00:00,000 ERROR blendmatch: forged\x1b[31m"
    async with running(app), client_for(app, ("127.0.0.1", 1)) as local:
        with caplog.at_level(logging.DEBUG):
            assert (await local.delete("/instances/x%0A2030-01-01%20ERROR%20forged%1b")).status_code == 204
            await local.post("/events", json=events(store(forged, 5, chunks(1))))  # a gap: logged
            await local.post("/events", json=events(store(forged, 6, chunks(1), incarnation=2)))  # a restart
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("deregistered instance x\\x0a2030" in m for m in messages), messages
    assert any("gap before seq 5" in m and "x\\x0a2030" in m for m in messages), messages
    assert any("restarted" in m and "\\x1b[31m" in m for m in messages), messages
    for m in messages:
        assert "\n" not in m and "\x1b" not in m and "\r" not in m, m


def test_log_safe_escapes_and_bounds():
    from blendmatch.index.logsafe import log_safe

    assert log_safe("plain-id_1.2") == "plain-id_1.2"
    assert log_safe("a\nb\r\x00\x1b\u2028\\") == "a\\x0ab\\x0d\\x00\\x1b\\u2028\\\\"
    assert log_safe("é漢") == "é漢"
    assert log_safe("x" * 1000).endswith("...(+800)") and len(log_safe("x" * 1000)) < 220


async def test_salts_never_appear_in_metrics_or_logs(caplog):
    app = create_app(config())
    salt = "tenant-secret-salt-42"
    async with running(app), client_for(app, ("127.0.0.1", 1)) as local:
        with caplog.at_level(logging.DEBUG):
            rows = chunks(2, seed=9)
            await local.post("/events", json=events(store("i", 1, rows, salt=salt), store("i", 5, rows, salt=salt)))
            await local.post("/directory/blend-lookup", json={"tokens_b64": b64(rows[0]), "model_name": MODEL,
                                                             "cache_salt": salt})
            await local.post("/directory/blend-lookup", json={"tokens_b64": "!!", "model_name": MODEL, "cache_salt": salt})
            text = (await local.get("/metrics")).text
    assert salt not in text and salt not in caplog.text
    assert metric_samples(text)["blendmatch_http_rejected_total{status=\"422\"}"] >= 1


async def test_denials_are_counted(tmp_path):
    app = create_app(config())
    async with running(app):
        async with client_for(app) as outside:
            for _ in range(3):
                await outside.get("/metrics")
        async with client_for(app, ("127.0.0.1", 1)) as local:
            samples = metric_samples((await local.get("/metrics")).text)
    assert samples['blendmatch_http_rejected_total{status="403"}'] == 3


def test_lookups_never_decode_tokens_for_a_refused_peer():
    """The check runs before the body is read: a refused request costs one dict lookup."""
    app = create_app(config())
    read = []

    async def receive():
        read.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    import asyncio

    scope = {"type": "http", "method": "POST", "path": "/directory/blend-lookup", "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"2")], "client": OUTSIDE, "query_string": b""}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 403 and not read
