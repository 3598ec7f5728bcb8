"""Brute-force oracles for the tests: the big-integer fingerprint and a dict-based model of the
blend index semantics (index/blend_index.py, index/verify.py), written for obviousness, not speed."""

from __future__ import annotations

from blendmatch.index.types import BlendMatch, BlendNamespace

B = 0x9E3779B97F4A7C15
M64 = (1 << 64) - 1


def big_fingerprint(tokens) -> int:
    """``sum x_i * B^(C-1-i) mod 2^64`` with Python big integers."""
    c = len(tokens)
    pows = _powers(c)
    return sum(int(x) * pows[i] for i, x in enumerate(tokens)) & M64


_POWERS: dict[int, list[int]] = {}


def _powers(c: int) -> list[int]:
    if c not in _POWERS:
        _POWERS[c] = [pow(B, c - 1 - i, 1 << 64) for i in range(c)]
    return _POWERS[c]


def thue_morse(n_bits: int) -> list[int]:
    """Thue-Morse sequence of length 2^n_bits (0/1). With its complement it collides under any
    odd-base polynomial hash mod 2^64 once n_bits >= 11: the classic anti-hash pair."""
    return [bin(i).count("1") & 1 for i in range(1 << n_bits)]


class OracleIndex:
    """The blend index as a list of contents, each a list of occupants (first-indexed order)."""

    def __init__(self, chunk_size: int, probe_stride: int = 1) -> None:
        self.c = chunk_size
        self.s = probe_stride
        # fp -> (tokens tuple, [[hash, offset, set(ns)], ...])
        self.contents: dict[int, tuple[tuple[int, ...], list[list]]] = {}

    def add(self, tokens, h: bytes, off: int, ns: BlendNamespace) -> bool:
        t = tuple(int(x) for x in tokens)
        if len(t) != self.c:
            return False
        fp = big_fingerprint(t)
        entry = self.contents.get(fp)
        if entry is None:
            if off == -1:
                return False
            self.contents[fp] = (t, [[h, off, {ns}]])
            return True
        if entry[0] != t:
            return False
        for occ in entry[1]:
            if occ[0] == h:
                if off != -1:
                    occ[1] = off
                occ[2].add(ns)
                return True
        if off == -1:
            return False
        entry[1].append([h, off, {ns}])
        return True

    def _find(self, tokens, h):
        t = tuple(int(x) for x in tokens)
        if len(t) != self.c:
            return None, None
        fp = big_fingerprint(t)
        entry = self.contents.get(fp)
        if entry is None or entry[0] != t:
            return None, None
        for occ in entry[1]:
            if occ[0] == h:
                return fp, occ
        return None, None

    def _drop_if_empty(self, fp, occ) -> None:
        occs = self.contents[fp][1]
        if not occ[2]:
            occs.remove(occ)
        if not occs:
            del self.contents[fp]

    def remove_claim(self, tokens, h, ns) -> bool:
        fp, occ = self._find(tokens, h)
        if occ is None or ns not in occ[2]:
            return False
        occ[2].discard(ns)
        self._drop_if_empty(fp, occ)
        return True

    def remove_chunk(self, tokens, h) -> bool:
        fp, occ = self._find(tokens, h)
        if occ is None:
            return False
        occ[2].clear()
        self._drop_if_empty(fp, occ)
        return True

    def match(self, q, ns) -> list[BlendMatch]:
        q = [int(x) for x in q]
        out, seen = [], set()
        # content lookup by tokens (exact); fingerprints only decide collisions at add time
        by_tokens = {entry[0]: entry for entry in self.contents.values()}
        for st in range(0, len(q) - self.c + 1, self.s):
            entry = by_tokens.get(tuple(q[st:st + self.c]))
            if entry is None:
                continue
            # LMCache's per-position rule: the first claimed, unseen occupant, then move on
            for h, off, claims in entry[1]:
                if ns in claims and h not in seen:
                    seen.add(h)
                    out.append(BlendMatch(h, off, st))
                    break
        return out

    def counts(self) -> dict[str, int]:
        occs = [o for _, os_ in self.contents.values() for o in os_]
        return {
            "num_contents": len(self.contents),
            "num_chunks": len(occs),
            "num_claims": sum(len(o[2]) for o in occs),
            "num_namespaces": len({n for o in occs for n in o[2]}),
        }
