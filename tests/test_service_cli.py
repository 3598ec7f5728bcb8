"""CLI dispatch without starting servers: subcommands, LMCache-style bare flags, forwarding."""

from __future__ import annotations

import re
import sys
import types

import pytest

from blendmatch.service import cli


def test_bench_forwards_argv_unchanged(monkeypatch):
    seen = {}
    fake = types.ModuleType("blendmatch.bench.engine")
    fake.main = lambda argv: seen.setdefault("argv", list(argv)) and 0
    monkeypatch.setitem(sys.modules, "blendmatch.bench.engine", fake)
    monkeypatch.setattr("blendmatch.bench.engine", fake, raising=False)
    assert cli.main(["bench", "--chunks", "10", "--engine", "cpu"]) == 0
    assert seen["argv"] == ["--chunks", "10", "--engine", "cpu"]


@pytest.mark.parametrize("argv, expect", [
    ([], []),
    (["--port", "9301", "--enable-blend-lookup"], ["--port", "9301", "--enable-blend-lookup"]),
    (["serve", "--engine", "cpu"], ["--engine", "cpu"]),
])
def test_bare_flags_and_serve_go_to_serve(monkeypatch, argv, expect):
    seen = {}
    monkeypatch.setattr(cli, "_serve", lambda rest: seen.setdefault("argv", list(rest)) is not None and 0)
    assert cli.main(argv) == 0
    assert seen["argv"] == expect


def test_serve_flags_build_the_config():
    parser = cli.argparse.ArgumentParser()
    cli._add_serve_flags(parser)
    args = parser.parse_args(["--disable-blend-lookup", "--max-batch-tokens", "8192", "--max-batch-wait-ms", "2",
                              "--chunk-size", "128", "--engine", "reference"])
    cfg = cli.config_from_args(args)
    assert (cfg.enable_blend_lookup, cfg.max_batch_tokens, cfg.max_batch_wait_ms, cfg.chunk_size, cfg.engine) == (
        False, 8192, 2.0, 128, "reference")
    defaults = cli.config_from_args(parser.parse_args([]))
    assert (defaults.host, defaults.port, defaults.enable_blend_lookup, defaults.max_request_tokens,
            defaults.max_batch_wait_ms, defaults.engine) == ("0.0.0.0", 9300, True, 1_000_000, 0.0, "auto")
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-blend-lookup", "--disable-blend-lookup"])


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["frobnicate"])
    assert ei.value.code == 2


def test_openapi_subcommand_prints_the_schema(capsys):
    assert cli.main(["openapi"]) == 0
    assert '"openapi"' in capsys.readouterr().out


FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "lmcache"


def _lmcache_flags() -> list[str]:
    """Every flag of LMCache 0.5.6's coordinator, from its own --help (committed fixture)."""
    import re

    usage = (FIXTURES / "coordinator_help.txt").read_text().split("options:")[0]
    return sorted(set(re.findall(r"\[(--[a-z][a-z0-9-]+)", usage)))


def _value_for(flag: str) -> list[str]:
    values = {"--event-transport": "http", "--host": "127.0.0.1", "--port": "9300", "--chunk-size": "256",
              "--blend-probe-stride": "1", "--kafka-topic": "t", "--kafka-bootstrap-servers": "k:9092",
              "--kafka-group-id": "g", "--checkpoint-path": "/tmp/x", "--extra-config": "{}",
              "--metadata-path": "/tmp/m", "--otlp-endpoint": "http://o:4317", "--hash-algorithm": "blake3"}
    if flag in ("--enable-blend-lookup", "--disable-metrics"):
        return [flag]
    return [flag, values.get(flag, "1")]


def test_every_lmcache_coordinator_flag_is_accepted(monkeypatch):
    flags = _lmcache_flags()
    assert len(flags) == 22  # the fixture really lists LMCache's flags
    parser = cli.argparse.ArgumentParser()
    cli._add_serve_flags(parser)
    cli._add_lmcache_only_flags(parser)
    argv = [a for f in flags for a in _value_for(f)]
    args = parser.parse_args(argv)
    cfg = cli.config_from_args(args)
    assert (cfg.health_check_interval, cfg.instance_timeout, cfg.timeout_keep_alive) == (1.0, 1.0, 1.0)
    warnings = cli.ignored_flag_warnings(args, parser)
    meaningful = {"--host", "--port", "--chunk-size", "--blend-probe-stride", "--enable-blend-lookup",
                  "--health-check-interval", "--instance-timeout", "--timeout-keep-alive",
                  "--checkpoint-path", "--checkpoint-interval", "--event-transport", "--kafka-bootstrap-servers",
                  "--kafka-topic", "--kafka-group-id", "--hash-algorithm"}
    assert sorted(w.split()[0] for w in warnings) == sorted(set(flags) - meaningful)
    assert all("accepted for LMCache compatibility and ignored" in w for w in warnings)
    assert cli.ignored_flag_warnings(parser.parse_args([]), parser) == []


