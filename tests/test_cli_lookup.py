"""The CLI's surface: --version, plain-text help with defaults and LMCache equivalents, and
``blendmatch lookup`` against a real loopback server, with its exit statuses."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from blendmatch import __version__
from blendmatch.service import cli
from blendmatch.service.app import create_app
from client_support import LoopbackApp, ScriptedServer, json_reply, refused_url
from service_support import C, MODEL, chunks, config, hash_of, store

RST_MARKUP = ("``", ":func:", ":class:", ":data:", "::")


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return chunks(3, seed=5)


@pytest.fixture(scope="module")
def url(rows):
    from blendmatch.service.client import BlendClient

    with LoopbackApp(create_app(config())) as u, BlendClient(u) as c:
        c.post_events([store("i1", 1, rows[:2]), store("i2", 1, rows[2:], first_hash=2, salt="s", world_size=2)])
        yield u


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------- version and help
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(capsys, flag):
    assert run(capsys, flag) == (0, f"blendmatch {__version__}\n", "")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["lookup", "--help"], ["-h"]])
def test_help_is_plain_text(capsys, argv):
    code, out, _ = run(capsys, *argv)
    assert code == 0 and out.startswith("usage: blendmatch")
    assert not [m for m in RST_MARKUP if m in out], out
    assert max(map(len, out.splitlines())) <= 100


def _flag_helps(add_flags) -> dict[str, str]:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return {a.option_strings[-1] if a.option_strings else a.dest: a.help % {"default": a.default}
            for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS}  # hidden: internal


def test_every_serve_flag_states_its_default_and_lmcache_equivalent():
    helps = _flag_helps(cli._add_serve_flags)
    assert all("(default: " in h for h in helps.values()), helps
    for flag in ("--host", "--port", "--chunk-size", "--blend-probe-stride", "--enable-blend-lookup"):
        assert f"LMCache: the coordinator's {flag}" in helps[flag]
    assert "(default: 9300;" in helps["--port"] and "(default: 256;" in helps["--chunk-size"]
    assert "LMCACHE_LOG_LEVEL" in helps["--log-level"]


def test_every_lookup_flag_states_its_default_and_lmcache_equivalent():
    helps = _flag_helps(cli._add_lookup_flags)
    assert "required" in helps["--model"]
    assert all("(default: " in h for f, h in helps.items() if f not in ("file", "--model")), helps
    assert "--coordinator-url" in helps["--url"] and "kv_rank" in helps["--world-size"]


# ---------------------------------------------------------------------- lookup
def test_lookup_prints_the_matches_from_a_json_file(capsys, tmp_path, url, rows):
    path = tmp_path / "q.json"
    path.write_text(json.dumps(np.concatenate([rows[1], rows[0]]).tolist()))
    code, out, err = run(capsys, "lookup", "--url", url, "--model", MODEL, str(path))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"2 matches in a query of {2 * C} tokens"
    assert lines[1].split() == ["cur_st", "old_st", "chunk_hash"]
    assert [line.split() for line in lines[2:]] == [["0", str(C), hash_of(1).hex()], [str(C), "0", hash_of(0).hex()]]


def test_lookup_json_output_from_an_npy_file_with_a_namespace(capsys, tmp_path, url, rows):
    path = tmp_path / "q.npy"
    np.save(path, np.concatenate([rows[0], rows[2]]).astype(np.int64))
    code, out, _ = run(capsys, "lookup", "--url", url.removeprefix("http://"), "--model", MODEL,
                       "--world-size", "2", "--cache-salt", "s", "--json", str(path))
    assert code == 0
    assert json.loads(out) == {"matches": [{"chunk_hash": hash_of(2).hex(), "old_st": 0, "cur_st": C}]}
    code, out, _ = run(capsys, "lookup", "--url", url, "--model", MODEL, str(path))  # another namespace
    assert code == 0 and out.splitlines()[0] == f"1 match in a query of {2 * C} tokens"


def test_lookup_with_no_matches(capsys, tmp_path, url):
    path = tmp_path / "q.json"
    path.write_text("[1, 2, 3]")
    assert run(capsys, "lookup", "--url", url, "--model", MODEL, str(path)) == (
        0, "no matches in a query of 3 tokens\n", "")


@pytest.mark.parametrize("content, words", [
    ("{not json", "not JSON"),
    ('{"token_ids": [1]}', "JSON list"),
    ("[1, 2.5]", "integers, got 2.5"),
    ("[1, true]", "integers, got True"),
    ("[[1, 2]]", "integers, got [1, 2]"),
    ("[1, -3]", "got -3"),
    (f"[{2**32}]", f"got {2**32}"),
])
def test_lookup_bad_json_file_exits_65(capsys, tmp_path, content, words):
    path = tmp_path / "q.json"
    path.write_text(content)
    code, out, err = run(capsys, "lookup", "--url", refused_url(), "--model", MODEL, str(path))
    assert (code, out) == (cli.EXIT_DATAERR, "") and words in err and str(path) in err


def test_lookup_bad_npy_file_exits_65(capsys, tmp_path):
    two_d, garbage = tmp_path / "2d.npy", tmp_path / "garbage.npy"
    np.save(two_d, np.zeros((2, 2), dtype=np.int32))
    garbage.write_bytes(b"not an array")
    for path, words in ((two_d, "1-D integer array"), (garbage, ".npy")):
        code, _, err = run(capsys, "lookup", "--model", MODEL, str(path))
        assert code == cli.EXIT_DATAERR and words in err


def test_lookup_missing_file_exits_66(capsys, tmp_path):
    code, out, err = run(capsys, "lookup", "--model", MODEL, str(tmp_path / "nope.json"))
    assert (code, out) == (cli.EXIT_NOINPUT, "") and "cannot read" in err and "nope.json" in err
    assert run(capsys, "lookup", "--model", MODEL, str(tmp_path))[0] == cli.EXIT_NOINPUT  # a directory


def test_lookup_unreachable_server_exits_69(capsys, tmp_path):
    path = tmp_path / "q.json"
    path.write_text("[1, 2]")
    code, _, err = run(capsys, "lookup", "--url", refused_url(), "--model", MODEL, "--timeout", "2", str(path))
    assert code == cli.EXIT_UNAVAILABLE and "no answer from http://127.0.0.1:" in err


def test_lookup_server_errors_exit_76(capsys, tmp_path, url):
    path = tmp_path / "q.json"
    path.write_text("[1, 2]")
    code, _, err = run(capsys, "lookup", "--url", url, "--model", "", str(path))  # the app says 422
    assert code == cli.EXIT_PROTOCOL and "422" in err and "model_name" in err
    with ScriptedServer(lambda *a: json_reply({"detail": "boom"}, 500)) as server:
        code, _, err = run(capsys, "lookup", "--url", server.url, "--model", MODEL, str(path))
        assert code == cli.EXIT_PROTOCOL and "500: boom" in err
    with ScriptedServer(lambda *a: (200, b"[]")) as server:
        code, _, err = run(capsys, "lookup", "--url", server.url, "--model", MODEL, str(path))
        assert code == cli.EXIT_PROTOCOL and "malformed" in err


def test_lookup_usage_errors_exit_2(capsys, tmp_path):
    assert run(capsys, "lookup", "q.json")[0] == 2  # no --model
    code, _, err = run(capsys, "lookup", "--model", MODEL, "--world-size", "0", "q.json")
    assert code == 2 and "must be >= 1" in err
