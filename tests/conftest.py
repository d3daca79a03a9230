"""Shared fixtures: a tiny model config (d_model 64, 2 layers, vocab 128) and fixed seeds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch._dynamo

import tformer.model.linear as linear_module
from tformer import ModelConfig
from tformer.presets import tiny

# The command line tests run `tformer.cli.main.main` in this process, which would apply the allocator
# setting (tformer/allocator.py) to the whole test session; tests of the setting choose it themselves.
os.environ.setdefault("TFORMER_MALLOC", "default")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _decoding_layout():
    """Decoding takes the row-blocked layout in every test (module and session fixtures included), as it
    did before the layout was measured per machine (`row_blocking_pays`): no test depends on the
    machine's timings. Tests of the measurement and of the plain layout set DECODE_ROW_BLOCKED themselves
    (with monkeypatch, which puts True back)."""
    before, linear_module.DECODE_ROW_BLOCKED = linear_module.DECODE_ROW_BLOCKED, True
    yield
    linear_module.DECODE_ROW_BLOCKED = before


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return tiny()


@pytest.fixture
def count_calls(monkeypatch):
    """count_calls(module, name) -> a list that grows by one per call of module.name (still called)."""

    def spy(module, name: str) -> list[int]:
        calls: list[int] = []
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
        return calls

    return spy


@pytest.fixture
def trace_graph():
    """trace_graph(module) -> (compiled module, graphs): `torch.compile` (fullgraph) with a backend that
    records each captured graph's code and runs it as traced; dynamo is reset before and after the test."""
    torch._dynamo.reset()

    def trace(module):
        graphs: list[str] = []

        def backend(gm, example_inputs):
            graphs.append(gm.print_readable(print_output=False))
            return gm.forward

        return torch.compile(module, backend=backend, fullgraph=True), graphs

    yield trace
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A tiny LM run made by `tformer train` (tests/cli_run.py), one per test module; modules and folders
    with runs of other tasks define their own."""
    from tests.cli_run import train_cli_run

    return train_cli_run(tmp_path_factory.mktemp("cli"))
