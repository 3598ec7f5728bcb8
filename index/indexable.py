"""Which stored content the blend index may offer, and to whom: the one indexable rule.

Question answered: "does this applied STORE entry feed the blend index, and if not, why?"
:func:`indexable_reason` is the rule; the ingest path (``ingest.py``) counts its answers in
``entries_not_indexable`` and claims content for a namespace only where it says None
(:func:`content_indexable` and :func:`namespace_indexable` are its two halves, for the
claims made when a key joins content stored earlier). The ingest path asks it without a
call per entry where it can: :func:`entries_indexable` (a whole STORE batch, column-wise)
and :func:`entry_indexable` (one entry that carries ids) are the same rule, built from
the same halves. Reasons, in order of precedence:

- ``tokens_outside_uint32``: the entry's ids are not all token ids (its binding is left
  unfilled, ``wire.py``);
- ``wrong_length``: the content is not one chunk (the index holds chunks only);
- ``world_size_0``: the key's world size is 0; no lookup can ask for it
  (``world_size >= 1``), so its namespace is never claimed;
- ``token_offset_unknown``: ``token_offset`` -1 and no known offset for this content (a
  wrong ``old_st`` is never offered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from .types import BlendNamespace

if TYPE_CHECKING:
    from .wire import EntryColumns, KeyScope

__all__ = ["NOT_INDEXABLE_REASONS", "content_indexable", "entries_indexable", "entry_indexable", "indexable_reason",
           "namespace_indexable", "scopes_indexable"]

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


def entry_indexable(length: int, chunk_size: int, offset: int, namespace: BlendNamespace) -> bool:
    """:func:`indexable_reason` is None for an entry that carries ``length`` usable ids
    (not unfilled) at ``offset`` (-1 unknown) for ``namespace``."""
    return content_indexable(length, chunk_size, offset) and namespace_indexable(namespace)


def scopes_indexable(scopes: Sequence[KeyScope]) -> bool:
    """No scope of a batch has a namespace that may not be claimed (one scope per batch is
    the norm, compared by identity as scopes are interned)."""
    first = scopes[0]
    if scopes.count(first) == len(scopes):
        return namespace_indexable(first.namespace)
    return all(namespace_indexable(sc.namespace) for sc in set(scopes))


def entries_indexable(entries: EntryColumns, chunk_size: int) -> bool:
    """:func:`indexable_reason` is None for every entry of a (non-empty) STORE batch, asked
    column-wise, without a call per entry: each carries one chunk of content
    (``chunk_size`` usable ids, so none is unfilled: an unfilled entry has none) at a known
    offset, for a namespace that may be claimed. (An offset is never below -1: the wire
    refuses it.)"""
    return (min(entries.offsets) >= 0 and entries.tokens.rows_of_length(chunk_size)
            and scopes_indexable(entries.scopes))
