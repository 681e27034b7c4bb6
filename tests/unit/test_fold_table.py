"""``fold`` is a table with one function per decision type: the table covers the whole ``Decision``
union and nothing else, so a new decision type cannot be logged without a fold of its own."""

from __future__ import annotations

from typing import get_args

from shared.fence.schema import Decision
from shared.fence.state import FOLDS


def test_every_decision_type_has_exactly_one_fold() -> None:
    assert set(FOLDS) == set(get_args(Decision))
    assert len(FOLDS) == len(get_args(Decision))


def test_each_fold_is_named_for_its_decision() -> None:
    """The functions are the per-type cases of one match, kept in one module: none is shared between
    two types (a copy-paste slip would fold one type with another's case)."""
    assert len(set(FOLDS.values())) == len(FOLDS)
    for t, fn in FOLDS.items():
        assert fn.__module__ == "shared.fence.state"
        assert fn.__name__.replace("_", "") == t.__name__.lower(), (t, fn.__name__)
