"""The GPU tests' device: CUDA, or what TFORMER_TEST_DEVICE names (`cpu` runs their logic on a machine
without a GPU, which proves the tests themselves, not the GPU path). Selected with `-m cuda`; a run that
asks for CUDA on a machine without it fails here rather than skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.words import write_word_corpus


@pytest.fixture(scope="session")
def device() -> torch.device:
    name = os.environ.get("TFORMER_TEST_DEVICE", "cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.fail("the cuda tests need a CUDA GPU (TFORMER_TEST_DEVICE=cpu runs their logic on the CPU)")
    return torch.device(name)


@pytest.fixture(autouse=True, scope="session")
def _exact_fp32() -> None:
    """fp32 products in fp32 (no TF32), as on the CPU the comparisons are made against."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_word_corpus(root)
    return root
