"""Opening a finished or running training run: its model, tokenizer and configs, from a checkpoint
(the single-process safetensors format, or the sharded DCP format that torchrun runs write)."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import torch
from torch import nn

from tformer.config import ModelConfig
from tformer.data.corpus_base import is_blank
from tformer.data.tokenizer import Tokenizer
from tformer.distributed.env import resolve_device
from tformer.model import build_model
from tformer.train.checkpoint import (
    CHECKPOINTS_DIR,
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
from tformer.train.weights import warn_nonfinite


@dataclass
class LoadedRun:
    model: nn.Module
    tokenizer: Tokenizer
    train_config: TrainConfig
    checkpoint: Path
    step: int
    src_tokenizer: Tokenizer | None = None  # a translation run's separate source vocabulary
    averaged_steps: tuple[int, ...] = ()  # load_run(..., average=N): the steps whose weights were averaged
    ensemble: tuple[str, ...] = ()  # the checkpoints of the other runs whose models `model` ensembles with

    def weights_words(self) -> str:
        """Whose weights these are, for a result line: "step 2800", or "step 2800, the mean of the 5
        checkpoints of steps 2400-2800" (", in an ensemble with 2 more runs")."""
        return weights_words(self.step, self.averaged_steps, self.ensemble)

    def file_suffix(self) -> str:
        """What files written from averaged or ensembled weights add to their name ("_mean5",
        "_ens3-1f0c9a2b"), so they never replace those of the newest checkpoint alone. An ensemble's
        names end in a digest of its other members' checkpoints (in any order): another ensemble from
        the same first run writes files of its own."""
        mean = f"_mean{len(self.averaged_steps)}" if self.averaged_steps else ""
        return mean + (f"_ens{len(self.ensemble) + 1}-{path_digest(*self.ensemble)}" if self.ensemble else "")


def path_digest(*paths: str | Path, resolve: bool = True) -> str:
    """8 hex digits naming a set of files or folders by their resolved paths (in any order). resolve=False:
    by their absolute paths as given (/dev/stdin, a shell's /dev/fd/N: resolved, a new pipe each time)."""
    named = sorted(str(Path(p).resolve() if resolve else Path(p).absolute()) for p in paths)
    return hashlib.sha256("\n".join(named).encode("utf-8", "surrogateescape")).hexdigest()[:8]


def weights_words(step: int, averaged_steps: Sequence[int] = (), ensemble: Sequence[str] = ()) -> str:
    """`LoadedRun.weights_words` from a result's "checkpoint_step", "averaged_steps" and "ensemble"."""
    words = f"step {step}"
    if averaged_steps:
        words += f", the mean of the {len(averaged_steps)} checkpoints of steps {averaged_steps[0]}-{averaged_steps[-1]}"
    if ensemble:
        words += f", in an ensemble with {len(ensemble)} more run{'s' if len(ensemble) != 1 else ''}"
    return words


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


def token_limit(limit: int, special: str | None = None) -> str:
    """The input length a truncation warning names: "64 tokens", or, where the model's `limit` counts a
    special token the text is given (a classifier's BOS under cls pooling, a source's EOS), "63 tokens
    (the model reads 64, the BOS among them)": a text of 64 tokens is cut there too."""
    if special is None:
        return f"{limit} tokens"
    return f"{limit - 1} tokens (the model reads {limit}, the {special} among them)"


