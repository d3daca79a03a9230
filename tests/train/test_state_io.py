"""The non-weight state of a checkpoint (tformer/train/state_io.py): nested Python values through JSON and
safetensors and back, and the RNG states."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tformer.train.checkpoint import load_checkpoint, save_checkpoint
from tformer.train.state_io import capture_rng_state, restore_rng_state


def round_trip(tmp_path: Path, trainer_state: dict) -> dict:
    model = nn.Linear(2, 2)
    path = save_checkpoint(tmp_path, 1, model, trainer_state=trainer_state)
    return load_checkpoint(path, nn.Linear(2, 2), restore_rng=False).trainer_state


def same(a, b) -> bool:
    """Equal values of the same types all the way down (a tuple is not a list, 1 is not "1")."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k1, k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_tuples_non_string_keys_and_marker_lookalikes_come_back_as_they_were(tmp_path: Path) -> None:
    state = {
        "betas": (0.9, 0.95),
        "nested": [(1, "a"), {"x": (None, True)}],
        "by_int": {1: "one", 2: (3, 4)},
        "by_tuple": {(1, 2): [1.5], "s": 0},
        "lookalike": {"__tuple__": [1, 2]},  # a user's dict that happens to use a marker's name
        "items": {"__items__": [[1, 2]]},
        "tensor_name": {"__tensor__": "x"},
    }
    assert same(round_trip(tmp_path, state), state)


def test_tensors_whose_paths_collide_are_all_kept(tmp_path: Path) -> None:
    """The key "a.1", and the keys 1 and "1" under "a", all name a tensor at trainer_state.a.1."""
    state = {"a.1": torch.tensor([1.0]), "a": {"1": torch.tensor([2.0]), 1: torch.tensor([3.0])}}
    assert same(round_trip(tmp_path, state), state)


def test_views_and_non_contiguous_tensors_are_stored(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"base": base, "row": base[1], "t": base.t(), "every_other": base[:, ::2], "empty": base[:0]}
    back = round_trip(tmp_path, state)
    assert same(back, {k: v.contiguous() for k, v in state.items()})


def test_numpy_values_are_stored(tmp_path: Path) -> None:
    state = {"arr": np.arange(6, dtype=np.int64).reshape(2, 3).T, "scalar": np.float32(0.5), "n": np.int64(7)}
    back = round_trip(tmp_path, state)
    assert same(back["arr"], np.ascontiguousarray(state["arr"]))
    assert back["scalar"] == 0.5 and type(back["n"]) is int and back["n"] == 7


def test_the_rng_state_round_trip_restores_every_generator() -> None:
    state = capture_rng_state(3)
    want = (torch.rand(2), random.random(), np.random.rand())
    random.random(), np.random.rand(), torch.rand(1)
    restore_rng_state(state)
    assert torch.equal(torch.rand(2), want[0]) and random.random() == want[1] and np.random.rand() == want[2]
    assert state["rank"] == 3


def test_cuda_states_for_other_devices_are_skipped_with_a_warning() -> None:
    state = capture_rng_state()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state["torch_cuda"] = [torch.zeros(8, dtype=torch.uint8)] * (count + 1)  # saved on more devices
    here = (
        f"this process sees {count} CUDA device"
        if torch.cuda.is_available()
        else "CUDA is not available here"
    )
    with pytest.warns(UserWarning, match=rf"holds {count + 1} CUDA RNG state\(s\) and {here}.*not restored"):
        restore_rng_state(state)
    state["torch_cuda"] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_rng_state(state)  # saved without CUDA: nothing to say
