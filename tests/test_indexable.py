"""The indexable rule has one source (``index/indexable.py``): the column-wise forms the
ingest path asks per STORE batch (``entries_indexable``) and per entry with ids
(``entry_indexable``) give exactly what ``indexable_reason`` gives entry by entry, on
generated batches (unfilled entries, entries without ids, wrong lengths, unknown offsets,
world size 0, mixed scopes)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from blendmatch.index.indexable import entries_indexable, entry_indexable, indexable_reason
from blendmatch.index.types import BlendNamespace
from blendmatch.index.wire_entries import EntryColumns, KeyScope, TokenColumn

C = 4
_SCOPES = [KeyScope("m", 0, 0, "", BlendNamespace("m", "", ws)) for ws in (1, 2, 0)]

_entry = st.tuples(st.sampled_from(["chunk", "short", "long", "unfilled", "none"]),
                   st.sampled_from([-1, 0, 2 * C]), st.sampled_from([0, 0, 0, 1, 2]))


def _batch(spec: list[tuple[str, int, int]]) -> tuple[EntryColumns, list[bool]]:
    """EntryColumns as the wire builds them: an unfilled entry has 0 usable ids."""
    lengths = [{"chunk": C, "short": C - 1, "long": C + 1, "unfilled": 0, "none": 0}[kind] for kind, _, _ in spec]
    unfilled = [i for i, (kind, _, _) in enumerate(spec) if kind == "unfilled"]
    flat = np.arange(sum(lengths), dtype=np.uint32)
    column = TokenColumn(flat, lengths, unfilled)
    scopes = [_SCOPES[s] for _, _, s in spec]
    entries = EntryColumns([b"h%d" % i for i in range(len(spec))], scopes, [1] * len(spec),
                           [off for _, off, _ in spec], column)
    return entries, [i in unfilled for i in range(len(spec))]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(_entry, min_size=1, max_size=6))
def test_column_wise_forms_agree_with_the_rule(spec):
    entries, unfilled = _batch(spec)
    lengths = entries.tokens.lengths
    reasons = [indexable_reason(unfilled=unfilled[i], length=lengths[i], chunk_size=C,
                                namespace=entries.scopes[i].namespace, offset_known=entries.offsets[i] >= 0)
               for i in range(len(entries))]
    # the whole-batch form: every entry carries one chunk and the rule says None for it
    assert entries_indexable(entries, C) == all(ln == C and r is None for ln, r in zip(lengths, reasons))
    for i, ln in enumerate(lengths):
        if ln:  # the per-entry form, for entries that carry ids
            assert entry_indexable(ln, C, entries.offsets[i], entries.scopes[i].namespace) == (reasons[i] is None)
