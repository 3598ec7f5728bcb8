"""``tokens_b64`` decoding, side by side: ours (``tokens.decode_query_tokens``) against the
decoder of an earlier revision and Python's strict ``binascii`` decoder.

Run ``python -m blendmatch.bench.b64`` (``--help`` lists the knobs). A faster base64
decode is worth keeping only if it measures better than ours, compared side by side: this is
that comparison. ``--before REV`` (default: the last revision with the numba kernel that
pybase64 replaced) loads that revision's ``index/tokens.py`` and its kernel module from git
into a scratch package, so both decoders run in one process, interleaved, medians of
``--rounds`` rounds (this machine is shared and noisy: read the ratios, not the
microseconds). Needs a git checkout for ``--before``. Figures: docs/performance.md
("Decoding tokens_b64").
"""

from __future__ import annotations

import argparse
import base64
import binascii
import importlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from blendmatch.index.tokens import decode_query_tokens

__all__ = ["main", "run", "load_before"]

#: The last revision whose decoder was the numba kernel (index/_b64.py).
KERNEL_REV = "3f0145d"


def load_before(rev: str, repo: Path) -> Callable[[Sequence[bytes]], Any]:
    """``decode_query_tokens`` of revision ``rev``: its ``index/tokens.py`` (and the modules it
    imports lazily, where that revision has them) written into a scratch package."""
    pkg = Path(tempfile.mkdtemp(prefix="bm-b64-")) / "bm_before"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("tokens", "_b64", "_jsontok"):
        got = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:index/{name}.py"], capture_output=True)
        if got.returncode == 0:
            (pkg / f"{name}.py").write_bytes(got.stdout)
        elif name == "tokens":
            raise SystemExit(f"--before {rev}: git could not read index/tokens.py: {got.stderr.decode().strip()}")
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("bm_before.tokens").decode_query_tokens  # type: ignore[no-any-return]


def _binascii(texts: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(binascii.a2b_base64(t, strict_mode=True) for t in texts), dtype="<u4")


def run(decoders: dict[str, Callable[[Sequence[bytes]], Any]], query_tokens: int = 8192, queries: int = 1,
        rounds: int = 9, seed: int = 0) -> dict[str, Any]:
    """Median microseconds per call of each decoder on ``queries`` strings of ``query_tokens``
    tokens each (one call decodes them all into one buffer, as one micro-batch of lookups), and
    each one's time over ours. Every decoder's answer is checked against the tokens first."""
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 1 << 32, size=query_tokens, dtype=np.uint64).astype(np.uint32) for _ in range(queries)]
    texts = [base64.b64encode(t.astype("<u4").tobytes()) for t in tokens]
    want = np.concatenate(tokens)
    for name, decode in decoders.items():
        got = decode(texts)
        assert np.array_equal(got[0] if isinstance(got, tuple) else got, want), name
    reps = max(3, 400_000 // (query_tokens * queries))
    times: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(rounds):
        for name, decode in decoders.items():  # interleaved: drift hits every decoder alike
            t0 = time.perf_counter()
            for _ in range(reps):
                decode(texts)
            times[name].append((time.perf_counter() - t0) / reps * 1e6)
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    ours = med["ours"]
    return {"query_tokens": query_tokens, "queries": queries, "us_per_call": {k: round(v, 1) for k, v in med.items()},
            "x_ours": {k: round(v / ours, 2) for k, v in med.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blendmatch.bench.b64", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 8192, 65536], help="tokens per query")
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 32], help="queries per call (a micro-batch)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds; the median is reported")
    ap.add_argument("--before", default=KERNEL_REV, metavar="REV",
                    help="git revision whose decoder to compare with ('' for none); default %(default)s")
    ap.add_argument("--repo", type=Path, default=Path.cwd(), help="the git checkout to read --before from")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    args = ap.parse_args(argv)
    decoders: dict[str, Callable[[Sequence[bytes]], Any]] = {"ours": decode_query_tokens}
    if args.before:
        decoders[f"before ({args.before})"] = load_before(args.before, args.repo)
    decoders["binascii strict"] = _binascii
    for q in args.queries:
        for n in args.tokens:
            row = run(decoders, n, q, args.rounds)
            if args.json:
                print(json.dumps(row))
            else:
                cells = "  ".join(f"{k} {v:.1f} us ({row['x_ours'][k]:.2f}x)" for k, v in row["us_per_call"].items())
                print(f"{q:>3} x {n:>6} tokens: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
