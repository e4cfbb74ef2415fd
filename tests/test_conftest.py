"""tests/conftest.py's `@pytest.mark.thin(n)`: which cases the default run keeps, and the
collection error where a parameter value would be left out."""

from __future__ import annotations

import itertools
import types

import pytest
from conftest import thin_out


class _Item:
    """What thin_out reads of a pytest item: nodeid, the thin marker, callspec.params,
    keywords and add_marker."""

    def __init__(self, name, params, n):
        ids = "-".join(str(v) for v in params.values())
        self.nodeid, self.callspec = f"t.py::{name}[{ids}]", types.SimpleNamespace(params=params)
        self.keywords, self._thin = {}, pytest.mark.thin(n).mark

    def get_closest_marker(self, name):
        return self._thin if name == "thin" else None

    def add_marker(self, marker):
        self.keywords[marker.mark.name] = marker


def _family(name, n, **values):
    """One item per case of the product of `values` (the last parameter fastest)."""
    keys = list(values)
    return [
        _Item(name, dict(zip(keys, c, strict=True)), n) for c in itertools.product(*values.values())
    ]


def test_keeps_one_in_n_along_a_diagonal():
    items = _family("f", 2, fmt=["int4", "nvfp4", "fp8"], kind=["key", "value"])
    thin_out(items)
    kept = [tuple(i.callspec.params.values()) for i in items if "slow" not in i.keywords]
    # every 2nd case would take "key" only; the diagonal alternates
    assert kept == [("int4", "key"), ("nvfp4", "value"), ("fp8", "key")]


def test_a_value_left_out_is_a_collection_error():
    items = _family("g", 3, fmt=["int4", "nvfp4"], kind=["key", "value"])
    with pytest.raises(pytest.UsageError, match=r"fmt='nvfp4' of t\.py::g"):
        thin_out(items)


def test_families_are_thinned_apart_and_unmarked_items_untouched():
    items = _family("a", 2, x=[0, 1], y=[0, 1]) + _family("b", 2, x=[0, 1], y=[0, 1])
    plain = types.SimpleNamespace(get_closest_marker=lambda name: None)
    thin_out([*items, plain])
    assert [("slow" in i.keywords) for i in items] == [False, True, True, False] * 2
