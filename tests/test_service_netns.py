"""Protected mode for real: a server bound to 0.0.0.0 in this network namespace, a client in a
network namespace of its own (a veth pair, addresses from TEST-NET-2, 198.51.100.0/24, that
exist only between the two ends). Nothing leaves the machine.

Needs root and iproute2 (``ip netns``); skipped with the reason otherwise. The same logic is
covered without namespaces through the ASGI scope (``tests/test_service_access.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn

from blendmatch.service.access import hash_key, new_key
from blendmatch.service.app import create_app
from service_support import chunks, config, events, store

HOST_ADDR, PEER_ADDR = "198.51.100.1", "198.51.100.2"
TAG = f"{os.getpid() % 100000}"
NS, VETH_HOST, VETH_PEER = f"bmsec{TAG}", f"bmh{TAG}", f"bmp{TAG}"

# The client, run inside the namespace: one request per line of argv[2:] ("METHOD PATH [json]").
CLIENT = r"""
import json, sys, urllib.request, urllib.error
base, out = sys.argv[1], []
for spec in sys.argv[2:]:
    method, path, *rest = spec.split(" ", 2)
    body = rest[0].encode() if rest else None
    headers = {"content-type": "application/json"} if body is not None else {}
    if rest and rest[0].startswith("KEY:"):
        headers, body = {"authorization": "Bearer " + rest[0][4:]}, None
    req = urllib.request.Request(base + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            out.append([r.status, r.read().decode()[:300]])
    except urllib.error.HTTPError as e:
        out.append([e.code, e.read().decode()[:300]])
print(json.dumps(out))
"""


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (ip netns) to build a second network namespace")
    setup = [("ip", "netns", "add", NS),
             ("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_PEER),
             ("ip", "link", "set", VETH_PEER, "netns", NS),
             ("ip", "addr", "add", f"{HOST_ADDR}/24", "dev", VETH_HOST),
             ("ip", "link", "set", VETH_HOST, "up"),
             ("ip", "netns", "exec", NS, "ip", "addr", "add", f"{PEER_ADDR}/24", "dev", VETH_PEER),
             ("ip", "netns", "exec", NS, "ip", "link", "set", VETH_PEER, "up"),
             ("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")]
    try:
        for cmd in setup:
            done = _run(*cmd)
            if done.returncode != 0:
                pytest.skip(f"cannot build the test namespace ({' '.join(cmd)}: {done.stderr.strip()})")
        yield NS
    finally:
        _run("ip", "link", "del", VETH_HOST)
        _run("ip", "netns", "del", NS)


class AnyAddressServer:
    """uvicorn on 0.0.0.0:<free port> in a thread (the default bind of ``blendmatch serve``)."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "AnyAddressServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def from_namespace(self, ns: str, *specs: str) -> list[list]:
        done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT,
                               f"http://{HOST_ADDR}:{self.port}", *specs], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


ENDPOINTS = ["GET /healthz", "GET /readyz", "GET /metrics", "GET /directory/stats", "GET /directory/keys",
             "GET /openapi.json", "GET /docs", "GET /instances", "GET /instances/usage",
             "POST /events " + json.dumps(events(store("x", 1, chunks(1)))),
             "POST /directory/blend-lookup " + json.dumps({"token_ids": [1, 2], "model_name": "m"}),
             "POST /directory/blend-lookup/batch " + json.dumps({"queries": []}),
             "POST /directory/lookup " + json.dumps({"keys": []}),
             "DELETE /instances/x", "PUT /instances/x/heartbeat", "POST /instances {}",
             "POST /admin/checkpoint {}"]


def test_protected_mode_refuses_a_real_non_loopback_peer(netns):
    with AnyAddressServer(create_app(config(host="0.0.0.0"))) as server:
        answers = server.from_namespace(netns, *ENDPOINTS)
    for spec, (status, body) in zip(ENDPOINTS, answers, strict=True):
        route = " ".join(spec.split(" ", 2)[:2])
        if route in ("GET /healthz", "GET /readyz"):
            assert status != 403, (route, status)
        else:
            assert status == 403, (route, status, body)
            assert "protected mode" in body and "--access-file" in body
    assert answers[0][0] == 200


def test_an_allowlisted_subnet_and_an_operator_key_get_exactly_their_roles(netns, tmp_path):
    key = new_key()
    access = tmp_path / "access.toml"
    access.write_text(f'[[network]]\nname = "lmcache-servers"\ncidrs = ["198.51.100.0/24"]\n'
                      f'roles = ["producer", "reader"]\n\n'
                      f'[[key]]\nname = "ops"\nsha256 = "{hash_key(key)}"\nroles = ["admin"]\n')
    with AnyAddressServer(create_app(config(host="0.0.0.0", access_file=str(access)))) as server:
        got = server.from_namespace(netns, ENDPOINTS[9], ENDPOINTS[10], "GET /directory/keys",
                                    f"GET /directory/keys KEY:{key}", "GET /metrics")
    assert [s for s, _ in got] == [200, 200, 403, 200, 403]
    assert json.loads(got[0][1])["applied"] == 1
