"""LMCache's token hasher, bit for bit: a request's full chunks -> their prefix-chained hashes.

Question answered: "which ``chunk_hash`` did the fleet's servers store the k-th full chunk of
this token sequence under?" The servers name a chunk by a hash of its tokens chained to the
hash of the chunk before it (LMCache 0.5.6, ``lmcache/v1/multiprocess/token_hasher.py``):

    h_0 = NONE_HASH;  h_k = H((h_{k-1}, tuple(tokens[k*C:(k+1)*C]), None))

and only full chunks are hashed (a trailing partial chunk has no key). ``H`` is the
``--hash-algorithm`` (:data:`ALGORITHMS`), loaded as LMCache loads it:

- ``blake3`` (LMCache's default, its own function): blake3 of the previous hash's bytes (an
  int prefix as 8 big-endian signed bytes) followed by the tokens as big-endian uint32.
  ``NONE_HASH = H((0, (0,), None))``. Token ids outside ``0..2^32-1`` cannot be hashed.
- ``sha256_cbor`` (vLLM's ``vllm.utils.hashing.sha256_cbor``): sha256 of the canonical CBOR
  encoding of the tuple. ``sha256_cbor_64bit``, vLLM's old name, is the same function (LMCache
  asks vLLM for ``sha256_cbor`` first).
- ``sha256`` (vLLM's ``sha256``): sha256 of the tuple pickled with the highest protocol.

For vLLM's functions, ``NONE_HASH = H(seed)`` (vLLM's ``init_none_hash``, which LMCache calls):
the seed is ``PYTHONHASHSEED`` when it is set, else ``"vllm-none-hash"``
(:func:`vllm_none_hash_seed`); a coordinator that cannot load vLLM's ``kv_cache_utils``
falls back to ``H((0, (0,), None))`` instead (``none_hash_seed=None`` here).

Pure functions of their arguments: nothing here reads the environment except
:func:`vllm_none_hash_seed`, which takes it as a mapping; ``blake3`` and ``cbor2`` are
imported when an algorithm needs them.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "VLLM_DEFAULT_NONE_HASH_SEED",
    "TokenHasher",
    "UnknownHashAlgorithm",
    "vllm_none_hash_seed",
]

#: LMCache's ``--hash-algorithm`` default.
DEFAULT_ALGORITHM = "blake3"
#: The names ``--hash-algorithm`` takes here (LMCache's default and vLLM's cryptographic ones).
ALGORITHMS = ("blake3", "sha256_cbor", "sha256_cbor_64bit", "sha256")
#: vLLM's seed for NONE_HASH when ``PYTHONHASHSEED`` is not set (cryptographic algorithms).
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: The seed tuple LMCache hashes for NONE_HASH when it does not get one from vLLM.
_FALLBACK_SEED_INPUT = (0, (0,), None)


class UnknownHashAlgorithm(ValueError):
    """A ``--hash-algorithm`` this hasher does not implement; the message lists those it does."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown --hash-algorithm {name!r}; supported: {', '.join(ALGORITHMS)} "
                         f"(LMCache's default is {DEFAULT_ALGORITHM!r})")
        self.name = name


def vllm_none_hash_seed(environ: Mapping[str, str]) -> str:
    """The seed vLLM derives NONE_HASH from for a cryptographic hash: ``PYTHONHASHSEED`` when
    set, else ``"vllm-none-hash"`` (vLLM's ``resolve_none_hash_seed``)."""
    seed = environ.get("PYTHONHASHSEED")
    return VLLM_DEFAULT_NONE_HASH_SEED if seed is None else seed


def _blake3_hash(args: tuple[Any, Any, None]) -> bytes:
    import blake3  # noqa: PLC0415 - only this algorithm needs it

    prefix, tokens, _ = args
    h = blake3.blake3()
    if isinstance(prefix, bytes):
        h.update(prefix)
    elif isinstance(prefix, int):
        h.update(prefix.to_bytes(8, byteorder="big", signed=True))
    else:
        h.update(bytes(prefix))
    h.update(_tokens_be_u32(tokens))
    return h.digest()