def warn_truncated(cut: Sequence[int], limit: int, special: str | None = None) -> None:
    """The Python API's warning for texts cut to the model's input length `limit`, which counts the
    `special` token each text is given, if any ("BOS", "EOS"); the CLI names lines."""
    if cut:
        warnings.warn(
            f"{len(cut)} text(s) longer than {token_limit(limit, special)} were truncated "
            f"(index {first_few(cut)})",
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
        if is_blank(text):
            raise ValueError(
                f"text {i} is empty{'' if not text.strip() else ' (nothing but invisible characters)'}"
            )
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


def load_run(path: str | Path, device: str | torch.device = "cpu", average: int = 1) -> LoadedRun:
    """A run directory's newest checkpoint (or the checkpoint `path` names): model in eval mode on
    `device`, tokenizer(s), configs, step. The global RNG state is left as it was.

    average: with N > 1, the model holds the mean of the weights of the run directory's newest N committed
    checkpoints (checkpoint averaging, as Vaswani et al. 2017 averaged their last 5 for translation); the
    configs, tokenizers, step and non-float buffers are the newest one's, `averaged_steps` names the steps.
    A run keeps `keep_last` checkpoints, saved every `save_every` steps."""
    if isinstance(average, bool) or not isinstance(average, int) or average < 1:
        raise ValueError(f"average must be a whole number >= 1 (checkpoints to average), got {average!r}")
    device = resolve_device(str(device))  # "auto", or a clear error for a device this machine lacks
    ckpt = find_checkpoint(path)
    if average > 1:
        return _averaged_run(Path(path), ckpt, average, device)
    try:
        return _load_checkpoint(ckpt, device)
    except CheckpointError as error:
        earlier = [c for c in list_checkpoints(ckpt.parent.parent) if c != ckpt] if ckpt != Path(path) else []
        if not earlier:
            raise
        raise CheckpointError(
            f"{error}; the run's previous checkpoint is {earlier[-1]} (give its path to use it)"
        ) from None


def _load_checkpoint(ckpt: Path, device: torch.device, stacklevel: int = 3) -> LoadedRun:
    """stacklevel: of the non-finite weights warning, from this function (3: the caller of `load_run`)."""
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
    check_vocabularies(ckpt, model_cfg, tokenizer, src_tokenizer)
    with torch.random.fork_rng(devices=[]):  # the weights' random init is overwritten: the caller's
        model = build_model(model_cfg)  # RNG stream stays where it was (seed, load, then sample)
    if checkpoint_format(ckpt) == DCP_FORMAT:  # a torch.distributed.checkpoint directory (a torchrun run)
        from tformer.distributed.checkpoint import load_dcp_weights

        step = load_dcp_weights(ckpt, model, train_cfg)
    else:
        step = load_checkpoint(ckpt, model, restore_rng=False).step
    warn_nonfinite({**dict(model.named_parameters()), **dict(model.named_buffers())}, ckpt, stacklevel)
    return LoadedRun(model.to(device).eval(), tokenizer, train_cfg, ckpt, step, src_tokenizer)


def check_vocabularies(
    ckpt: Path, model_cfg: ModelConfig, tokenizer: Tokenizer, src_tokenizer: Tokenizer | None
) -> None:
    """CheckpointError unless the checkpoint's tokenizers have the model's vocabularies: a run's task
    sizes its model by them (vocab_size, and src_vocab_size with a separate source tokenizer), so a
    tokenizer of another size was swapped in, and its ids would be read as other tokens or fail midway."""
    sides = [("tokenizer", tokenizer, "vocab_size", model_cfg.vocab_size)]
    if model_cfg.arch == "encoder_decoder":  # the source side: its own tokenizer, or the joint one
        source = tokenizer if src_tokenizer is None else src_tokenizer
        what = "tokenizer" if src_tokenizer is None else "source tokenizer"
        sides.append((what, source, "src_vocab_size", model_cfg.resolved_src_vocab_size))
    for what, tok, field, size in sides:
        if tok.vocab_size != size:
            raise CheckpointError(
                f"{ckpt / 'meta.json'}: the {what} has {tok.vocab_size:,} tokens but the model's "
                f"{field} is {size:,}: they must be equal (a tokenizer of another run?)"
            )


def _averaged_run(path: Path, newest: Path, n: int, device: torch.device) -> LoadedRun:
    """`load_run(path, device, average=n)`: the mean of the newest n committed checkpoints' weights, summed
    in float64. Every checkpoint is read and checked whole (as `load_run` reads one) before the mean."""
    if newest.resolve() == path.resolve() or newest.parent.name != CHECKPOINTS_DIR:
        raise ValueError(
            f"averaging checkpoints takes a run directory; {path} is one checkpoint"
            + (
                f" (its run directory: {newest.parent.parent})"
                if newest.parent.name == CHECKPOINTS_DIR
                else ""
            )
        )
    run_dir = newest.parent.parent
    found = [c for c in list_checkpoints(run_dir) if step_of(c) <= step_of(newest)]
    if len(found) < n:
        raise ValueError(
            f"{run_dir} holds {len(found)} committed checkpoint(s) ({', '.join(c.name for c in found)}); averaging "
            f"{n} needs {n}: a run keeps its newest keep_last checkpoints, saved every save_every steps "
            f"(e.g. tformer train --set save_every=100 --set keep_last={n})"
        )
    chosen = found[-n:]
    cpu = torch.device("cpu")
    run = _load_checkpoint(chosen[-1], cpu, stacklevel=4)
    state = run.model.state_dict()
    total = {k: v.double() for k, v in state.items() if v.is_floating_point()}
    steps = []
    for ckpt in chosen[:-1]:
        other = _load_checkpoint(ckpt, cpu, stacklevel=4)
        steps.append(other.step)
        for what, attr in (("model config", "train_config.model"), ("tokenizer", "tokenizer"),
                           ("source tokenizer", "src_tokenizer")):  # fmt: skip
            if attrgetter(attr)(other) != attrgetter(attr)(run):
                raise CheckpointError(
                    f"{ckpt} holds another {what} than {chosen[-1]}: only checkpoints of one model can be "
                    "averaged"
                )
        theirs = other.model.state_dict()
        for k in total:
            total[k] += theirs[k]
        del other, theirs
    with torch.no_grad():
        for k, mean in total.items():
            state[k].copy_(mean / n)
    run.model.to(device)
    run.averaged_steps = (*steps, run.step)  # the steps the checkpoints hold (a copied one may be renamed)
    return run


def truncated_note(n: int, what: str) -> str:
    """The note a score's text line gets when n of its inputs (`what`s) were cut to the run's max length."""
    return f" | {n} {what}{'s' if n != 1 else ''} longer than the run's max length, truncated" if n else ""
