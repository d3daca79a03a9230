"""The packages' names imported on first use (tformer/_lazy.py) behave as the eager imports did."""

from __future__ import annotations

import pytest

import tformer
import tformer.data
import tformer.data.tokenizer
import tformer.train
from tformer import _lazy


def test_names_and_submodules_resolve() -> None:
    assert tformer.build_model is tformer.model.build_model  # a submodule as an attribute, as before
    assert tformer.data.PackedLMDataset is tformer.data.datasets.PackedLMDataset
    assert tformer.train.CheckpointError is tformer.train.checkpoint.CheckpointError
    assert {"build_model", "ModelConfig"} <= set(dir(tformer))
    with pytest.raises(AttributeError, match="module 'tformer' has no attribute 'nope'"):
        tformer.nope  # noqa: B018


def test_a_patched_name_is_not_kept_after_it_is_put_back(monkeypatch) -> None:
    original = tformer.data.tokenizer.Tokenizer
    monkeypatch.setattr(tformer.data.tokenizer, "Tokenizer", "patched")
    assert tformer.data.Tokenizer == "patched"
    monkeypatch.undo()
    assert tformer.data.Tokenizer is original


@pytest.mark.parametrize("package", [tformer, tformer.data, tformer.train])
def test_every_public_name_resolves(package) -> None:
    """__all__, the TYPE_CHECKING imports (the lazy names) and what resolves at run time agree."""
    assert all(getattr(package, name) is not None for name in package.__all__)
    lazy = set(_lazy.type_checking_imports(package.__file__))
    assert lazy and lazy <= set(package.__all__)
