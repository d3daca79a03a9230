"""A small corpus of random words for the trainer tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.words import WORDS


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    gen = torch.Generator().manual_seed(0)
    for i in range(12):
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (400,), generator=gen)]
        (root / f"doc{i:02d}.txt").write_text(" ".join(words) + "\n")
    return root
