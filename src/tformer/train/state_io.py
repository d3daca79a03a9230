"""The part of a checkpoint that is not model weights: nested Python state (optimizer scalars, scheduler,
data loader, trainer counters, RNG states) stored as a JSON tree plus a dict of named tensors, with no
pickle, and the RNG states of a rank. The checkpoint files themselves: tformer.train.checkpoint.

JSON cannot hold tuples, non-string dict keys or tensors; small marker objects stand in for them:
{"__tuple__": [...]}, {"__items__": [[key, value], ...]}, {"__tensor__": name}, {"__ndarray__": name}.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


class CheckpointError(ValueError):
    """A checkpoint or weights file cannot be written or loaded; the message names the file and key."""


# ---------------------------------------------------------------- JSON + tensors, no pickle
_MARKERS = ("__tensor__", "__ndarray__", "__tuple__", "__items__")


class Packer:
    """Splits a nested Python object into a JSON-able tree and a dict of named CPU tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def add(self, path: str, t: torch.Tensor) -> str:
        key, n = path, 1
        while key in self.tensors:
            key, n = f"{path}#{n}", n + 1
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in self._storages:  # safetensors refuses tensors that share memory
            t = t.clone()
        self._storages.add(t.untyped_storage().data_ptr())
        self.tensors[key] = t
        return key

    def pack(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self.add(path, obj)}
        if isinstance(obj, np.ndarray):
            return {"__ndarray__": self.add(path, torch.from_numpy(np.ascontiguousarray(obj)))}
        if isinstance(obj, np.generic):
            return obj.item()
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, tuple):
            return {"__tuple__": [self.pack(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.pack(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _MARKERS):
                return {k: self.pack(v, f"{path}.{k}") for k, v in obj.items()}
            items = [
                [self.pack(k, f"{path}.k{i}"), self.pack(v, f"{path}.{k}")]
                for i, (k, v) in enumerate(obj.items())
            ]
            return {"__items__": items}
        raise CheckpointError(
            f"cannot store {type(obj).__name__} value at {path!r}: allowed are tensors, arrays, numbers, "
            "strings, None, lists, tuples and dicts"
        )


def unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [unpack(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == "__tensor__":
            return tensors[value]
        if tag == "__ndarray__":
            return tensors[value].numpy().copy()
        if tag == "__tuple__":
            return tuple(unpack(v, tensors) for v in value)
        if tag == "__items__":
            return {unpack(k, tensors): unpack(v, tensors) for k, v in value}
    return {k: unpack(v, tensors) for k, v in obj.items()}


# ---------------------------------------------------------------- files


# ---------------------------------------------------------------- RNG
def rng_key(rank: int) -> str:
    """The key one rank's RNG state is stored under: per-rank keys never collide when ranks merge."""
    return f"rank{rank}"


def capture_rng_state(rank: int = 0) -> dict[str, Any]:
    """torch CPU, CUDA (all devices, if any), python `random` and numpy global RNG states of this rank."""
    return {
        "rank": rank,
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state. CUDA states are skipped, with a warning, if the devices differ."""
    torch.set_rng_state(state["torch_cpu"])
    cuda = state["torch_cuda"]
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    elif cuda:
        here = (
            f"this process sees {torch.cuda.device_count()} CUDA device(s)"
            if torch.cuda.is_available()
            else "CUDA is not available here"
        )
        warnings.warn(
            f"the checkpoint holds {len(cuda)} CUDA RNG state(s) and {here}: they are not restored (a GPU run "
            "resumed elsewhere draws other GPU random numbers)",
            stacklevel=2,
        )
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
