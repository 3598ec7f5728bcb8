"""The four hand-written JSON scanners timed against general parsers on the same bodies.

``python -m blendmatch.bench.json_scanners [--repeat N]``. Why each scanner exists is the
question (docs/performance.md, "JSON scanners"): each takes one shape of body out of the
text without a Python object per entry or token, and leaves the rest to pydantic-core, so
its figure is set beside the general parsers' on the same bytes:

- ``_jsonentries`` (``wire_scan.split_entries``): an LMCache STORE body's entries to columns;
- ``_jsontok`` (``tokens.split_token_arrays``): every ``token_ids`` array to one uint32 buffer;
- ``split_b64_value`` (``tokens.py``): a lookup's ``tokens_b64`` string left where it lies;
- ``parse_body`` (``service/fastpath.py``): the lookup fast path, the last two plus the
  route's model on what is left.

The general parsers: ``msgspec.json.decode`` and ``orjson.loads`` (when installed) parse
only, into Python lists of ints (no validation, no uint32 buffer: ``+ uint32`` adds the
conversion a token list still needs); pydantic's ``model_validate_json`` is what each
scanner's caller would run instead (parse and validate). Medians of ``--repeat`` calls, in
microseconds; on a loaded machine compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import base64
import json
import time
from typing import Any, Callable

import numpy as np

__all__ = ["bodies", "main", "measure"]


def bodies(chunk_size: int = 256, seed: int = 0) -> dict[str, bytes]:
    """The four bodies: 64- and 1,000-entry LMCache STORE bodies, an 8,192-token
    ``token_ids`` lookup and the same tokens as a ``tokens_b64`` lookup."""
    from blendmatch.bench.events import make_requests

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128_000, size=8192, dtype=np.uint32)
    return {
        "store_64": json.dumps(make_requests(64, 64, chunk_size, seed=seed)[0]).encode(),
        "store_1000": json.dumps(make_requests(1000, 1000, chunk_size, seed=seed)[0]).encode(),
        "lookup_token_ids_8192": json.dumps({"model_name": "m", "token_ids": ids.tolist()}).encode(),
        "lookup_tokens_b64_8192": json.dumps({"tokens_b64": base64.b64encode(ids.astype("<u4").tobytes()).decode(),
                                              "model_name": "m"}).encode(),
    }


def _median_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def measure(repeat: int = 50) -> dict[str, dict[str, float]]:
    """``{body: {way: median us}}`` (a way that does not apply to a body is absent)."""
    import msgspec

    from blendmatch.index.tokens import split_b64_value, split_token_arrays
    from blendmatch.index.wire import parse_event_body
    from blendmatch.index.wire_models import EventRequestModel
    from blendmatch.index.wire_scan import entry_columns, split_entries
    from blendmatch.service.fastpath import parse_body
    from blendmatch.service.schemas import BlendLookupRequest

    try:
        import orjson
    except ImportError:  # optional: the comparison is skipped
        orjson = None
    decode = msgspec.json.decode
    out: dict[str, dict[str, float]] = {}
    for name, raw in bodies().items():
        ways: dict[str, Callable[[], Any]] = {}
        if name.startswith("store"):
            ways["_jsonentries: split_entries"] = lambda raw=raw: split_entries(raw)
            ways["_jsonentries + columns"] = lambda raw=raw: entry_columns(split_entries(raw))
            ways["_jsontok: split_token_arrays"] = lambda raw=raw: split_token_arrays(raw)
            ways["parse_event_body (scanner + pydantic rest)"] = lambda raw=raw: parse_event_body(raw)
            ways["pydantic EventRequestModel.model_validate_json"] = \
                lambda raw=raw: EventRequestModel.model_validate_json(raw)
        else:
            if "token_ids" in name:
                ways["_jsontok: split_token_arrays"] = lambda raw=raw: split_token_arrays(raw)
            else:
                ways["split_b64_value"] = lambda raw=raw: split_b64_value(raw)
            ways["fastpath.parse_body"] = lambda raw=raw: parse_body(BlendLookupRequest, raw)
            ways["pydantic BlendLookupRequest.model_validate_json"] = \
                lambda raw=raw: BlendLookupRequest.model_validate_json(raw)
        ways["msgspec.json.decode (parse only)"] = lambda raw=raw: decode(raw)
        if orjson is not None:
            ways["orjson.loads (parse only)"] = lambda raw=raw: orjson.loads(raw)
        if "token_ids" in name:
            ways["msgspec + uint32"] = lambda raw=raw: np.asarray(decode(raw)["token_ids"], dtype=np.uint32)
            if orjson is not None:
                ways["orjson + uint32"] = lambda raw=raw: np.asarray(orjson.loads(raw)["token_ids"], dtype=np.uint32)
        ways["json.loads (parse only)"] = lambda raw=raw: json.loads(raw)
        out[f"{name} ({len(raw):,} B)"] = {way: _median_us(fn, repeat) for way, fn in ways.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=50, help="timed calls per way; the median is reported")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    got = measure(args.repeat)
    for body, ways in got.items():
        print(body)
        base = min(v for k, v in ways.items() if k.startswith("pydantic"))
        for way, us in ways.items():
            print(f"  {way:48s} {us:10.1f} us  {us / base:6.2f}x pydantic")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=2)


if __name__ == "__main__":
    main()
