"""A study's directory: what it writes there (its setting.json, data manifest, tokenizers, arms, report
and plots), making it for a new study or continuing one of the same setting, and putting a study that
`--overwrite` replaced aside until the new one is under way."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from tformer.experiments.runner import MODES, SETTING, Setting
from tformer.json_files import read_json
from tformer.tasks.corpus import MANIFEST

STUDY_FILES = (SETTING, MANIFEST, "tokenizer.json", "src_tokenizer.json", "report.md", "report.html")
PREVIOUS = ".previous-study"  # where --overwrite keeps the study it replaces until the new one is under way


def _study_files(run_dir: Path) -> list[Path]:
    """Everything a study writes in its directory: arms, setting, data manifest, tokenizers, report, plots."""
    names = [run_dir / "arms", *(run_dir / n for n in STUDY_FILES)]
    plots = [p for study in ("norm", "rope", "moe") for p in sorted(run_dir.glob(f"{study}_*.png"))]
    return [p for p in names if p.exists()] + plots


def restore_previous_study(run_dir: Path) -> bool:
    """Undo `prepare_run_dir(overwrite=True)`: the new study's files removed, the replaced study's put
    back (a new study that failed before its first arm finished). False if there was none to restore."""
    kept = run_dir / PREVIOUS
    if not kept.is_dir():
        return False
    for path in _study_files(run_dir):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in kept.iterdir():
        path.rename(run_dir / path.name)
    kept.rmdir()
    return True


def drop_previous_study(run_dir: Path) -> None:
    """The replaced study is gone for good (the new one has a finished arm, or its report)."""
    shutil.rmtree(Path(run_dir) / PREVIOUS, ignore_errors=True)


def prepare_run_dir(run_dir: Path, overwrite: bool) -> Path:
    """Create the run directory. A previous study there is an error unless `overwrite`, which moves
    everything a study writes (arms, setting, data manifest, tokenizer, report and plots) aside into
    .previous-study/, so nothing of it (a tokenizer of another vocabulary or corpus) leaks into the new
    one, and a new study that fails before its first arm finishes (data, batch size) gives it back
    (`restore_previous_study`). A training run's directory, or stray tokenizer files, are refused: a study
    would read their tokenizer as its own."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} is a file; choose a directory")
    if (run_dir / SETTING).exists() or (run_dir / "arms").exists():
        if not overwrite:
            if (run_dir / "report.md").exists():
                raise ValueError(
                    f"{run_dir} already holds an experiment run; pass --overwrite or choose another --out"
                )
            raise ValueError(
                f"{run_dir} already holds an experiment run that did not finish (it has no report); continue "
                "it with --resume, or pass --overwrite or choose another --out"
            )
        drop_previous_study(run_dir)  # an older replaced study, whose replacement got under way
        (run_dir / PREVIOUS).mkdir()
        for path in _study_files(run_dir):
            path.rename(run_dir / PREVIOUS / path.name)
    else:
        foreign = [n for n in ("config.json", "checkpoints", "tokenizer.json") if (run_dir / n).exists()]
        if foreign:
            raise ValueError(
                f"{run_dir} holds {', '.join(foreign)} of something else (a training run?); a study needs "
                "a directory of its own: choose another --out"
            )
        clash = _study_files(run_dir) if run_dir.is_dir() else []
        if clash:  # not a study's (no setting, no arms): a user's own files under the names a study writes
            raise ValueError(
                f"{run_dir} holds {', '.join(p.name for p in clash)}, which a study would replace: choose "
                "another --out"
            )
        if run_dir.is_dir() and any(run_dir.iterdir()):
            warnings.warn(
                f"{run_dir} already holds other files; the study writes its own beside them (arms/, "
                "report.md, report.html, plots)",
                UserWarning,
                stacklevel=2,
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def write_setting(run_dir: Path, study: str, mode: str, setting: Setting, threads: int | None = None) -> None:
    """setting.json, with the torch version and the CPU threads the arms train with (default: torch's
    count now), which a --resume compares with its own: either changes the order of float sums."""
    payload = {
        "study": study,
        "mode": mode,
        "setting": setting.to_dict(),
        "torch": torch.__version__,
        "threads": threads or torch.get_num_threads(),
    }
    (run_dir / SETTING).write_text(json.dumps(payload, indent=2))


def read_setting(run_dir: Path) -> dict[str, Any]:
    """setting.json: {"study": name, "mode": "quick" | "full", "setting": {...}}, its shape checked (the
    setting's fields are checked by `Setting.from_dict`)."""
    from tformer.experiments import STUDIES

    path = Path(run_dir) / SETTING
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: not an experiment run directory")
    meta = read_json(path)
    for key, ok, want in (
        ("study", lambda v: v in STUDIES, f"one of {', '.join(sorted(STUDIES))}"),
        ("mode", lambda v: v in MODES, "'quick' or 'full'"),
        ("setting", lambda v: isinstance(v, dict), "a JSON object"),
    ):
        if key not in meta or not ok(meta[key]):
            got = f"{json.dumps(meta[key])}" if key in meta else "nothing"
            raise ValueError(f"{path} is not a study's setting.json: '{key}' must be {want}, got {got}")
    return meta


def setting_of(run_dir: Path, cls: type[Setting]) -> Setting:
    """The Setting a study directory's setting.json records."""
    return cls.from_dict(read_setting(run_dir)["setting"], str(Path(run_dir) / SETTING))


def resolved_device(setting: Setting) -> Setting:
    """device="auto" as the device it picks here ("cpu" or "cuda"): setting.json and the report say where
    the arms trained (a report had read "fp32 on auto")."""
    if setting.device != "auto":
        return setting
    from tformer.distributed.env import resolve_device

    return setting.replace(device=resolve_device("auto").type)


def begin_study(run_dir: str | Path, study: str, setting: Setting, quick: Setting) -> Path:
    """A study's `run` starts here: the directory made, and its setting.json written, or, where one is
    there (the command line wrote it, or an earlier attempt did), the same study and setting required: the
    arms it kept were trained under that setting, and a study mixing arms of two settings would compare
    them as equals."""
    run_dir = Path(run_dir)
    # as setting.json will hold it (lists as tuples; a float where an int belongs is named now, not later)
    setting = type(setting).from_dict(json.loads(json.dumps(setting.to_dict())), "the setting given")
    setting = resolved_device(setting)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"{run_dir} is a file; a study needs a directory")
    if (run_dir / SETTING).exists():
        saved = read_setting(run_dir)
        if saved["study"] != study:
            raise ValueError(f"{run_dir} holds a {saved['study']} study, not {study}")
        # (a study saved with device "auto" before it was recorded as the device it picked: that device)
        before = resolved_device(type(setting).from_dict(saved["setting"], str(run_dir / SETTING)))
        if before != setting:
            changed = [f"{k} {v!r} -> {getattr(setting, k)!r}" for k, v in before.to_dict().items()
                       if v != setting.to_dict()[k] and not (isinstance(v, list) and tuple(v) == getattr(setting, k))]  # fmt: skip
            raise ValueError(
                f"{run_dir} holds a {study} study of another setting ({'; '.join(changed)}): its arms were "
                "trained under its own; continue it with its setting (tformer experiment --resume), or use "
                "another directory"
            )
        return run_dir
    prepare_run_dir(run_dir, overwrite=False)  # another run's files (a tokenizer.json) are refused
    write_setting(run_dir, study, "quick" if setting == quick else "full", setting)
    return run_dir
