"""THE content fingerprint: one definition, used by the index, every engine and the tests.

Question answered: "which 64-bit value names this window of ``C`` tokens, and where does
that value live in the slot array?"

Definition (LMCache's blend-index constant, bit-exact; docs/architecture.md, the rooms table)::

    F(x_0..x_{C-1}) = sum_i x_i * B^(C-1-i)  mod 2^64,   B = 0x9E3779B97F4A7C15

Tokens are uint32 ids widened to uint64 and used as they are; the accumulator starts at 0
(Horner: ``h = h*B + x``). Three forms are provided and must agree bit for bit:

- chunk form (:func:`chunk_fingerprint`, :func:`chunk_fingerprints`): one window at a time
  or a 2-D stack of windows (the ingest path);
- rolling form (:func:`rolling_fingerprints`, numba): ``H_j = (H_{j-1} - q[j-1]*B^(C-1))*B
  + q[j+C-1]``, O(1) per window (the CPU engine's inner loop uses :func:`roll_step`);
- prefix form (:func:`prefix_fingerprints`): with ``Binv = B^-1 mod 2^64`` and
  ``S[k] = sum_{j<k} q[j]*Binv^j``, ``H_i = (S[i+C]-S[i]) * B^(i+C-1)``. Pure array code
  (multiply, cumsum, gather) taking an ``xp`` module, so the same lines run on numpy in CI
  and on CuPy on a GPU.

Slot and tag (decided once, here): the low bits of F are weak (bit 0 is the parity of the
token sum), so both come from ``m = fmix64(F)`` (murmur3's 64-bit finaliser):
``slot = m & (table_size - 1)`` (low bits of the mixed value) and
``tag = 1 + ((m >> 56) * 254 >> 8)`` (top byte folded into 1..254; 0 means empty and 255
shared, see ``index/slots.py``). Slot and tag use disjoint bits of ``m`` for any table up
to 2^56 slots, so they are independent.

Home: the bottom room (``gpu/``), because every engine hashes; ``index/`` (slots, storage,
the blend index) imports it from here. It is a leaf: numpy and numba only, nothing of the
project. It takes uint32 arrays: the token rules (what a token id is, the wire forms,
limits) live in ``index/tokens.py``, above it.
"""

from __future__ import annotations

from functools import lru_cache
from types import ModuleType
from typing import Any

import numba
import numpy as np

__all__ = [
    "FP_BASE",
    "FP_BASE_INV",
    "TAG_EMPTY",
    "TAG_SHARED",
    "B_U64",
    "FMIX_C1",
    "FMIX_C2",
    "base_powers",
    "chunk_fingerprint",
    "chunk_fingerprints",
    "rolling_fingerprints",
    "prefix_fingerprints",
    "mix64",
    "slot_of",
    "tag_of",
    "slots_and_tags",
    "roll_step",
    "mix64_scalar",
    "tag_of_mixed",
]

_M64 = (1 << 64) - 1

#: The fleet constant (the 64-bit golden ratio). Odd, hence invertible mod 2^64.
FP_BASE = 0x9E3779B97F4A7C15
#: ``B^-1 mod 2^64``, for the prefix form.
FP_BASE_INV = pow(FP_BASE, -1, 1 << 64)

#: Slot value of an empty slot.
TAG_EMPTY = 0
#: Slot value of a slot holding two or more fingerprints (or stale after a removal).
TAG_SHARED = 255

#: ``FP_BASE`` as a numpy uint64 scalar (what compiled code multiplies by).
B_U64 = np.uint64(FP_BASE)
#: murmur3 fmix64 multipliers (the mixing step; the GPU kernels are rendered from these).
FMIX_C1 = np.uint64(0xFF51AFD7ED558CCD)
FMIX_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S56 = np.uint64(56)
_S8 = np.uint64(8)
_U254 = np.uint64(254)
_U1 = np.uint64(1)



def _uint32(tokens: Any) -> np.ndarray:
    """``tokens`` as a 1-D uint32 array. Callers pass validated ids (``index/tokens.py`` owns
    the token rules); a plain list of ids is converted by numpy for convenience."""
    arr = tokens if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 else np.asarray(tokens, dtype=np.uint32)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    return arr


