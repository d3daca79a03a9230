"""Checks the corpus tests share."""

from __future__ import annotations

from tformer.data import SPLITS


def ids(corpus, split: str) -> set:
    return {x.id for x in corpus[split]}


def assert_disjoint(corpus) -> None:
    """No unit in two splits, and no split empty."""
    train, val, test = (ids(corpus, s) for s in SPLITS)
    assert not (train & val) and not (train & test) and not (val & test)
    assert all(corpus[s] for s in SPLITS)
