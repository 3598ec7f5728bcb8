"""Over real loopback sockets: TLS (and client certificates), clients that disconnect mid-body,
and the CLI's access flags (the first log line, SIGHUP reload)."""

from __future__ import annotations

import logging
import signal
import socket
import ssl
import threading
import time

import httpx
import pytest
import uvicorn

from blendmatch.bench.loadtest import spawn_server, stop_server
from blendmatch.service.access import hash_key, new_key
from blendmatch.service.app import create_app
from blendmatch.service.cli import uvicorn_tls_kwargs
from service_support import MODEL, b64, chunks, config, events, metric_samples, store
from test_service_e2e import ServerThread

trustme = pytest.importorskip("trustme")


class TLSServer:
    """uvicorn on 127.0.0.1:<free port> with the TLS arguments ``blendmatch serve`` passes."""

    def __init__(self, app, cfg, **uvicorn_kw) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    **uvicorn_tls_kwargs(cfg), **uvicorn_kw))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return f"https://localhost:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("gpu-a-1.fleet")
    server.cert_chain_pems[0].write_to_path(d / "server.pem")
    for blob in server.cert_chain_pems[1:]:
        blob.write_to_path(d / "server.pem", append=True)
    server.private_key_pem.write_to_path(d / "server.key")
    ca.cert_pem.write_to_path(d / "ca.pem")
    return {"ca": ca, "client": client, "dir": d}


def test_tls_serves_https_and_refuses_plain_http(pki):
    d = pki["dir"]
    cfg = config(ssl_certfile=str(d / "server.pem"), ssl_keyfile=str(d / "server.key"))
    ctx = ssl.create_default_context()
    pki["ca"].configure_trust(ctx)
    with TLSServer(create_app(cfg), cfg) as url:
        with httpx.Client(verify=ctx) as c:
            assert c.get(f"{url}/healthz").json() == {"status": "healthy"}
            assert c.post(f"{url}/events", json=events(store("i", 1, chunks(1)))).json()["applied"] == 1
        with pytest.raises(httpx.ConnectError):  # an untrusted certificate is refused by the client
            httpx.get(f"{url}/healthz", verify=True)
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https", "http") + "/healthz")


def test_tls_responses_go_through_the_transport_with_the_served_protocol(pki, monkeypatch):
    """``blendmatch serve``'s HTTP protocol (``service/limits.py``) over TLS: a response is
    never sent straight to the socket (that path is for plain TCP only: it would bypass the
    encryption), and every answer arrives whole, small and large, on one keep-alive
    connection."""
    from blendmatch.service import counting_transport as transport_mod

    direct: list[int] = []
    real_send = transport_mod._send

    def send(fd, data):
        direct.append(len(data))
        return real_send(fd, data)

    monkeypatch.setattr(transport_mod, "_send", send)
    server, ctx = _served_over_tls(pki)
    with server as url:
        with httpx.Client(verify=ctx) as c:
            for k in range(3):
                assert c.get(f"{url}/healthz").json() == {"status": "healthy"}
                assert c.post(f"{url}/events", json=events(store("i", k + 1, chunks(40, seed=k)))).json()["applied"] == 1
            assert c.get(f"{url}/openapi.json").status_code == 200  # a large body
    assert direct == []


def test_the_lookup_lane_over_tls_answers_as_the_app(pki, monkeypatch):
    """The lookup lane (service/lane.py) under TLS, with the uvicorn settings the CLI gives:
    its answers go through the transport's encryption and equal the app's, headers too."""
    from blendmatch.service import limits as limits_mod

    finished: list[int] = []
    finish = limits_mod.lane_finish
    monkeypatch.setattr(limits_mod, "lane_finish", lambda proto, lane, cycle: finished.append(1) or finish(proto, lane, cycle))
    server, ctx = _served_over_tls(pki, proxy_headers=False, access_log=False)
    rows = chunks(3, seed=4)
    with server as url:
        with httpx.Client(verify=ctx) as c:
            assert c.post(f"{url}/events", json=events(store("i", 1, rows))).json()["applied"] == 1
            for tokens in (rows[1], chunks(1, seed=99)[0]):
                body = {"tokens_b64": b64(tokens), "model_name": MODEL}
                lane = c.post(f"{url}/directory/blend-lookup", json=body)
                app_answer = c.post(f"{url}/directory/blend-lookup?via=app", json=body)
                assert lane.status_code == app_answer.status_code == 200
                assert lane.content == app_answer.content
                assert [(k, v) for k, v in lane.headers.items() if k != "date"] == \
                    [(k, v) for k, v in app_answer.headers.items() if k != "date"]
            assert b'"matches":[{' in c.post(f"{url}/directory/blend-lookup",
                                              json={"tokens_b64": b64(rows[1]), "model_name": MODEL}).content
    assert len(finished) == 3