@lru_cache(maxsize=64)
def base_powers(chunk_size: int) -> np.ndarray:
    """``[B^(C-1), B^(C-2), ..., B^0]`` as uint64 (read-only; cached per C)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    pows = np.empty(chunk_size, dtype=np.uint64)
    p = 1
    for i in range(chunk_size - 1, -1, -1):
        pows[i] = p
        p = (p * FP_BASE) & _M64
    pows.setflags(write=False)
    return pows


def chunk_fingerprint(tokens: Any) -> int:
    """F of one window (the whole of ``tokens``), as a Python int in 0..2^64-1."""
    arr = _uint32(tokens)
    if arr.size == 0:
        return 0
    with np.errstate(over="ignore"):
        return int((arr.astype(np.uint64) * base_powers(arr.size)).sum(dtype=np.uint64))


def chunk_fingerprints(tokens2d: np.ndarray) -> np.ndarray:
    """F of each row of a 2-D uint32 array ``(n, C)`` -> uint64 ``(n,)`` (the ingest path)."""
    if tokens2d.ndim != 2:
        raise ValueError(f"expected a 2-D (n, chunk_size) array, got shape {tokens2d.shape}")
    n, c = tokens2d.shape
    if n == 0 or c == 0:
        return np.zeros(n, dtype=np.uint64)
    return _chunk_fingerprints_nb(np.ascontiguousarray(tokens2d, dtype=np.uint32), base_powers(c))


@numba.njit(cache=True, nogil=True)
def _chunk_fingerprints_nb(tokens2d, pows):  # pragma: no cover - compiled
    n, c = tokens2d.shape
    out = np.empty(n, dtype=np.uint64)
    for r in range(n):
        h = np.uint64(0)
        for i in range(c):
            h += np.uint64(tokens2d[r, i]) * pows[i]
        out[r] = h
    return out


@numba.njit(inline="always", nogil=True)
def roll_step(h, out_token, in_token, top_power):  # pragma: no cover - compiled
    """One rolling step: drop ``out_token`` (weight ``B^(C-1)``), shift, add ``in_token``."""
    return (h - np.uint64(out_token) * top_power) * B_U64 + np.uint64(in_token)


@numba.njit(inline="always", nogil=True)
def mix64_scalar(h):  # pragma: no cover - compiled
    """murmur3 fmix64 of one uint64 (numba scalar form of :func:`mix64`)."""
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return h


@numba.njit(inline="always", nogil=True)
def tag_of_mixed(m):  # pragma: no cover - compiled
    """Tag (1..254) of an already-mixed value (numba scalar form of :func:`tag_of`)."""
    return np.uint8(np.uint64(1) + (((m >> np.uint64(56)) * np.uint64(254)) >> np.uint64(8)))


def rolling_fingerprints(tokens: Any, chunk_size: int) -> np.ndarray:
    """F of every window ``tokens[j:j+C]``, j = 0..n-C, by the rolling form (uint64)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    arr = _uint32(tokens)
    if arr.size < chunk_size:
        return np.zeros(0, dtype=np.uint64)
    return _rolling_nb(arr, chunk_size, base_powers(chunk_size)[0])


@numba.njit(cache=True, nogil=True)
def _rolling_nb(q, c, top):  # pragma: no cover - compiled
    n = q.shape[0] - c + 1
    out = np.empty(n, dtype=np.uint64)
    h = np.uint64(0)
    for i in range(c):
        h = h * B_U64 + np.uint64(q[i])
    out[0] = h
    for j in range(1, n):
        h = roll_step(h, q[j - 1], q[j + c - 1], top)
        out[j] = h
    return out


@lru_cache(maxsize=8)
def _power_table(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(B^k, Binv^k)`` for k = 0..n-1 as uint64 (host arrays, cached)."""
    with np.errstate(over="ignore"):
        fw = np.full(n, FP_BASE, dtype=np.uint64)
        bw = np.full(n, FP_BASE_INV, dtype=np.uint64)
        fw[0] = 1
        bw[0] = 1
        fw = np.cumprod(fw, dtype=np.uint64)
        bw = np.cumprod(bw, dtype=np.uint64)
    fw.setflags(write=False)
    bw.setflags(write=False)
    return fw, bw


def power_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Host ``(B^k, Binv^k)`` for k < n, rounded up to a power of two for cache reuse."""
    size = 1 << max(10, int(n - 1).bit_length())
    return _power_table(size)


def prefix_fingerprints(tokens: Any, chunk_size: int, xp: ModuleType = np,
                        pow_fwd: Any = None, pow_inv: Any = None) -> Any:
    """F of every window by the prefix form, in array code for any ``xp`` (numpy or cupy).

    ``tokens`` must already be an ``xp`` uint32 array. ``pow_fwd``/``pow_inv`` are optional
    ``xp`` arrays of at least ``len(tokens)+1`` powers (``B^k``, ``Binv^k``) so a GPU caller
    can keep them resident; without them they are built from the cached host tables.
    Returns an ``xp`` uint64 array of length ``max(0, n-C+1)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = int(tokens.shape[0])
    if n < chunk_size:
        return xp.zeros(0, dtype=xp.uint64)
    if pow_fwd is None or pow_inv is None:
        fw, bw = power_tables(n + 1)
        pow_fwd, pow_inv = xp.asarray(fw), xp.asarray(bw)
    q = tokens.astype(xp.uint64)
    s = xp.empty(n + 1, dtype=xp.uint64)
    s[0] = 0
    xp.cumsum(q * pow_inv[:n], out=s[1:])
    w = n - chunk_size + 1
    return (s[chunk_size:chunk_size + w] - s[:w]) * pow_fwd[chunk_size - 1:chunk_size - 1 + w]


def mix64(h: Any, xp: ModuleType = np) -> Any:
    """murmur3 fmix64 over a uint64 array (any ``xp``)."""
    h = h ^ (h >> _S33)
    h = h * FMIX_C1
    h = h ^ (h >> _S33)
    h = h * FMIX_C2
    return h ^ (h >> _S33)


def tag_of(h: Any, xp: ModuleType = np) -> Any:
    """Tag (uint8, 1..254) of fingerprints ``h`` (uint64 array or scalar)."""
    m = mix64(xp.asarray(h, dtype=xp.uint64), xp)
    return (_U1 + (((m >> _S56) * _U254) >> _S8)).astype(xp.uint8)


def slot_of(h: Any, mask: int, xp: ModuleType = np) -> Any:
    """Slot index (int64) of fingerprints ``h`` in a table of ``mask+1`` slots."""
    m = mix64(xp.asarray(h, dtype=xp.uint64), xp)
    return (m & np.uint64(mask)).astype(xp.int64)


def slots_and_tags(h: Any, mask: int, xp: ModuleType = np) -> tuple[Any, Any]:
    """Both :func:`slot_of` and :func:`tag_of` from one mixing pass."""
    m = mix64(xp.asarray(h, dtype=xp.uint64), xp)
    return (m & np.uint64(mask)).astype(xp.int64), (_U1 + (((m >> _S56) * _U254) >> _S8)).astype(xp.uint8)
