"""Checkpoints: atomic, pickle-free save / load / retention for any nn.Module, optimizer and scheduler.

One checkpoint is a directory `run_dir/checkpoints/step_000123/` holding
  model.safetensors       model.state_dict() (parameters and persistent buffers); tensors sharing one
                          storage (tied weights) are stored once, the other names in the header metadata
  optimizer.safetensors   optimizer state tensors under path names ("state.0.exp_avg")
  optimizer.json          the rest of optimizer.state_dict() (param groups, scalars)
  trainer.json            step, tokens_seen, scheduler state, data loader state, the caller's trainer_state
  rng.json                python / numpy RNG state per rank, under "rank{r}" keys
  meta.json               format_version and the caller's resolved configs (model config, tokenizer, ...)
  *.safetensors           beside each *.json, the tensors found in it (RNG states, generator states)
  COMMITTED               written last: format version, step, size and sha256 of every file.
Everything is written into a hidden temporary sibling, fsynced, then renamed to `step_*`, so a
`step_*` directory without COMMITTED never comes from this writer and is never treated as valid.
Loading reads and checks every file and every key / shape before anything is copied: a failed load
changes nothing. Nothing is ever pickled or unpickled; JSON encodes tuples, non-string dict keys and
tensor references with small marker objects ({"__tuple__": [...]}, {"__items__": [...]}, ...; see
tformer.train.state_io, which also captures and restores the RNG states).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import safetensors
import safetensors.torch
import torch
from torch import nn

from tformer.schema import require_bool
from tformer.train.state_io import (
    CheckpointError,
    Packer,
    capture_rng_state,
    restore_rng_state,
    rng_key,
    unpack,
)

FORMAT_VERSION = 1
MARKER = "COMMITTED"
DCP_FORMAT = "dcp"  # the "format" a COMMITTED manifest of a torch.distributed.checkpoint directory names
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last by a DCP save
CHECKPOINTS_DIR = "checkpoints"
STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIXES = (".tmp-", ".trash-")
_ALIASES_KEY = "tformer.aliases"


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_checkpoint` hands back besides the restored objects."""

    path: Path
    step: int
    tokens_seen: int
    data_state: Any
    trainer_state: dict[str, Any]
    meta: dict[str, Any]
    rng_state: dict[str, Any] | None
    missing_keys: list[str]
    unexpected_keys: list[str]


