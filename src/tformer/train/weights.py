"""Model weights in and out of tformer, outside the checkpoint directories: export one safetensors file,
import a safetensors file or a tensors-only torch `.pt` (pickled objects refused unless the caller
opts in with trust_pickle=True). Every import checks each key and shape before anything is copied
(`tformer.train.checkpoint.load_state_dict_checked`, shared with checkpoint loading)."""

from __future__ import annotations

import os
import pickle
import uuid
import warnings
from pathlib import Path

import torch
from torch import nn

from tformer.train.checkpoint import (
    CheckpointError,
    LoadResult,
    _fsync_dir,
    _weights_bytes,
    _weights_from_bytes,
    _write_file,
    load_state_dict_checked,
)


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Export model.state_dict() as one safetensors file (tied weights once), written atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _write_file(tmp.parent, tmp.name, _weights_bytes(model), {})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def load_weights(
    model: nn.Module,
    path: str | Path,
    *,
    strict: bool = True,
    key: str | None = None,
    trust_pickle: bool = False,
) -> LoadResult:
    """Import weights from a safetensors file (or a tensors-only .pt/.pth/.bin, see import_torch_weights,
    which `key` and `trust_pickle` are passed to)."""
    path = Path(path)
    if path.suffix in (".pt", ".pth", ".bin"):
        state = import_torch_weights(path, key=key, trust_pickle=trust_pickle)
        return load_state_dict_checked(model, state, strict=strict, source=str(path))
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read weights ({e.strerror})") from None
    return load_state_dict_checked(
        model, _weights_from_bytes(data, str(path)), strict=strict, source=str(path)
    )


def import_torch_weights(
    path: str | Path, *, key: str | None = None, trust_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """Read a torch.save'd dict of tensors with torch.load(weights_only=True); anything else is refused.

    `key` picks a nested dict (e.g. "model" in {"model": state_dict, "step": 3}). Pickled objects other
    than tensors and plain containers are rejected before they can run. trust_pickle=True (opt-in, for a
    legacy file you made yourself) unpickles everything, which runs whatever code the file names; the
    weights must still be a dict of tensors.
    """
    path = Path(path)
    if trust_pickle:
        warnings.warn(
            f"{path}: unpickling with trust_pickle=True (runs code the file contains)", stacklevel=2
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as e:
        lines = [ln for ln in str(e).splitlines() if "Unsupported global" in ln] or [str(e).splitlines()[0]]
        raise CheckpointError(
            f"{path}: refused, the file holds pickled objects, not only tensors ({lines[0].strip()}); for a "
            "legacy file from a source you trust, pass trust_pickle=True"
        ) from None
    except Exception as e:  # truncated zip, missing file, not a torch file: all one clean error
        raise CheckpointError(f"{path}: cannot be read as torch weights ({str(e).splitlines()[0]})") from None
    if key is not None:
        if not isinstance(obj, dict) or key not in obj:
            raise CheckpointError(f"{path}: no entry {key!r} at the top level")
        obj = obj[key]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got a {type(obj).__name__}")
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is {type(value).__name__}, not a tensor")
    return obj
