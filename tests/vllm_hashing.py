"""vLLM's own hash functions for LMCache's ``TokenHasher``, without vLLM's runtime.

LMCache loads ``sha256_cbor`` / ``sha256`` through ``vllm.utils.hashing.get_hash_fn_by_name``
and seeds NONE_HASH through ``vllm.v1.core.kv_cache_utils.init_none_hash``. vLLM itself
needs torch and CUDA, so :func:`vllm_hashing_site` lays out a minimal ``vllm`` package from
the real wheel (``pip download --no-deps``, pinned): ``vllm/utils/hashing.py`` verbatim, and a
``kv_cache_utils`` holding the wheel's own ``resolve_none_hash_seed`` and ``init_none_hash``
(and their constants), cut out of its source by ``ast`` and compiled unchanged. Everything
else of the package is empty ``__init__`` files. The wheel is deleted once the files are out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

VLLM_VERSION = "0.34.0"
_KV_NAMES = {"DEFAULT_NONE_HASH_SEED", "_NON_CRYPTO_HASH_FUNCTIONS", "_NONE_HASH_SEED", "resolve_none_hash_seed",
             "init_none_hash"}
_KV_PREAMBLE = '''"""vLLM's kv_cache_utils, only what LMCache's TokenHasher calls (cut from the wheel)."""
from __future__ import annotations

import logging
import os
from vllm.utils.hashing import xxhash, xxhash_cbor

logger = logging.getLogger("vllm.v1.core.kv_cache_utils")
BlockHash = bytes
NONE_HASH = None

'''


def build_site(target: Path) -> str | None:
    """Lay out the minimal package under ``target`` (reused when present); returns None on
    success, else why the wheel could not be fetched."""
    marker = target / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    if marker.exists():
        return None
    download = target.parent / f"vllm-{VLLM_VERSION}-wheel"
    download.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
           "--platform", "manylinux_2_28_x86_64", "--dest", str(download), f"vllm=={VLLM_VERSION}"]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wheels = sorted(download.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if got.returncode != 0 or not wheels:
        return (got.stderr or got.stdout)[-300:]
    with zipfile.ZipFile(wheels[0]) as wheel:
        hashing = wheel.read("vllm/utils/hashing.py").decode()
        kv_source = wheel.read("vllm/v1/core/kv_cache_utils.py").decode()
    kept = [node for node in ast.parse(kv_source).body
            if (isinstance(node, ast.FunctionDef) and node.name in _KV_NAMES)
            or (isinstance(node, (ast.Assign, ast.AnnAssign)) and _assigned(node) & _KV_NAMES)]
    found = {name for node in kept for name in ({node.name} if isinstance(node, ast.FunctionDef) else _assigned(node))}
    if found != _KV_NAMES:
        raise RuntimeError(f"vllm {VLLM_VERSION}'s kv_cache_utils lacks {sorted(_KV_NAMES - found)}")
    for package in ("vllm", "vllm/utils", "vllm/v1", "vllm/v1/core"):
        (target / package).mkdir(parents=True, exist_ok=True)
        (target / package / "__init__.py").write_text("")
    (target / "vllm" / "utils" / "hashing.py").write_text(hashing)
    marker.write_text(_KV_PREAMBLE + "\n\n".join(ast.get_source_segment(kv_source, node) for node in kept) + "\n")
    for wheel_file in wheels:
        wheel_file.unlink()
    return None


def _assigned(node: ast.AST) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}