def _write_file(directory: Path, name: str, data: bytes, manifest: dict[str, Any]) -> None:
    """Write, fsync, and record size + sha256 in the manifest."""
    with open(directory / name, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest entry, {"bytes", "sha256"}, of a file read in 16 MB chunks (DCP shards can be large)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _json_bytes(obj: Any, what: str, indent: int | None = 2) -> bytes:
    try:
        return json.dumps(obj, indent=indent).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-serialisable: {e}") from None


def _write_pair(directory: Path, stem: str, obj: Any, manifest: dict[str, Any], indent: int | None) -> None:
    """stem.json (structure) and, when it holds tensors, stem.safetensors."""
    packer = Packer()
    tree = {k: packer.pack(v, k) for k, v in obj.items()}
    if packer.tensors:
        _write_file(directory, f"{stem}.safetensors", safetensors.torch.save(packer.tensors), manifest)
    _write_file(directory, f"{stem}.json", _json_bytes(tree, f"{stem} state", indent), manifest)


def _parse_safetensors(data: bytes, source: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        tensors = safetensors.torch.load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except (safetensors.SafetensorError, ValueError) as e:
        raise CheckpointError(f"{source}: not a valid safetensors file ({e})") from None
    return tensors, metadata


# ---------------------------------------------------------------- model weights
def _alias_groups(state: dict[str, Any], source: str) -> list[list[str]]:
    """Names of the state dict grouped by identical storage, offset, shape and stride (tied weights)."""
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{source}: state dict entry {name!r} is a {type(t).__name__}")
        where = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        groups.setdefault(where if t.numel() else name, []).append(name)  # empty tensors share ptr 0
    return list(groups.values())


def _weights_bytes(model: nn.Module) -> bytes:
    state = model.state_dict()
    packer, aliases = Packer(), {}
    for group in _alias_groups(state, "model"):
        packer.add(group[0], state[group[0]])  # names are unique, so the key is the name
        aliases.update({name: group[0] for name in group[1:]})
    return safetensors.torch.save(
        packer.tensors, metadata={"format": "pt", _ALIASES_KEY: json.dumps(aliases)}
    )


def _weights_from_bytes(data: bytes, source: str) -> dict[str, torch.Tensor]:
    tensors, metadata = _parse_safetensors(data, source)
    try:
        aliases = json.loads(metadata.get(_ALIASES_KEY, "{}"))
        tensors.update({name: tensors[target] for name, target in aliases.items()})
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{source}: bad {_ALIASES_KEY} metadata ({e!r})") from None
    return tensors


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN equal to NaN (a tied weight holding NaN is still one weight)."""
    if a is b or torch.equal(a, b):
        return True
    return a.is_floating_point() and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _plan_model_load(model: nn.Module, tensors: dict[str, torch.Tensor], strict: bool, source: str):
    """Check every key, shape and kind of value (floating or integer); return (state to load, missing,
    unexpected). Touches nothing."""
    state = model.state_dict()
    on_meta = next((name for name, t in state.items() if isinstance(t, torch.Tensor) and t.is_meta), None)
    if on_meta is not None:  # no data to load into (and every meta tensor looks tied to every other)
        raise CheckpointError(
            f"{source}: the model is on the meta device ({on_meta!r} holds no data): give it storage first, "
            "e.g. model.to_empty(device='cpu'), then load"
        )
    resolved: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for group in _alias_groups(state, source):
        found = [n for n in group if n in tensors]
        if not found:
            missing.extend(group)
            continue
        for name in found:
            want, got = tuple(state[name].shape), tuple(tensors[name].shape)
            if want != got:
                raise CheckpointError(
                    f"{source}: key {name!r} has shape {got} in the checkpoint but {want} in the model"
                )
            if tensors[name].is_floating_point() != state[name].is_floating_point():
                raise CheckpointError(
                    f"{source}: key {name!r} holds {tensors[name].dtype} values in the checkpoint but "
                    f"{state[name].dtype} in the model"
                )
        for name in found[1:]:
            if not _same_values(tensors[name], tensors[found[0]]):
                raise CheckpointError(
                    f"{source}: the model ties {found[0]!r} and {name!r} but the checkpoint holds different values"
                )
        resolved.update({name: tensors[found[0]] for name in group})
    unexpected = sorted(set(tensors) - set(state))
    if strict and (missing or unexpected):
        first = f"model key {missing[0]!r} missing" if missing else f"unexpected key {unexpected[0]!r}"
        raise CheckpointError(f"{source}: {first} ({len(missing)} missing, {len(unexpected)} unexpected)")
    return resolved, missing, unexpected


def load_state_dict_checked(
    model: nn.Module, tensors: dict[str, torch.Tensor], *, strict: bool = True, source: str = "weights"
) -> LoadResult:
    """Copy `tensors` into `model` after checking every key, shape and kind (all or nothing; ties kept)."""
    resolved, missing, unexpected = _plan_model_load(model, tensors, strict, source)
    model.load_state_dict(resolved, strict=False)
    return LoadResult(missing, unexpected)


# ---------------------------------------------------------------- directory layout
def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(checkpoint: Path) -> int:
    """The step a `step_*` checkpoint directory holds (its name's number)."""
    return int(STEP_DIR.match(Path(checkpoint).name).group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Committed checkpoint directories of a run, oldest step first (partial ones left out)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if _is_complete(p)]


def _is_complete(path: Path) -> bool:
    """A readable commit manifest, and for a distributed (DCP) checkpoint its .metadata index: what
    `_Reader` requires before it reads anything."""
    try:
        _Reader(path, verify=False)
    except CheckpointError:
        return False
    return True


def checkpoint_format(path: str | Path) -> str:
    """ "dcp" (torch.distributed.checkpoint, written under torchrun) or "safetensors" (one process), from
    the directory's COMMITTED manifest; CheckpointError if it is missing, unreadable or incomplete."""
    return _Reader(Path(path), verify=False).format


def checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """What the trainer stored in a checkpoint's meta.json (resolved configs, task, tokenizer), checked
    against the COMMITTED manifest (size and sha256) before it is parsed."""
    meta = _Reader(Path(path), verify=True).json("meta.json")
    return meta.get("meta", {}) if isinstance(meta, dict) else {}


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The committed checkpoint with the highest step, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def unfinished_checkpoints(run_dir: str | Path, after_step: int) -> list[Path]:
    """`step_*` directories beyond `after_step` without a readable commit, in step order."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and int(m.group(1)) > after_step and not _is_complete(p)
    )  # fmt: skip


def why_none_committed(run_dir: str | Path) -> str:
    """Why a run directory holds no committed checkpoint, for an error message: the newest `step_*`
    directory without a readable commit, where one exists, else where it looked."""
    damaged = sorted(unfinished_checkpoints(run_dir, -1), key=step_of)
    if damaged:
        return f"{damaged[-1]} has no readable commit manifest (damaged, or a save that did not finish)"
    return f"looked in {Path(run_dir) / CHECKPOINTS_DIR}"


def save_failed(e: OSError | CheckpointError, run_dir: str | Path, step: int) -> OSError | CheckpointError:
    """The error of a checkpoint save at `step` that failed (a full disk, a file-size limit, DCP's writers),
    naming the step and the checkpoint a --resume takes: a failed save never leaves a directory that looks
    whole. (An async save that failed surfaces at the next save: its own message names its step.) A
    CheckpointError carries the errno of the OSError under it, where there was one."""
    last = latest_checkpoint(run_dir)
    room = getattr(e, "errno", None) in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    if last is not None and step_of(last) == step:  # committed; what failed came after (retention, fsync)
        kept = f"{last.name} itself was committed and is whole"
    elif last is not None:
        kept = f"the last checkpoint, {last.name}, is whole: {'make room, then ' if room else ''}--resume"
    else:
        kept = "no checkpoint of this run was saved before"
    if isinstance(e, OSError):
        reason = f"{e.strerror} ({e.filename})" if e.strerror and e.filename else e.strerror or str(e)
        where = Path(run_dir) / CHECKPOINTS_DIR
        return OSError(e.errno, f"the checkpoint save at step {step} failed: {reason}; {kept}", str(where))
    return CheckpointError(f"the checkpoint save at step {step} failed: {e}; {kept}")


def refuse_unfinished(run_dir: str | Path, resume_from: Path | None) -> None:
    """CheckpointError if a `step_*` directory without a readable commit (a damaged checkpoint: saves
    commit by renaming a finished directory) lies beyond the step a run starts from, where a later save
    would meet it. It is never deleted or stepped over silently; the message says what to move."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    found = unfinished_checkpoints(run_dir, -1 if resume_from is None else step_of(resume_from))
    if found:
        where = f"resume from {resume_from.name}" if resume_from is not None else "start afresh"
        raise CheckpointError(
            f"{found[-1]} is not a committed checkpoint (no readable {MARKER}, or a distributed one without "
            f"its {DCP_METADATA}); move {', '.join(p.name for p in found)} out of {root} to {where}"
        )


def _remove_dir(path: Path) -> None:
    """Rename out of the `step_*` namespace first, so a half-deleted directory is never listed."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _clean_up(root: Path, keep_last: int | None, just_saved: Path) -> None:
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_TMP_PREFIXES):  # left behind by a crashed save / delete
            shutil.rmtree(p, ignore_errors=True)
    if keep_last is not None:
        for old in list_checkpoints(root.parent)[:-keep_last]:
            if old != just_saved:
                _remove_dir(old)


# ---------------------------------------------------------------- save
def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    tokens_seen: int = 0,
    data_state: Any = None,
    trainer_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    rng_state: dict[str, Any] | list[dict[str, Any]] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write `run_dir/checkpoints/step_{step:06d}/` atomically and return its path.

    scheduler: anything with state_dict() / load_state_dict() (an LR scheduler).
    data_state / trainer_state: nested dicts, lists, tuples, numbers, strings, None, tensors, arrays
        (e.g. a DataLoader generator state); any other key the trainer needs goes in trainer_state.
    meta: plain JSON (resolved model config dict, tokenizer JSON string, ...), stored in meta.json.
    rng_state: capture_rng_state(rank), or a list of them, one per rank (default: this process as rank 0).
    keep_last: after the save, delete the oldest committed checkpoints beyond this many (>= 1).
    Raises CheckpointError if the step directory exists already: checkpoints are never overwritten.
    One process writes a run's checkpoints: temporary directories of other writers would be cleaned up.
    """
    for name, value in (("step", step), ("tokens_seen", tokens_seen)):  # what load_checkpoint takes back
        if type(value) is not int or value < 0:
            raise CheckpointError(f"{name} must be a whole number >= 0, got {value!r}")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / step_dir_name(step)
    if final.exists():
        raise CheckpointError(f"{final}: checkpoint exists already; refusing to overwrite it")
    rng_states = [rng_state] if isinstance(rng_state, dict) else rng_state or [capture_rng_state(0)]
    ranks = [s["rank"] for s in rng_states]
    if len(set(ranks)) != len(ranks):
        raise CheckpointError(f"rng_state holds ranks {ranks}; each rank must appear once")
    meta_bytes = _json_bytes({"format_version": FORMAT_VERSION, "meta": meta or {}}, "meta")

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files: dict[str, Any] = {}
        _write_file(tmp, "model.safetensors", _weights_bytes(model), files)
        if optimizer is not None:
            _write_pair(tmp, "optimizer", optimizer.state_dict(), files, indent=None)
        trainer = {
            "step": step,
            "tokens_seen": tokens_seen,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "data_state": data_state,
            "trainer_state": trainer_state or {},
        }
        _write_pair(tmp, "trainer", trainer, files, indent=2)
        _write_pair(tmp, "rng", {rng_key(s["rank"]): s for s in rng_states}, files, indent=None)
        _write_file(tmp, "meta.json", meta_bytes, files)
        commit = {"format_version": FORMAT_VERSION, "step": step, "files": files}
        _write_file(tmp, MARKER, _json_bytes(commit, MARKER), {})
        _fsync_dir(tmp)
        if final.exists():  # appeared while we were writing
            raise CheckpointError(f"{final}: checkpoint exists already; refusing to overwrite it")
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _clean_up(root, keep_last, final)
    return final


# ---------------------------------------------------------------- load
class _Reader:
    """Reads the files of one committed checkpoint, checking them against the COMMITTED manifest."""

    def __init__(self, path: Path, verify: bool) -> None:
        if not path.is_dir():
            raise CheckpointError(f"{path}: checkpoint directory not found")
        if not (path / MARKER).is_file():
            raise CheckpointError(f"{path}: no {MARKER} marker, the save did not finish")
        self.path, self.verify = path, verify
        commit = self._json_of(MARKER, self._read(MARKER, None))
        if not isinstance(commit, dict) or not isinstance(commit.get("files"), dict):
            raise CheckpointError(f"{path / MARKER}: not a tformer commit manifest")
        version = commit.get("format_version", 0)
        damaged = [
            name
            for name, entry in commit["files"].items()
            if not (
                isinstance(entry, dict)
                and type(entry.get("bytes")) is int
                and isinstance(entry.get("sha256"), str)
                and len(entry["sha256"]) == 64
            )
        ]
        if type(version) is not int or damaged:
            what = f"its entry for {damaged[0]!r}" if damaged else "its format_version"
            raise CheckpointError(f"{path / MARKER}: {what} is damaged (not what a tformer save writes)")
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{path}: format_version {version} > {FORMAT_VERSION}")
        self.files: dict[str, Any] = commit["files"]
        self.step = commit.get("step")
        if type(self.step) is not int or self.step < 0:
            raise CheckpointError(f"{path / MARKER}: its step is damaged (not what a tformer save writes)")
        self.format = commit.get("format", "safetensors")
        if self.format == DCP_FORMAT and not (path / DCP_METADATA).is_file():
            raise CheckpointError(
                f"{path}: distributed (DCP) checkpoint without its {DCP_METADATA} index: the save did not "
                "finish or the directory was damaged; resume from an earlier checkpoint"
            )

    def has(self, name: str) -> bool:
        return name in self.files

    def _read(self, name: str, entry: dict[str, Any] | None) -> bytes:
        file = self.path / name
        try:
            data = file.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
        if entry is not None and len(data) != entry["bytes"]:
            raise CheckpointError(
                f"{file}: {len(data)} bytes, manifest says {entry['bytes']} {_size_cause(len(data), entry['bytes'])}"
            )
        if entry is not None and self.verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{file}: sha256 differs from the manifest (corrupted)")
        return data

    def check(self, name: str, digest: bool = True) -> None:
        """Size and (with verify, unless digest=False) sha256 of a listed file against the manifest, without
        keeping it."""
        file, entry = self.path / name, self.files[name]
        digest = digest and self.verify
        try:
            found = file_entry(file) if digest else {"bytes": file.stat().st_size}
        except OSError as e:
            raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None
        if found["bytes"] != entry["bytes"]:
            raise CheckpointError(
                f"{file}: {found['bytes']} bytes, manifest says {entry['bytes']} "
                f"{_size_cause(found['bytes'], entry['bytes'])}"
            )
        if digest and found["sha256"] != entry["sha256"]:
            raise CheckpointError(f"{file}: sha256 differs from the manifest (corrupted)")

    def read(self, name: str) -> bytes:
        if name not in self.files:
            raise CheckpointError(f"{self.path / name}: not part of this checkpoint")
        return self._read(name, self.files[name])

    def _json_of(self, name: str, data: bytes) -> Any:
        try:
            return json.loads(data)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise CheckpointError(f"{self.path / name}: invalid JSON ({e})") from None

    def json(self, name: str) -> Any:
        return self._json_of(name, self.read(name))

    def pair(self, stem: str) -> dict[str, Any]:
        """Inverse of _write_pair."""
        tree = self.json(f"{stem}.json")
        tensors: dict[str, torch.Tensor] = {}
        if self.has(f"{stem}.safetensors"):
            source = str(self.path / f"{stem}.safetensors")
            tensors, _ = _parse_safetensors(self.read(f"{stem}.safetensors"), source)
        try:
            tree = unpack(tree, tensors)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{self.path / stem}.json: bad structure or tensor reference ({e!r})"
            ) from None
        if stem == "trainer":
            self._check_counters(tree)
        return tree

    def _check_counters(self, trainer: Any) -> None:
        """trainer.json's step is the one the commit manifest names and its counters are counts: a run
        resumed from anything else would start at another step (and rewrite its metrics from there)."""
        where = self.path / "trainer.json"
        if not isinstance(trainer, dict):
            raise CheckpointError(f"{where}: not a mapping")
        for key in ("step", *(("tokens_seen",) if "tokens_seen" in trainer else ())):  # (DCP's has no count)
            if type(trainer.get(key)) is not int or trainer[key] < 0:
                raise CheckpointError(f"{where}: {key} must be a whole number >= 0, got {trainer.get(key)!r}")
        if trainer["step"] != self.step:
            raise CheckpointError(
                f"{where}: step {trainer['step']}, but its {MARKER} manifest says {self.step}"
            )
        state = trainer.get("trainer_state")  # the Trainer's own copy, which a resume starts from
        if isinstance(state, dict):
            for key in ("step", "tokens_seen"):
                if key in state and (
                    type(state[key]) is not int or state[key] != trainer.get(key, state[key])
                ):
                    raise CheckpointError(
                        f"{where}: trainer_state.{key} is {state[key]!r}, the checkpoint's {key} {trainer.get(key)!r}"
                    )


PARAM_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")  # Adam(W), SGD


def _check_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any], source: str) -> None:
    saved, current = state.get("param_groups", []), optimizer.param_groups
    if len(saved) != len(current):
        raise CheckpointError(f"{source}: {len(saved)} param groups saved, {len(current)} in the optimizer")
    for i, (s, c) in enumerate(zip(saved, current)):
        if len(s["params"]) != len(c["params"]):
            raise CheckpointError(
                f"{source}: param group {i} has {len(s['params'])} parameters in the checkpoint, "
                f"{len(c['params'])} in the optimizer"
            )
    # a moment or momentum of another shape than its parameter would reach the (fused) update kernels,
    # which write out of bounds: a native crash, not an error. Those of Adam(W) and SGD must match their
    # parameter's shape; other optimizers' state (Adafactor's factored rows, LBFGS's history) is their own,
    # and load_state_dict casts floating state to the parameter's dtype
    params = [param for group in current for param in group["params"]]
    per_param = state.get("state", {})
    if not isinstance(per_param, dict):
        raise CheckpointError(f"{source}: 'state' is a {type(per_param).__name__}, not a mapping")
    for index, entry in per_param.items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
            raise CheckpointError(
                f"{source}: state for parameter {index!r}; the optimizer's parameters are 0-{len(params) - 1}"
            )
        if not isinstance(entry, dict):
            raise CheckpointError(f"{source}: state {index} is a {type(entry).__name__}, not a mapping")
        param = params[index]
        for key, value in entry.items():
            if key in PARAM_SHAPED_STATE and isinstance(value, torch.Tensor) and value.shape != param.shape:
                raise CheckpointError(
                    f"{source}: state.{index}.{key} is {tuple(value.shape)}, its parameter {tuple(param.shape)}"
                )


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    strict: bool = True,
    *,
    restore_rng: bool = True,
    rank: int = 0,
    verify: bool = True,
) -> LoadedCheckpoint:
    """Restore model, optimizer, scheduler and (rank's) RNG from one checkpoint directory.

    Every file is read and checked (manifest size and, with verify, sha256; JSON; safetensors headers;
    model keys and shapes; optimizer group sizes and the shapes of Adam / SGD moments; trainer counters)
    before anything is copied, so a CheckpointError leaves model, optimizer, scheduler and RNG untouched.
    strict=False tolerates missing / unexpected model keys (listed in the result), never a shape mismatch. The result carries what save_checkpoint
    was given (step, tokens_seen, data_state, trainer_state, meta) and this rank's RNG state.
    """
    require_bool(strict=strict, restore_rng=restore_rng, verify=verify)
    path = Path(path)
    reader = _Reader(path, verify)
    meta = reader.json("meta.json")
    trainer = reader.pair("trainer")
    weights = _weights_from_bytes(reader.read("model.safetensors"), str(path / "model.safetensors"))
    resolved, missing, unexpected = _plan_model_load(model, weights, strict, str(path / "model.safetensors"))
    opt_state = None
    if optimizer is not None:
        if not reader.has("optimizer.json"):
            raise CheckpointError(f"{path}: holds no optimizer state")
        opt_state = reader.pair("optimizer")
        _check_optimizer(optimizer, opt_state, str(path / "optimizer.json"))
    if scheduler is not None and trainer["scheduler"] is None:
        raise CheckpointError(f"{path / 'trainer.json'}: holds no scheduler state")
    rng = reader.pair("rng").get(rng_key(rank))
    if restore_rng and rng is None:
        raise CheckpointError(f"{path / 'rng.json'}: no RNG state under {rng_key(rank)!r}")

    # everything read and checked: apply
    model.load_state_dict(resolved, strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(opt_state)
    if scheduler is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    if restore_rng:
        restore_rng_state(rng)
    return LoadedCheckpoint(
        path=path,
        step=trainer["step"],
        tokens_seen=trainer["tokens_seen"],
        data_state=trainer["data_state"],
        trainer_state=trainer["trainer_state"],
        meta=meta.get("meta", {}),
        missing_keys=missing,
        unexpected_keys=unexpected,
        rng_state=rng,
    )


def _size_cause(found: int, recorded: int) -> str:
    """What a file's size against its manifest suggests: cut short, or written to since it was saved."""
    return "(truncated?)" if found < recorded else "(written to since it was saved?)"
