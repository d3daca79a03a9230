"""What a resumed run may change, checked before it touches anything: every other setting must equal the
checkpoint's (the losses so far were computed with them), a changed `compile` is said, and the run's
data paths are made absolute so a resume from another working directory reads the same files."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from tformer.config import SEQ2SEQ_ONLY
from tformer.train.checkpoint import CheckpointError
from tformer.train.config import TrainConfig

__all__ = [
    "RESUMABLE",
    "absolute_data_paths",
    "check_resume_config",
    "warn_compile_switch",
    "warn_deterministic_switch",
    "warn_precision_switch",
    "warn_rank_count_change",
]


# what a resumed run may change: cadence, retention, guards, where and how it runs; never what the steps
# so far computed (model, data, optimizer, batch, seed), or the resumed losses would not continue the run
RESUMABLE = {"steps", "eval_every", "eval_batches", "save_every", "keep_last", "log_every", "max_nonfinite",
             "spike_factor", "sample_every", "sample_tokens", "device", "compile", "deterministic",
             "activation_checkpointing", "fused_loss", "parallel"}  # fmt: skip


def absolute_data_paths(cfg: TrainConfig, base: str | os.PathLike | None = None) -> TrainConfig:
    """cfg with a relative user-corpus path (`text:`, `pairs:`, `labels:`) and data.path made absolute
    against `base` (default: the working directory; the command line passes a config file's folder for the
    paths the file names): a resume, `tformer eval` or another rank started elsewhere finds the same
    files."""
    from tformer.data.corpora import user_corpus

    def absolute(path: str) -> str:
        return os.path.abspath(os.path.join(base or os.getcwd(), os.path.expanduser(path)))

    data, changes = cfg.data, {}
    user = user_corpus(data.corpus)
    if user is not None and user[1] and not os.path.isabs(os.path.expanduser(user[1])):
        changes["corpus"] = f"{user[0]}:{absolute(user[1])}"
    if data.path is not None and not os.path.isabs(os.path.expanduser(data.path)):
        changes["path"] = absolute(data.path)
    return cfg.replace(data=data.replace(**changes)) if changes else cfg


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _moved(key: str, before: Any, now: Any) -> bool:
    """Where the data lives may change (a moved run or corpus); what it is may not. A setting that
    ModelConfig.from_dict dropped from a saved config (its arch never read it) is no change either."""
    if key == "data.path" or (key.removeprefix("model.") in SEQ2SEQ_ONLY and now is None):
        return True
    if key != "data.corpus" or not isinstance(before, str) or not isinstance(now, str):
        return False
    from tformer.data.corpora import user_corpus

    was, is_ = user_corpus(before), user_corpus(now)  # the user's data moved: the same kind, elsewhere
    return was is not None and is_ is not None and was[0] == is_[0]


def _whole_sections(keys: list[str], before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """A section one side does not have (model.moe of a dense run: None, flattened as one key) is named
    once, not as each of its settings."""
    every = before.keys() | now.keys()
    absent = {k for k in every if before.get(k, 0) is None or now.get(k, 0) is None}
    absent = {a for a in absent if any(k.startswith(a + ".") for k in every)}
    named = [k for k in keys if not any(k.startswith(a + ".") for a in absent)]
    return sorted({*named, *(a for a in absent if any(k.startswith(a + ".") for k in keys))})


def _value(flat: dict[str, Any], key: str) -> str:
    """A flattened setting as the user wrote it; a section as the dict of its settings."""
    if key in flat:
        return repr(flat[key])
    section = {k.removeprefix(key + "."): v for k, v in flat.items() if k.startswith(key + ".")}
    return repr(section) if section else "None"


FIRST = {"task": 0, "model.arch": 1, "data.corpus": 2}  # named before the rest: a config from another
# kind of run (a copied config.json) differs in tens of settings, and these say why


def check_resume_config(cfg: TrainConfig, meta: dict[str, Any], path: Path, model: bool) -> None:
    """CheckpointError naming every setting outside RESUMABLE whose value differs from the checkpoint's:
    the `model.*` settings (model=True, once the task has resolved the model config) or all the others
    (model=False, checked before the task reads any data)."""
    saved = meta.get("train_config")
    if not isinstance(saved, dict):
        return  # a checkpoint without its config: the model and optimizer loads still check shapes
    try:  # through the config classes: a setting added since the run was saved takes its default
        before = _flatten(TrainConfig.from_dict(saved).to_dict())
    except (ValueError, TypeError):  # a config this version no longer reads (ConfigError too): as saved
        before = _flatten(saved)
    now = _flatten(cfg.to_dict())
    changed = [
        k for k in sorted(before.keys() | now.keys())
        if k.startswith("model.") == model and k.split(".")[0] not in RESUMABLE
        and before.get(k) != now.get(k) and not _moved(k, before.get(k), now.get(k))
    ]  # fmt: skip
    changed = sorted(_whole_sections(changed, before, now), key=lambda k: (k not in FIRST, FIRST.get(k), k))
    if changed:
        shown = "; ".join(
            f"{k}: {_value(before, k)} in the checkpoint, {_value(now, k)} now" for k in changed[:4]
        )
        more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
        raise CheckpointError(
            f"--resume from {path}: the config differs from the run's: {shown}{more} (from --set, --config, "
            "--preset or an edited config.json in the run directory). A resumed run keeps its model, data, "
            f"optimizer, batch and seed (it may change {', '.join(sorted(RESUMABLE))}); undo those changes or "
            "start a new run with another --out"
        )


def warn_deterministic_switch(cfg: TrainConfig, meta: dict[str, Any], device_type: str) -> None:
    """`deterministic` may change on resume; on a GPU the switch changes the kernels of some operations
    (scatter-adds among them), so the run goes on, not bit-identically. Said, not silent. On the CPU
    tformer's kernels are the same either way."""
    saved = meta.get("train_config")
    if not isinstance(saved, dict) or device_type != "cuda":
        return
    before = bool(saved.get("deterministic", False))  # a run saved before the setting: False
    if before != cfg.deterministic:
        warnings.warn(
            f"deterministic={cfg.deterministic} on resume of a run with deterministic={before}: on a GPU "
            "the two run some operations with other kernels, so the losses from here can differ in the last "
            "bits from a run that kept its setting",
            UserWarning,
            stacklevel=3,
        )