def _served_over_tls(pki, **uvicorn_kw) -> tuple[TLSServer, ssl.SSLContext]:
    """The app under uvicorn with TLS and ``blendmatch serve``'s HTTP protocol (the limits),
    and a client context that trusts it."""
    from blendmatch.service import limits as limits_mod

    d = pki["dir"]
    cfg = config(ssl_certfile=str(d / "server.pem"), ssl_keyfile=str(d / "server.key"))
    limits = limits_mod.HttpLimits.from_config(cfg)
    ctx = ssl.create_default_context()
    pki["ca"].configure_trust(ctx)
    return TLSServer(create_app(cfg), cfg, http=limits.protocol_class, **uvicorn_kw), ctx


def test_client_certificates_are_required_with_ssl_ca_certs(pki):
    d = pki["dir"]
    cfg = config(ssl_certfile=str(d / "server.pem"), ssl_keyfile=str(d / "server.key"), ssl_ca_certs=str(d / "ca.pem"))
    with TLSServer(create_app(cfg), cfg) as url:
        bare = ssl.create_default_context()
        pki["ca"].configure_trust(bare)
        with pytest.raises(httpx.HTTPError):
            with httpx.Client(verify=bare) as c:
                c.get(f"{url}/healthz")
        mutual = ssl.create_default_context()
        pki["ca"].configure_trust(mutual)
        pki["client"].configure_cert(mutual)
        with httpx.Client(verify=mutual) as c:
            assert c.get(f"{url}/healthz").status_code == 200


def test_ssl_ca_certs_needs_a_server_certificate():
    with pytest.raises(ValueError, match="ssl_certfile"):
        config(ssl_ca_certs="ca.pem")


# ---------------------------------------------------------------------------- disconnects
@pytest.mark.parametrize("path", ["/events", "/directory/blend-lookup"])
def test_a_client_that_disconnects_mid_body_is_counted_not_an_error(path, caplog):
    app = create_app(config())
    with ServerThread(app) as url, caplog.at_level(logging.INFO):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: 5000\r\n\r\n".encode() + b'{"batches": [')
                time.sleep(0.05)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            samples = metric_samples(httpx.get(f"{url}/metrics").text)
            if samples.get("blendmatch_client_disconnects_total", 0) >= 2:
                break
            time.sleep(0.05)
        assert samples["blendmatch_client_disconnects_total"] == 2
        assert samples["blendmatch_http_internal_errors_total"] == 0
        assert httpx.get(f"{url}/healthz").status_code == 200
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(lines) == 2 and all(r.exc_info is None for r in lines)
    assert "Traceback" not in caplog.text


# ---------------------------------------------------------------------------- the CLI
@pytest.mark.slow
def test_cli_states_the_access_mode_first_and_reloads_on_sighup(tmp_path):
    old, new = new_key(), new_key()
    access = tmp_path / "access.toml"
    access.write_text(f'[[key]]\nname = "ops"\nsha256 = "{hash_key(old)}"\nroles = ["admin", "reader"]\n'
                      f'[[network]]\ncidrs = ["127.0.0.0/8"]\nroles = ["metrics"]\n')
    log = tmp_path / "server.log"
    proc, url = spawn_server(["--engine", "reference", "--access-file", str(access)], log_path=log)
    try:
        assert httpx.get(f"{url}/metrics").status_code == 200  # loopback: metrics, as listed
        assert httpx.get(f"{url}/directory/keys").status_code == 403
        assert httpx.get(f"{url}/directory/keys", headers={"authorization": f"Bearer {old}"}).status_code == 200
        client_body = {"tokens_b64": b64(chunks(1)[0]), "model_name": MODEL}
        assert httpx.post(f"{url}/directory/blend-lookup", json=client_body,
                          headers={"authorization": f"Bearer {new}"}).status_code == 401
        access.write_text(f'[[key]]\nname = "ops2"\nsha256 = "{hash_key(new)}"\nroles = ["reader"]\n')
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reloaded access" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(f"{url}/directory/blend-lookup", json=client_body,
                          headers={"authorization": f"Bearer {new}"}).status_code == 200
        assert httpx.get(f"{url}/directory/keys", headers={"authorization": f"Bearer {old}"}).status_code == 401
        assert proc.poll() is None  # SIGHUP did not stop it
    finally:
        stop_server(proc)
    first = log.read_text().splitlines()[0]
    assert "access: access file" in first and "1 API keys" in first and "TLS off" in first


@pytest.mark.slow
def test_cli_without_access_file_says_protected_mode_first(tmp_path):
    log = tmp_path / "server.log"
    proc, url = spawn_server(["--engine", "reference"], log_path=log)
    try:
        assert httpx.get(f"{url}/directory/stats").status_code == 200  # loopback is served
    finally:
        stop_server(proc)
    assert "protected mode" in log.read_text().splitlines()[0]
