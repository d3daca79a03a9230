"""Opening a finished or running training run: its model, tokenizer and configs, from a checkpoint
(the single-process safetensors format, or the sharded DCP format that torchrun runs write)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.data.tokenizer import Tokenizer
from tformer.distributed.env import resolve_device
from tformer.model import build_model
from tformer.train.checkpoint import (
    DCP_FORMAT,
    CheckpointError,
    checkpoint_format,
    checkpoint_meta,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    step_of,
    unfinished_checkpoints,
    why_none_committed,
)
from tformer.train.config import TrainConfig


@dataclass
class LoadedRun:
    model: nn.Module
    tokenizer: Tokenizer
    train_config: TrainConfig
    checkpoint: Path
    step: int
    src_tokenizer: Tokenizer | None = None  # a translation run's separate source vocabulary


COMMAND_OF_TASK = {
    "lm": "tformer generate",
    "translation": "tformer translate",
    "classification": "tformer classify",
}


TASK_NOUN = {"lm": "language-model", "translation": "translation", "classification": "classification"}


def require_task(run: LoadedRun | str | Path, task: str, noun: str) -> LoadedRun:
    """`run` (a LoadedRun, or a run directory or checkpoint, loaded here); a ValueError unless it was
    trained for `task`, naming the command that serves the run."""
    if isinstance(run, (str, Path)):
        run = load_run(run)
    elif not isinstance(run, LoadedRun):
        raise TypeError(
            f"run must be a run from tformer.runs.load_run (or its path), got {type(run).__name__}"
        )
    have = run.train_config.task
    if have != task:
        how = COMMAND_OF_TASK.get(have)
        raise ValueError(
            f"{run.checkpoint} is a {TASK_NOUN.get(have, have)} run, not a {noun} run"
            + (f"; use {how}" if how else "")
        )
    return run


def first_few(numbers: Sequence[int], n: int = 5) -> str:
    """The first n numbers for a message: "3, 6, 9, 12, 15, ..." """
    return ", ".join(map(str, numbers[:n])) + (", ..." if len(numbers) > n else "")


def warn_truncated(cut: Sequence[int], limit: int) -> None:
    """The Python API's warning for texts cut to the model's input length (the CLI names lines)."""
    if cut:
        warnings.warn(
            f"{len(cut)} text(s) longer than {limit} tokens were truncated (index {first_few(cut)})",
            UserWarning,
            stacklevel=3,
        )


def check_texts(texts: Iterable[str]) -> list[str]:
    """What a translator or classifier takes: non-empty strings (one string is not a list of its
    characters); returned as a list (a generator is read once)."""
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings; wrap one text in a list: [text]")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {i} is a {type(text).__name__}, not a str")
        if not text.strip():
            raise ValueError(f"text {i} is empty")
    return texts


def find_checkpoint(path: str | Path) -> Path:
    """A run directory (its newest committed checkpoint) or one checkpoint directory."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"the run must be a path (a run directory or a checkpoint), got {type(path).__name__}"
        )
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (expected a run directory or a checkpoint directory)")
    if path.is_file():
        raise FileNotFoundError(f"{path} is a file; give the run directory (or one of its checkpoints)")
    if (path / "meta.json").exists() or (path / "model.safetensors").exists():
        return path
    if path.name == "checkpoints" and not (path / "checkpoints").exists():
        path = path.parent  # the run's checkpoints folder: its newest checkpoint
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path} holds no committed checkpoint ({why_none_committed(path)})")
    newer = unfinished_checkpoints(path, step_of(found))
    if newer:
        warnings.warn(
            f"{newer[-1]} is not a committed checkpoint (damaged, or a save that did not finish); "
            f"using the newest committed one, {found.name}",
            stacklevel=2,
        )
    return found


def load_run(path: str | Path, device: str | torch.device = "cpu") -> LoadedRun:
    """A run directory's newest checkpoint (or the checkpoint `path` names): model in eval mode on
    `device`, tokenizer(s), configs, step. The global RNG state is left as it was."""
    device = resolve_device(str(device))  # "auto", or a clear error for a device this machine lacks
    ckpt = find_checkpoint(path)
    try:
        return _load_checkpoint(ckpt, device)
    except CheckpointError as error:
        earlier = [c for c in list_checkpoints(ckpt.parent.parent) if c != ckpt] if ckpt != Path(path) else []
        if not earlier:
            raise
        raise CheckpointError(
            f"{error}; the run's previous checkpoint is {earlier[-1]} (give its path to use it)"
        ) from None


def _load_checkpoint(ckpt: Path, device: torch.device) -> LoadedRun:
    meta = checkpoint_meta(ckpt)  # size and sha256 checked before anything is parsed
    try:
        model_cfg = ModelConfig.from_dict(meta["model_config"])
        train_cfg = TrainConfig.from_dict(meta["train_config"])
        tokenizer = Tokenizer.from_json_str(meta["tokenizer"])
        src = meta.get("src_tokenizer")  # checkpoints of separate-vocabulary translation runs
        src_tokenizer = None if src is None else Tokenizer.from_json_str(src)
    except KeyError as err:
        raise CheckpointError(f"{ckpt / 'meta.json'}: run metadata without the key {err}") from None
    except Exception as err:  # noqa: BLE001 (the tokenizers library raises plain Exception)
        raise CheckpointError(f"{ckpt / 'meta.json'}: unreadable run metadata ({err})") from None
    with torch.random.fork_rng(devices=[]):  # the weights' random init is overwritten: the caller's
        model = build_model(model_cfg)  # RNG stream stays where it was (seed, load, then sample)
    if checkpoint_format(ckpt) == DCP_FORMAT:  # a torch.distributed.checkpoint directory (a torchrun run)
        from tformer.distributed.checkpoint import load_dcp_weights

        step = load_dcp_weights(ckpt, model, train_cfg)
    else:
        step = load_checkpoint(ckpt, model, restore_rng=False).step
    return LoadedRun(model.to(device).eval(), tokenizer, train_cfg, ckpt, step, src_tokenizer)


def truncated_note(n: int, what: str) -> str:
    """The note a score's text line gets when n of its inputs (`what`s) were cut to the run's max length."""
    return f" | {n} {what}{'s' if n != 1 else ''} longer than the run's max length, truncated" if n else ""
