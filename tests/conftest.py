"""Shared fixtures: a tiny model config (d_model 64, 2 layers, vocab 128) and fixed seeds."""

from __future__ import annotations

import pytest
import torch

from tformer import ModelConfig
from tformer.presets import tiny


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return tiny()
