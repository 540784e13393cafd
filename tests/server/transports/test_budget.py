"""The body budget's pure parts: the item count against JSON's own structure (hypothesis: any
value, strings full of commas, brackets, quotes and backslashes), and the per-route bounds named
from the model, long-context models included."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from embedserve.transports.budget import MAX_IDS, OVERHEAD_BYTES, route_budgets, json_items

TRICKY = st.text(alphabet=st.sampled_from(list(',[]{}"\\:é \U0001F600\n')) | st.characters(), max_size=30)
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
                      lambda inner: st.lists(inner, max_size=6) | st.dictionaries(TRICKY, inner, max_size=6),
                      max_leaves=60)


def members(value) -> int:
    """Array elements and object members, counted on the parsed value."""
    if isinstance(value, list):
        return len(value) + sum(map(members, value))
    if isinstance(value, dict):
        return len(value) + sum(map(members, value.values()))
    return 0


def items(value) -> int:
    """What the budget counts, on the parsed value: a container's opening bracket and the commas
    between its members (each member after the first needs one)."""
    if isinstance(value, (list, dict)):
        inner = list(value.values()) if isinstance(value, dict) else value
        return 1 + max(0, len(inner) - 1) + sum(map(items, inner))
    return 0


@settings(max_examples=400, deadline=None)
@given(VALUES, st.integers(min_value=0, max_value=40), st.booleans())
def test_items_are_counted_outside_strings(value, limit, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")  # JSON may carry one
    exact, counted = items(value), json_items(body, limit)
    assert counted >= min(exact, limit + 1)  # never fewer (a count past the limit may stop there)
    assert exact >= members(value) - 1  # so the parser makes at most 1 + 2 per item counted (with keys)
    if exact > limit:
        assert counted > limit  # never lets through what is over
    else:
        assert counted <= limit, (counted, exact)  # commas, brackets, quotes inside strings never refuse a body


def test_long_context_models_keep_the_same_bounds():
    """A model of 8,192 tokens: token ids at most MAX_IDS (4.2 M would be ~0.9 s of json.loads),
    text routes a few items a text, and no route past HTTP_MAX_BODY_BYTES."""
    cap = 32 * 2**20
    budgets = route_budgets(frozenset({"/embed"}), frozenset({"/decode"}), 512, 8192, cap,
                            frozenset({"/v1/embeddings"}))
    assert budgets["/embed"].items == 4 * 512 + 256 and budgets["/embed"].body_bytes == cap
    assert budgets["/decode"].items == MAX_IDS + 4 * 512 + 256
    assert budgets["/decode"].body_bytes == MAX_IDS * 12 + OVERHEAD_BYTES
    assert budgets["/v1/embeddings"].items == budgets["/decode"].items and budgets["/v1/embeddings"].body_bytes == cap
    short = route_budgets(frozenset({"/embed"}), frozenset({"/decode"}), 512, 256, cap)
    assert short["/decode"].items == 512 * 256 + 4 * 512 + 256
    assert short["/embed"].body_bytes == 513 * 256 * 16 * 2 + OVERHEAD_BYTES  # 4.3 MB: twice what is read of each text
