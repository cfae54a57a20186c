"""notices.plan_delta / apply_delta: a plan sent as what changed rebuilds to the same text."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from slurm_resilience.worker import notices

scalars = st.one_of(st.integers(-5, 10**6), st.text(max_size=6), st.booleans(), st.none())
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=8),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                      max_leaves=20)
docs = st.dictionaries(st.text(max_size=5), values, max_size=6)


@settings(max_examples=300, deadline=None)
@given(docs, docs)
def test_any_two_objects_round_trip(old, new):
    delta = notices.plan_delta(old, new)
    assert notices.apply_delta(old, delta) == new
    assert json.loads(json.dumps(delta)) == delta  # it travels as JSON
    assert notices.plan_delta(new, new) == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=40), st.integers(0, 40), st.integers(0, 5),
       st.lists(st.integers(0, 50), max_size=5))
def test_a_list_edit_is_one_splice_no_longer_than_what_changed(seq, at, cut, put):
    at = min(at, len(seq))
    new = seq[:at] + put + seq[at + cut:]
    op = notices.plan_delta({"l": seq}, {"l": new}).get("l")
    if new == seq:
        assert op is None
    else:
        a, b, items = op["s"]
        assert seq[:a] + items + seq[b:] == new and len(items) <= len(put)


def test_a_delta_that_does_not_fit_is_refused():
    with pytest.raises((KeyError, TypeError, ValueError)):
        notices.apply_delta({"l": [1, 2]}, {"l": {"s": [1, 5, []]}})
    with pytest.raises((KeyError, TypeError, ValueError)):
        notices.apply_delta({}, {"t": {"d": {"x": {"v": 1}}}})
    with pytest.raises(ValueError):
        notices.apply_delta({"a": 1}, {"a": {"?": 1}})