def _tokens_be_u32(tokens: Any) -> bytes:
    """``struct.pack(">{n}I", *tokens)`` without a Python call per token."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.dtype == np.uint32:  # every value fits: no range scan (the service's token arrays)
        return arr.astype(">u4").tobytes()
    if arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise ValueError("token ids must be integers in 0..4294967295 for blake3 hashing")
    return arr.astype(">u4", copy=False).tobytes()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # noqa: PLC0415 - only this algorithm needs it

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "blake3": _blake3_hash,
    "sha256_cbor": _sha256_cbor,
    "sha256_cbor_64bit": _sha256_cbor,
    "sha256": _sha256_pickle,
}


class TokenHasher:
    """Prefix-chained chunk hashes of token sequences, as LMCache's servers compute them.

    ``TokenHasher(algorithm, chunk_size, none_hash_seed=...)``; ``none_hash_seed`` matters
    for vLLM's algorithms only (``blake3`` always seeds with ``H((0, (0,), None))``): a
    string seeds with ``H(seed)`` (vLLM's rule; pass :func:`vllm_none_hash_seed` of the
    fleet's environment), ``None`` with ``H((0, (0,), None))`` (LMCache's fallback).
    Raises :class:`UnknownHashAlgorithm` for a name not in :data:`ALGORITHMS`, and
    ``ImportError`` with the install hint when the algorithm's package is missing.
    Thread-safe (no state changes after construction).
    """

    __slots__ = ("algorithm", "chunk_size", "none_hash", "_fn", "_blake3")

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM, chunk_size: int = 256, *,
                 none_hash_seed: Optional[str] = VLLM_DEFAULT_NONE_HASH_SEED) -> None:
        if algorithm not in _FUNCTIONS:
            raise UnknownHashAlgorithm(algorithm)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        package = {"blake3": "blake3", "sha256_cbor": "cbor2", "sha256_cbor_64bit": "cbor2"}.get(algorithm)
        if package is not None:
            try:
                __import__(package)
            except ImportError as exc:
                raise ImportError(f"--hash-algorithm {algorithm} needs the {package!r} package "
                                  f"(pip install {package})") from exc
        self.algorithm = algorithm
        self.chunk_size = chunk_size
        self._fn = _FUNCTIONS[algorithm]
        self._blake3 = algorithm == "blake3"
        if self._blake3 or none_hash_seed is None:
            self.none_hash: bytes = self._fn(_FALLBACK_SEED_INPUT)
        else:
            self.none_hash = self._fn(none_hash_seed)

    def __repr__(self) -> str:
        return f"TokenHasher({self.algorithm!r}, chunk_size={self.chunk_size})"

    def num_chunks(self, num_tokens: int) -> int:
        """Full chunks in a sequence of ``num_tokens`` tokens (the keys it resolves to)."""
        return num_tokens // self.chunk_size

    def hash_chunk(self, tokens: Sequence[int], prefix_hash: Optional[bytes] = None) -> bytes:
        """One chunk's hash, chained to ``prefix_hash`` (default NONE_HASH)."""
        prefix = self.none_hash if prefix_hash is None else prefix_hash
        if self._blake3:
            return self._fn((prefix, tokens, None))
        return self._fn((prefix, tuple(tokens), None))

    def chunk_hashes(self, tokens: Any, *, start: int = 0, end: Optional[int] = None,
                     prefix_hash: Optional[bytes] = None) -> list[bytes]:
        """The hash of every full chunk of ``tokens`` (a sequence of ints or an integer
        array, from position 0), chained from ``prefix_hash`` (default NONE_HASH).

        Like LMCache's ``compute_chunk_hashes``: hashing stops at ``end`` (default: the
        sequence's end) and only the chunks starting at or after ``start`` are returned;
        ``start`` and ``end`` are token positions, multiples of ``chunk_size``. A trailing
        partial chunk is ignored. Raises ``ValueError`` for a token ``blake3`` cannot hash
        (outside ``0..2^32-1``).
        """
        c = self.chunk_size
        n = len(tokens) if end is None else min(len(tokens), end)
        n -= n % c
        if n == 0:
            return []
        prefix = self.none_hash if prefix_hash is None else prefix_hash
        if self._blake3:  # the sequence as big-endian bytes once, then one C call per chunk
            return _blake3_chain(_tokens_be_u32(np.asarray(tokens[:n])), prefix, 4 * c, 4 * start)
        seq = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
        fn = self._fn
        out: list[bytes] = []
        for i in range(0, n, c):
            prefix = fn((prefix, tuple(seq[i:i + c]), None))
            if i >= start:
                out.append(prefix)
        return out


def _blake3_chain(data: bytes, prefix: bytes, step: int, start: int) -> list[bytes]:
    """:func:`_blake3_hash` chained over ``data`` (tokens as big-endian uint32 bytes) in
    windows of ``step`` bytes: the same digests, without converting each window (the
    per-chunk conversion cost about twice the hash itself; the routing score and the reuse
    metrics hash request prefixes on the lookup thread). Returns the digests of the windows
    starting at byte ``start`` or later."""
    import blake3  # noqa: PLC0415 - only this algorithm needs it

    view = memoryview(data)
    out: list[bytes] = []
    for i in range(0, len(data), step):
        h = blake3.blake3(prefix)
        h.update(view[i:i + step])
        prefix = h.digest()
        if i >= start:
            out.append(prefix)
    return out
