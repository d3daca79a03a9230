"""A small corpus of random words for the trainer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.words import write_word_corpus


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_word_corpus(root)
    return root
