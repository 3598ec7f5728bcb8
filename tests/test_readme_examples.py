"""The README's examples run as written against a live ``blendmatch serve``.

Every fenced block preceded by ``<!-- example: NAME -->`` in README.md is run, in README
order, against one real ``blendmatch serve`` subprocess on its defaults except the address
(127.0.0.1 and a free port: ``:9300`` in the block is rewritten to that port, nothing else
is touched): ``bash`` blocks with bash (``-e -o pipefail``), ``python`` blocks with this
interpreter, from the repository root, with this environment's ``bin`` first on ``PATH``
(so ``python`` is the one blendmatch is installed in). Each block's output is checked
against what the example promises (``EXPECT`` below) and, where the README shows the
answer in a ``json`` block right after the command, against that answer too. A curl or
python block without a marker, a marker without a check, or a check whose block is gone
fails the test; so does a README example that stops working.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
EXAMPLES = REPO / "examples"

_FENCE = re.compile(r"```(\w*)\n(.*?)\n```", re.S)
_MARKER = re.compile(r"<!-- example: ([\w-]+) -->\n```")


def readme_blocks(text: str) -> list[tuple[str | None, str, str, Any]]:
    """``(name or None, language, code, shown answer or None)`` for every fenced block in
    ``text``; the shown answer is a ``json`` block that directly follows a named block."""
    fences = list(_FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group(1) == "json" and i and out and out[-1][0] is not None and _adjacent(text, fences[i - 1], m):
            continue  # the answer of the block before it
        before = text[:m.start() + 3]
        marker = _MARKER.search(before, max(0, m.start() - 80))
        name = marker.group(1) if marker and marker.end() == m.start() + 3 else None
        shown = None
        if name is not None and i + 1 < len(fences) and fences[i + 1].group(1) == "json" and _adjacent(
                text, m, fences[i + 1]):
            shown = json.loads(fences[i + 1].group(2))
        out.append((name, m.group(1), m.group(2), shown))
    return out


def _adjacent(text: str, a: re.Match, b: re.Match) -> bool:
    return not text[a.end():b.start()].strip()


def _store() -> dict[str, Any]:
    return json.loads((EXAMPLES / "store.json").read_text())["batches"][0]["entries"][0]


def _json(out: str) -> Any:
    return json.loads(out)


def _check_store(out: str) -> None:
    assert _json(out) == {"applied": 1, "duplicates": 0, "stale": 0, "entries_applied": 1,
                          "entries_not_indexable": {}}


def _check_blend(out: str) -> None:
    assert _json(out) == {"matches": [{"chunk_hash": _store()["key"]["chunk_hash_hex"], "old_st": 0, "cur_st": 100}]}


def _check_directory(out: str) -> None:
    got, entry = _json(out), _store()
    assert got["chunks"] == 1 and len(got["results"]) == 1, got
    (result,) = got["results"]
    assert result["key"] == entry["key"]
    assert result["placements"] == [{"instance_id": "demo-0", "incarnation": 1, "tier": "l1", "backend": "dram",
                                     "size_bytes": entry["size_bytes"], "shared": False}]
    assert result["token_ids"] == entry["token_ids"]


def _check_register(out: str) -> None:
    assert _json(out) == {"instance_id": "demo-0", "re_registered": False}


def _check_route_score(out: str) -> None:
    assert _json(out) == {"shared_tokens": 0, "instances": [
        {"instance_id": "demo-0", "prefix_tokens": 0, "fragment_tokens": 256, "reusable_tokens": 256}]}


def _check_client_lookup(out: str) -> None:
    h = bytes.fromhex(_store()["key"]["chunk_hash_hex"])
    assert out.strip() == repr([_blend_match(h, 0, 100)])


def _blend_match(chunk_hash: bytes, old_st: int, cur_st: int) -> Any:
    from blendmatch.index.types import BlendMatch

    return BlendMatch(chunk_hash, old_st, cur_st)


def _check_client_engine(out: str) -> None:
    assert out == f"100 0 {_store()['key']['chunk_hash_hex']}\n"


#: What each README example must print, by its marker name.
EXPECT: dict[str, Callable[[str], None]] = {
    "store": _check_store,
    "blend-lookup": _check_blend,
    "blend-lookup-b64": _check_blend,
    "directory-lookup-keys": _check_directory,
    "directory-lookup-tokens": _check_directory,
    "register": _check_register,
    "route-score": _check_route_score,
    "client-lookup": _check_client_lookup,
    "client-engine": _check_client_engine,
}


def test_every_example_is_marked_and_checked():
    blocks = readme_blocks(README.read_text())
    unmarked = [code for name, lang, code, _ in blocks
                if name is None and (lang == "python" or (lang == "bash" and "curl " in code))]
    assert not unmarked, f"README blocks a user would paste that no test runs (mark them): {unmarked}"
    names = [name for name, *_ in blocks if name is not None]
    assert len(names) == len(set(names)), names
    assert sorted(names) == sorted(EXPECT), "every marked README block has a check here, and every check a block"
    assert all(lang in ("bash", "python") for name, lang, *_ in blocks if name is not None)


def test_the_example_files_are_what_the_script_writes(tmp_path):
    got = subprocess.run([sys.executable, str(EXAMPLES / "make_examples.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(p.name for p in EXAMPLES.glob("*.json"))
    for name in written:
        assert (tmp_path / name).read_bytes() == (EXAMPLES / name).read_bytes(), f"examples/{name} is stale"


def test_the_blocks_are_found():
    """The extraction itself: marked blocks, their shown answers, unmarked blocks."""
    text = ("intro\n\n<!-- example: a -->\n```bash\ncurl -s x\n```\n\n```json\n{\"k\": 1}\n```\n\n"
            "```bash\npip install .\n```\n<!-- example: b -->\n```python\nprint(1)\n```\ntext\n```json\n[]\n```\n")
    assert readme_blocks(text) == [("a", "bash", "curl -s x", {"k": 1}), (None, "bash", "pip install .", None),
                                   ("b", "python", "print(1)", None), (None, "json", "[]", None)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``blendmatch serve`` on its defaults, but on 127.0.0.1 and a free port; ready."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("readme") / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "blendmatch", "serve", "--host", "127.0.0.1", "--port",
                                 str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in 180 s:\n" + log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield port, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_readme_examples_run_verbatim(server):
    port, log_path = server
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    ran = []
    for name, lang, code, shown in readme_blocks(README.read_text()):
        if name is None:
            continue
        assert ":9300" in code, f"{name}: the example talks to the default port"
        code = code.replace(":9300", f":{port}")
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        got = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
        assert got.returncode == 0, (name, got.stdout[-2000:], got.stderr[-2000:], log_path.read_text()[-2000:])
        try:
            EXPECT[name](got.stdout)
            if shown is not None:
                assert json.loads(got.stdout) == shown, "the answer the README shows"
        except AssertionError as exc:
            raise AssertionError(f"README example {name!r} printed:\n{got.stdout[:3000]}\n{got.stderr[-2000:]}") \
                from exc
        ran.append(name)
    assert sorted(ran) == sorted(EXPECT)
