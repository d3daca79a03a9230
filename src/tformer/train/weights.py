"""Model weights in and out of tformer, outside the checkpoint directories: export one safetensors file,
import a safetensors file or a tensors-only torch `.pt` (pickled objects refused unless the caller
opts in with trust_pickle=True). Every import checks each key and shape before anything is copied
(`tformer.train.checkpoint.load_state_dict_checked`, shared with checkpoint loading). An exported file
records the sha256 of its tensor bytes in its header (`tformer.sha256`); import checks it when present
(checkpoint directories have their own manifest)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn

from tformer.schema import require_bool
from tformer.train.checkpoint import (
    CheckpointError,
    LoadResult,
    _fsync_dir,
    _weights_bytes,
    _weights_from_bytes,
    load_state_dict_checked,
)


def _check_module(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (e.g. from build_model), got {type(model).__name__}"
        )


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Export model.state_dict() as one safetensors file (tied weights once), written atomically."""
    _check_module(model)
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory: give a file name, e.g. {path / 'model.safetensors'}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: the folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            for chunk in _with_digest(_weights_bytes(model)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
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
    which `key` and `trust_pickle` are passed to; a safetensors file is read as one whatever its name).
    Weights that are not finite load with a warning naming them."""
    _check_module(model)
    require_bool(strict=strict, trust_pickle=trust_pickle)
    path = Path(path)
    if path.suffix in (".pt", ".pth", ".bin") and not _is_safetensors(path):
        tensors = import_torch_weights(path, key=key, trust_pickle=trust_pickle)
    else:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read weights ({e.strerror})") from None
        tensors = _weights_from_bytes(data, str(path))  # a truncated or malformed file is named as such first
        _check_digest(data, path)
    result = load_state_dict_checked(model, tensors, strict=strict, source=str(path))
    warn_nonfinite(tensors, path, stacklevel=2)
    return result


def warn_nonfinite(tensors: dict[str, torch.Tensor], source: str | Path, stacklevel: int = 2) -> None:
    """A warning naming the floating-point tensors that hold NaN or infinite values (weights loaded from
    `source`). Their outputs are NaN, or finite and meaningless: torch's fused attention of an unpadded
    batch leaves a NaN key out of its softmax instead of passing it on."""
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        warnings.warn(
            f"{source}: {len(bad)} tensor(s) hold NaN or infinite values ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); the model's outputs will be NaN or meaningless",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


def _is_safetensors(path: Path) -> bool:
    """Whether the file starts with a safetensors header (8-byte length, then a JSON object)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            raw = f.read(n) if 0 < n <= 100_000_000 else b""
    except OSError:
        return False  # import_torch_weights names the problem
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


DIGEST_KEY = "tformer.sha256"


def _header(data: bytes) -> tuple[dict, int] | None:
    """The safetensors header (JSON) and where the tensor bytes start; None if there is no readable
    header (the safetensors parser then says what is wrong)."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < n <= len(data) - 8:
        return None
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        return None
    return (header, 8 + n) if isinstance(header, dict) else None


def _with_digest(data: bytes) -> tuple[bytes, memoryview]:
    """The same safetensors file, as (new size and header, the tensor bytes), with the sha256 of its
    tensor bytes added to the header's metadata (the tensor bytes and their offsets, which count from the
    end of the header, are unchanged; they are not copied)."""
    header, start = _header(data)
    tensors = memoryview(data)[start:]
    header.setdefault("__metadata__", {})[DIGEST_KEY] = hashlib.sha256(tensors).hexdigest()
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8-byte alignment
    return len(raw).to_bytes(8, "little") + raw, tensors


def _check_digest(data: bytes, path: Path) -> None:
    parsed = _header(data)
    if parsed is None:
        return
    header, start = parsed
    metadata = header.get("__metadata__")
    want = metadata.get(DIGEST_KEY) if isinstance(metadata, dict) else None
    if want is not None and hashlib.sha256(memoryview(data)[start:]).hexdigest() != want:
        raise CheckpointError(
            f"{path}: the tensor bytes' sha256 differs from the one recorded when the file was exported "
            "(corrupted, or changed by a tool that kept the header's metadata); nothing was loaded"
        )


def _first_line(error: Exception) -> str:
    """An exception's first line, or its type where it has no message (torch.load of an empty file)."""
    lines = str(error).strip().splitlines()
    return lines[0].strip() if lines else f"{type(error).__name__}, no message"


