"""The token hasher (``index/token_hasher.py``): its rules, and bit-exactness with LMCache
0.5.6's own ``TokenHasher`` (from its wheel, with vLLM's hash functions from vLLM's wheel) on
random sequences, for every algorithm and NONE_HASH seed rule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from blendmatch.index.token_hasher import ALGORITHMS, TokenHasher, UnknownHashAlgorithm, vllm_none_hash_seed
from blendmatch.service.config import ServiceConfig
from test_lmcache_compat import DRIVER, ROOT, lmcache_site  # noqa: F401 - the fixture
from vllm_hashing import VLLM_VERSION, build_site


def test_unknown_algorithm_names_the_supported_ones():
    with pytest.raises(UnknownHashAlgorithm, match="supported: blake3, sha256_cbor, sha256_cbor_64bit, sha256"):
        TokenHasher("md5", 256)
    with pytest.raises(ValueError, match="chunk_size"):
        TokenHasher("blake3", 0)


def test_serve_refuses_an_unknown_algorithm_at_start(capsys):
    """``blendmatch serve --hash-algorithm md5`` is a usage error naming the flag, the bad
    name and the supported ones, before anything starts (no socket, no engine)."""
    from blendmatch.service import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--port", "0", "--hash-algorithm", "md5"])
    err = capsys.readouterr().err
    assert ei.value.code == 2, err
    assert "--hash-algorithm: " in err and "unknown --hash-algorithm 'md5'" in err
    assert "supported: blake3, sha256_cbor, sha256_cbor_64bit, sha256" in err
    for name in ALGORITHMS:  # every supported name is a valid setting, and its hasher builds
        assert ServiceConfig(hash_algorithm=name).hash_algorithm == name
        assert TokenHasher(name, 4).algorithm == name


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_full_chunks_only_chained_and_windowed(algorithm):
    h = TokenHasher(algorithm, 4)
    seq = list(range(100, 111))  # 2 full chunks + 3 tokens
    full = h.chunk_hashes(seq)
    assert len(full) == 2 and all(isinstance(x, bytes) and len(x) == 32 for x in full)
    assert h.chunk_hashes(seq[:3]) == [] and h.num_chunks(11) == 2
    assert full[0] == h.hash_chunk(seq[:4]) and full[1] == h.hash_chunk(seq[4:8], full[0])
    assert h.chunk_hashes(np.array(seq, dtype=np.uint32)) == full == h.chunk_hashes(np.array(seq, dtype=np.int64))
    assert h.chunk_hashes(seq, start=4) == full[1:] and h.chunk_hashes(seq, end=4) == full[:1]
    # prefix chaining: the same chunk after another prefix hashes differently
    assert h.chunk_hashes([1, 2, 3, 4] + seq[4:8])[1] != full[1]
    assert h.chunk_hashes(seq, prefix_hash=b"\x01" * 32) != full


def test_blake3_refuses_tokens_it_cannot_pack():
    h = TokenHasher("blake3", 2)
    for bad in ([1, -1], [1, 2**32]):
        with pytest.raises(ValueError, match="0..4294967295"):
            h.chunk_hashes(bad)
    assert h.chunk_hashes([1, 2**32 - 1]) == [h.hash_chunk([1, 2**32 - 1])]


def test_seed_rules():
    assert vllm_none_hash_seed({}) == "vllm-none-hash" and vllm_none_hash_seed({"PYTHONHASHSEED": "7"}) == "7"
    # blake3 never takes a seed; vLLM's functions do, and None is LMCache's fallback seed
    assert TokenHasher("blake3", 4, none_hash_seed="7").none_hash == TokenHasher("blake3", 4).none_hash
    a, b, c = (TokenHasher("sha256_cbor", 4, none_hash_seed=s).none_hash for s in ("vllm-none-hash", "7", None))
    assert len({a, b, c}) == 3


@pytest.fixture(scope="session")
def vllm_site() -> Path:
    target = ROOT / ".pytest_cache" / f"vllm-hashing-{VLLM_VERSION}"
    why = build_site(target)
    if why is not None:
        pytest.skip(f"vllm=={VLLM_VERSION} wheel could not be fetched: {why}")
    return target


def _lmcache_hashes(site: Path, python_path: list[Path], spec: dict, tmp_path: Path, seed: str | None) -> dict:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in [site, *python_path])
    got = subprocess.run([sys.executable, str(DRIVER), str(site), "hashes", str(spec_file)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=str(ROOT))
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def _random_sequences(rng: np.random.Generator, chunk_size: int) -> list[list[int]]:
    lengths = [0, 1, chunk_size - 1, chunk_size, chunk_size + 1, 3 * chunk_size, 5 * chunk_size + 7]
    lengths += rng.integers(0, 8 * chunk_size, size=8).tolist()
    # ids across the whole uint32 range, and small ones (a real vocabulary)
    return [rng.integers(0, 2**32, size=n, dtype=np.uint64).tolist() if i % 2 else
            rng.integers(0, 150_000, size=n).tolist() for i, n in enumerate(lengths)]


@pytest.mark.compat
@pytest.mark.parametrize("case", ["vllm-default-seed", "pythonhashseed", "no-kv-cache-utils"])
def test_bit_exact_with_lmcaches_token_hasher(lmcache_site, vllm_site, tmp_path, case):
    """LMCache's TokenHasher (vLLM's functions loaded as it loads them) and ours agree on
    NONE_HASH and every chunk hash, for every algorithm, chunk sizes 4 and 256, random
    sequences; under vLLM's default seed, a PYTHONHASHSEED, and LMCache's fallback when
    vLLM's kv_cache_utils cannot be imported."""
    vllm_path = vllm_site
    seed = "20261203" if case == "pythonhashseed" else None
    if case == "no-kv-cache-utils":
        vllm_path = tmp_path / "vllm-without-v1"
        shutil.copytree(vllm_site, vllm_path, ignore=shutil.ignore_patterns("v1"))
    rng = np.random.default_rng({"vllm-default-seed": 1, "pythonhashseed": 2, "no-kv-cache-utils": 3}[case])
    for chunk_size in (4, 256):
        sequences = _random_sequences(rng, chunk_size)
        theirs = _lmcache_hashes(lmcache_site, [vllm_path], {"chunk_size": chunk_size, "algorithms": list(ALGORITHMS),
                                                              "sequences": sequences}, tmp_path, seed)
        for algorithm in ALGORITHMS:
            if case == "no-kv-cache-utils":
                none_seed = None
            else:
                none_seed = vllm_none_hash_seed({} if seed is None else {"PYTHONHASHSEED": seed})
            ours = TokenHasher(algorithm, chunk_size, none_hash_seed=none_seed)
            assert ours.none_hash.hex() == theirs[algorithm]["none_hash"], (algorithm, chunk_size)
            got = [[h.hex() for h in ours.chunk_hashes(seq)] for seq in sequences]
            assert got == theirs[algorithm]["chunks"], (algorithm, chunk_size)
            assert sum(map(len, got)) >= 20
