"""Which stored content the blend index may offer, and to whom: the one indexable rule.

Question answered: "does this applied STORE entry feed the blend index, and if not, why?"
:func:`indexable_reason` is the rule; the ingest path (``ingest.py``) counts its answers in
``entries_not_indexable`` and claims content for a namespace only where it says None
(:func:`content_indexable` and :func:`namespace_indexable` are its two halves, for the
claims made when a key joins content stored earlier). Reasons, in order of precedence:

- ``tokens_outside_uint32``: the entry's ids are not all token ids (its binding is left
  unfilled, ``wire.py``);
- ``wrong_length``: the content is not one chunk (the index holds chunks only);
- ``world_size_0``: the key's world size is 0; no lookup can ask for it
  (``world_size >= 1``), so its namespace is never claimed;
- ``token_offset_unknown``: ``token_offset`` -1 and no known offset for this content (a
  wrong ``old_st`` is never offered).
"""

from __future__ import annotations

from typing import Optional

from .types import BlendNamespace

__all__ = ["NOT_INDEXABLE_REASONS", "content_indexable", "indexable_reason", "namespace_indexable"]

#: Why an applied STORE entry fed nothing to the blend index (at most one each, in this
#: order of precedence; see the module docstring).
NOT_INDEXABLE_REASONS = ("tokens_outside_uint32", "wrong_length", "world_size_0", "token_offset_unknown")


def namespace_indexable(ns: BlendNamespace) -> bool:
    """May content be claimed for ``ns``? Not for world size 0 (no lookup asks for it)."""
    return ns.world_size != 0


def content_indexable(length: int, chunk_size: int, offset: int) -> bool:
    """May content of ``length`` ids at ``offset`` (-1 unknown) be indexed at all?"""
    return length == chunk_size and offset >= 0


def indexable_reason(*, unfilled: bool, length: int, chunk_size: int, namespace: BlendNamespace,
                     offset_known: bool) -> Optional[str]:
    """Why a STORE entry feeds nothing to the blend index, or None when its content is
    claimed for its key's namespace. ``unfilled``: its ids were outside uint32; ``length``:
    ids it carries (0: none, then only the key's namespace can be a reason);
    ``offset_known``: the entry's ``token_offset``, or the binding's for the same content, is
    known."""
    if unfilled:
        return "tokens_outside_uint32"
    if length and length != chunk_size:
        return "wrong_length"
    if not namespace_indexable(namespace):
        return "world_size_0"
    if length and not offset_known:
        return "token_offset_unknown"
    return None