def _check_torch_file(path: Path) -> None:
    """An empty file, a zip cut short, or a torch.save zip whose stored CRC-32 of a member no longer matches
    its bytes, is named before torch.load (which read a damaged tensor's bytes as weights, without a word).
    Members saved without a CRC (torch's `compute_crc32 = False` writes 0) are not checked. The check reads
    the file once more than torch.load does."""
    if not path.exists() or path.is_dir():
        return  # torch.load names it
    try:
        if path.stat().st_size == 0:
            raise CheckpointError(f"{path}: cannot be read as torch weights (the file is empty, 0 bytes)")
        with path.open("rb") as f:
            head = f.read(4)
        if not zipfile.is_zipfile(path):
            if head[:1] == b"\x80":  # a pickle's protocol opcode: the format before torch 1.6
                return
            what = (
                "a zip cut short: its directory at the end is missing (truncated?)"
                if head == b"PK\x03\x04"
                else "not a torch.save file: neither its zip format nor the older pickle one"
            )
            raise CheckpointError(f"{path}: cannot be read as torch weights ({what})")
        bad = _first_bad_member(path)
    except CheckpointError:
        raise
    except Exception as e:  # a damaged zip header: zipfile raises many kinds (NotImplementedError, ...)
        raise CheckpointError(f"{path}: cannot be read as torch weights ({_first_line(e)})") from None
    if bad is not None:
        raise CheckpointError(
            f"{path}: damaged, its member {bad!r} fails the CRC-32 check torch.save recorded "
            "(changed or corrupted since it was saved); nothing was loaded"
        )


def _first_bad_member(path: Path) -> str | None:
    """The first member of a zip whose bytes no longer match the CRC-32 it recorded (zipfile checks it at
    the end of each read), None if all match; members that recorded no CRC (0 for non-empty data) skipped."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.is_dir() or (info.CRC == 0 and info.file_size > 0):
                continue
            try:
                with archive.open(info) as member:
                    while member.read(1 << 24):
                        pass
            except zipfile.BadZipFile:
                return info.filename
    return None


def import_torch_weights(
    path: str | Path, *, key: str | None = None, trust_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """Read a torch.save'd dict of tensors with torch.load(weights_only=True); anything else is refused.

    `key` picks a nested dict (e.g. "model" in {"model": state_dict, "step": 3}). Pickled objects other
    than tensors and plain containers are rejected before they can run. trust_pickle=True (opt-in, for a
    legacy file you made yourself) unpickles everything, which runs whatever code the file names; the
    weights must still be a dict of tensors.
    """
    require_bool(trust_pickle=trust_pickle)  # a truthy "no" would unpickle everything
    path = Path(path)
    if trust_pickle:
        warnings.warn(
            f"{path}: unpickling with trust_pickle=True (runs code the file contains)", stacklevel=2
        )
    _check_torch_file(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as e:
        objects = [ln for ln in str(e).splitlines() if "Unsupported global" in ln]
        if not objects:  # not a pickle at all (zero bytes, text): no object was refused
            raise CheckpointError(f"{path}: cannot be read as torch weights ({_first_line(e)})") from None
        raise CheckpointError(
            f"{path}: refused, the file holds pickled objects, not only tensors ({objects[0].strip()}); for a "
            "legacy file from a source you trust, pass trust_pickle=True"
        ) from None
    except Exception as e:  # truncated zip, missing file, not a torch file: all one clean error
        raise CheckpointError(f"{path}: cannot be read as torch weights ({_first_line(e)})") from None
    if key is not None:
        if not isinstance(obj, dict) or key not in obj:
            raise CheckpointError(f"{path}: no entry {key!r} at the top level")
        obj = obj[key]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got a {type(obj).__name__}")
    for name, value in obj.items():
        if not isinstance(name, str):
            raise CheckpointError(
                f"{path}: entry {name!r} is named by {type(name).__name__}, not by a string"
            )
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is {type(value).__name__}, not a tensor")
    return obj