def warn_compile_switch(cfg: TrainConfig, meta: dict[str, Any]) -> None:
    """`compile` may change on resume, but with dropout on the compiled and the eager step draw different
    dropout masks from the same RNG state: the run goes on, not bit-identically. Said, not silent."""
    saved = meta.get("train_config")
    if not isinstance(saved, dict) or bool(saved.get("compile")) == cfg.compile:
        return
    model = cfg.model.to_dict()
    rates = {k: v for k, v in model.items() if "dropout" in k and isinstance(v, float) and v > 0}
    if rates:
        warnings.warn(
            f"compile={cfg.compile} on resume of a run with compile={bool(saved.get('compile'))} and "
            f"{', '.join(f'model.{k}={v:g}' for k, v in rates.items())}: "
            "compiled and eager steps draw different dropout masks, so the losses from here will not be "
            "bit-identical to a run that kept its compile setting",
            UserWarning,
            stacklevel=3,
        )


def warn_precision_switch(cfg: TrainConfig, meta: dict[str, Any]) -> None:
    """`parallel.param_dtype` (FSDP's compute precision) may change on resume, since a sharded run may be
    resumed in one process, where it must be float32; the steps from there compute in another precision,
    as a change of `dtype` would (which is refused). Said, not silent."""
    saved = meta.get("train_config")
    if not isinstance(saved, dict):
        return
    before = (saved.get("parallel") or {}).get("param_dtype", "float32")
    if before != cfg.parallel.param_dtype:
        warnings.warn(
            f"parallel.param_dtype is {cfg.parallel.param_dtype!r} on resume of a run trained with "
            f"{before!r}: the steps from here compute in another precision, so the losses will not be "
            "those of a run that kept it",
            UserWarning,
            stacklevel=3,
        )


def warn_rank_count_change(path: Path, data_world_size: int) -> None:
    """A checkpoint trained by another number of data-parallel ranks (a DCP checkpoint, or its export)
    resumed here: batch_size is per rank, so every step's batch changes with the count. Said, not silent."""
    from tformer.distributed.checkpoint import saved_data_world_size

    saved = saved_data_world_size(path)
    if saved not in (None, data_world_size):
        warnings.warn(
            f"{path.name} was trained by {saved} data-parallel rank(s), this run has {data_world_size}: "
            f"batch_size is per rank, so each step now trains on {data_world_size}/{saved} of the batch it "
            "did (the run goes on, not as it would have with its rank count)",
            UserWarning,
            stacklevel=4,
        )