def test_lmcache_registry_defaults():
    parser = cli.argparse.ArgumentParser()
    cli._add_serve_flags(parser)
    cfg = cli.config_from_args(parser.parse_args([]))
    assert (cfg.health_check_interval, cfg.instance_timeout, cfg.timeout_keep_alive) == (10.0, 30.0, 10.0)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2"], "--workers needs --event-transport kafka"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--worker-ports-from", "9400"], "--worker-ports-from needs --workers 2 or more"),
    (["--workers", "3", "--worker-ports-from", "65534", "--event-transport", "kafka",
      "--kafka-bootstrap-servers", "k:9092"], "must lie in 1..65535"),
])
def test_workers_need_the_log(capsys, argv, message):
    """Workers share nothing but the event log: without Kafka there is nothing to follow."""
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", *argv])
    assert ei.value.code == 2 and message in capsys.readouterr().err


def test_worker_argv_gives_each_worker_its_identity(monkeypatch):
    from blendmatch.service.workers import worker_argv

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    argv = ["--port", "9300", "--workers", "2", "--event-transport", "kafka", "--worker-p", "9400", "--workers=3"]
    got = worker_argv(argv, 1, replica_id="node", checkpoint_path="/d/c.ckpt", engine_threads=None, workers=2)
    assert got == [*argv, "--workers", "1", "--worker-ports-from", "0", "--replica-id", "node-w1", "--reuse-port",
                   "--refuse-lookups-until-ready", "--checkpoint-path", "/d/c.ckpt.w1", "--engine-threads", "2"]
    parsed = _serve_parser().parse_args(got)  # the appended values win, however argv spelled them
    assert (parsed.workers, parsed.worker_ports_from, parsed.replica_id, parsed.checkpoint_path) == (
        1, 0, "node-w1", "/d/c.ckpt.w1")
    got = worker_argv([*argv, "--worker-ports-from", "9400"], 1, replica_id="n", checkpoint_path="",
                      engine_threads=3, workers=2, own_ports_from=9400)
    assert got[-2:] == ["--own-port", "9401"] and _serve_parser().parse_args(got).worker_ports_from == 0
    got = worker_argv(argv, 0, replica_id="n", checkpoint_path="", engine_threads=3, workers=2)
    assert got[-3:] == ["n-w0", "--reuse-port", "--refuse-lookups-until-ready"]


def test_workers_exit_1_when_the_port_is_taken(tmp_path):
    """A port held by a socket without SO_REUSEPORT: each worker says it cannot listen, and
    the parent stops the rest and exits 1 (no broker is contacted before the bind)."""
    import socket
    import subprocess

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        got = subprocess.run([sys.executable, "-m", "blendmatch", "serve", "--workers", "2", "--host", "127.0.0.1",
                              "--port", str(port), "--event-transport", "kafka", "--kafka-bootstrap-servers",
                              "127.0.0.1:1", "--engine", "cpu"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in got.stderr, got.stderr[-2000:]


def _serve_parser():
    import argparse

    p = argparse.ArgumentParser()
    cli._add_serve_flags(p)
    return p


#: reStructuredText / markdown markup that must not reach a terminal: literals, roles,
#: link references, literal-block markers, bold.
_MARKUP = re.compile(r"``|`[^`\n]+`_|:[a-z]+:`|::\s*$|\*\*[^*\n]+\*\*|^\s*\.\. ")


@pytest.mark.parametrize("argv", [[]] + [[c] for c in cli._SUBCOMMANDS] + [["checkpoint", "inspect"]],
                         ids=lambda a: " ".join(a) or "blendmatch")
def test_every_help_is_plain_text(capsys, argv):
    """``blendmatch <sub> --help`` for every subcommand (the list the parser itself uses):
    exit 0, some text, and none of the docstring markup a terminal would show raw."""
    with pytest.raises(SystemExit) as ei:
        cli.main([*argv, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    bad = [line for line in out.splitlines() if _MARKUP.search(line)]
    assert bad == [], f"markup in blendmatch {' '.join(argv)} --help: {bad[:3]}"
