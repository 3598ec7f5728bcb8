"""CLI dispatch without starting servers: subcommands, LMCache-style bare flags, forwarding."""

from __future__ import annotations

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
