"""Every refused start of ``blendmatch serve`` is one line on stderr, a non-zero exit and no
traceback (service/startcheck.py; docs/operations.md, "Exit status").

Each case runs the real CLI in a subprocess. A missing optional dependency is simulated
strictly: a ``sitecustomize`` on ``PYTHONPATH`` puts a finder first on ``sys.meta_path``
that answers the blocked top-level module exactly as Python answers a module that is not
installed (``ModuleNotFoundError: No module named 'x'``, with ``name`` set), so the code
under test cannot tell the difference; the blocker itself is checked below.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

_BLOCKER = textwrap.dedent('''
    import os
    import sys

    _BLOCKED = tuple(m for m in os.environ.get("BLENDMATCH_TEST_BLOCK_MODULES", "").split(",") if m)


    class _NotInstalled:
        """Answers the blocked modules as an absent module is answered."""

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in _BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, _NotInstalled())
''')


@pytest.fixture(scope="module")
def blocker(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("blocker")
    (path / "sitecustomize.py").write_text(_BLOCKER)
    return path


def _serve(*flags: str, block: tuple[str, ...] = (), blocker: Path | None = None,
           timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    if block:
        assert blocker is not None
        env["PYTHONPATH"] = os.pathsep.join([str(blocker), *filter(None, [env.get("PYTHONPATH")])])
        env["BLENDMATCH_TEST_BLOCK_MODULES"] = ",".join(block)
    t0 = time.monotonic()
    got = subprocess.run([sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port",
                          str(_free_port()), *flags], capture_output=True, text=True, env=env, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    return got, time.monotonic() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line(got: subprocess.CompletedProcess, code: int) -> str:
    """The one stderr line of a refused start (and nothing on stdout)."""
    assert got.returncode == code, (got.returncode, got.stderr[-3000:])
    assert "Traceback" not in got.stderr, got.stderr[-3000:]
    lines = got.stderr.splitlines()
    assert len(lines) == 1, got.stderr[-3000:]
    assert got.stdout == ""
    assert lines[0].startswith("blendmatch serve: error: "), lines[0]
    return lines[0]


def test_the_blocker_answers_as_an_absent_module(blocker):
    env = dict(os.environ, PYTHONPATH=str(blocker), BLENDMATCH_TEST_BLOCK_MODULES="zmq")
    got = subprocess.run([sys.executable, "-c", "import json\ntry:\n import zmq.auth\nexcept ImportError as e:\n"
                          " print(json.dumps([type(e).__name__, e.name, str(e)]))\nimport numpy"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == '["ModuleNotFoundError", "zmq", "No module named \'zmq\'"]'


def test_a_usage_error_is_one_line_and_a_pointer_to_help():
    got, _ = _serve("--no-such-flag")
    line = _one_line(got, 2)
    assert "unrecognized arguments: --no-such-flag" in line and "blendmatch serve --help" in line
    got, _ = _serve("--max-batch-tokens", "0")  # a value the config refuses: the same form
    line = _one_line(got, 2)
    assert "--max-batch-tokens" in line and "blendmatch serve --help" in line


def test_engine_gpu_without_cupy(blocker):
    got, _ = _serve("--engine", "gpu", block=("cupy", "cupyx"), blocker=blocker)
    line = _one_line(got, 1)
    assert "--engine gpu" in line and "CuPy is not installed" in line, line
    assert "pip install 'blendmatch[gpu-cuda12]'" in line, line


def test_kv_events_without_pyzmq(blocker):
    got, _ = _serve("--kv-events-endpoint", f"tcp://127.0.0.1:{_free_port()}", block=("zmq",), blocker=blocker)
    line = _one_line(got, 1)
    assert "--kv-events-endpoint needs pyzmq" in line and "pip install 'blendmatch[kv-events]'" in line, line


def test_kafka_without_confluent_kafka(blocker):
    got, _ = _serve("--event-transport", "kafka", "--kafka-bootstrap-servers", "127.0.0.1:1",
                    block=("confluent_kafka",), blocker=blocker)
    line = _one_line(got, 1)
    assert "--event-transport kafka needs confluent-kafka" in line and "pip install 'blendmatch[kafka]'" in line


def test_tls_files_are_named_when_missing_or_unusable(tmp_path):
    missing = tmp_path / "nonexistent.pem"
    line = _one_line(_serve("--ssl-certfile", str(missing))[0], 1)
    assert f"--ssl-certfile {missing}: cannot read it (No such file or directory)" in line, line

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    line = _one_line(_serve("--ssl-certfile", str(garbage))[0], 1)
    assert f"--ssl-certfile {garbage}" in line and "not a PEM certificate" in line, line

    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    line = _one_line(_serve("--ssl-certfile", str(cert_path), "--ssl-keyfile", str(missing))[0], 1)
    assert f"--ssl-keyfile {missing}: cannot read it" in line, line
    line = _one_line(_serve("--ssl-certfile", str(cert_path), "--ssl-keyfile", str(key_path),
                            "--ssl-ca-certs", str(tmp_path))[0], 1)
    assert f"--ssl-ca-certs {tmp_path}: cannot read it (Is a directory)" in line, line
    line = _one_line(_serve("--ssl-certfile", str(cert_path), "--ssl-keyfile", str(key_path),
                            "--ssl-ca-certs", str(garbage))[0], 1)
    assert f"--ssl-ca-certs {garbage}" in line, line


def test_a_port_in_use_is_found_first():
    """Found before the start-up work: no log line at all (the access line, the engine
    choice and "serving" come after it), within seconds (the interpreter and the imports;
    about 0.7 s of CPU), not after the engine's start-up."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        got = subprocess.run([sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port",
                              str(port)], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        elapsed = time.monotonic() - t0
    line = _one_line(got, 1)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line, line
    assert "serving" not in got.stderr
    assert elapsed < 10, elapsed  # a generous bound on a loaded machine: the point is "before the start-up"


def test_the_early_socket_refuses_until_the_server_serves():
    """The port is bound before the start-up work but listens only once uvicorn's loop
    serves it (asyncio's ``create_server(sock=...)`` calls ``listen()``): a client that
    connects during the start-up is refused at once instead of hanging in a backlog."""
    import asyncio

    from blendmatch.service.startcheck import bind_sockets

    (sock,) = bind_sockets("127.0.0.1", [(0, False)])
    port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()

    async def serve_once() -> bytes:
        async def answer(reader, writer):
            writer.write(b"hi")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, sock=sock)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            data = await reader.read()
            writer.close()
            return data

    assert asyncio.run(serve_once()) == b"hi"


def test_interrupted_start_is_one_line(monkeypatch, capsys):
    """Ctrl-C before uvicorn owns the signals (a start-up still compiling): one line, 130."""
    from blendmatch.service import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_serve", interrupted)
    assert cli.main(["serve"]) == 130
    assert capsys.readouterr().err == "blendmatch serve: error: interrupted\n"
