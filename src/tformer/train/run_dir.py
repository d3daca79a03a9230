"""A run directory as a whole: the files a run writes into it, the lock one process holds on it, and
what a fresh run may replace there (tformer.train.loop uses these; checkpoints: tformer.train.checkpoint)."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tformer.train.checkpoint import CHECKPOINTS_DIR, MARKER, STEP_DIR, CheckpointError
from tformer.train.metrics import TENSORBOARD_DIR

RUN_TOKENIZERS = ("tokenizer.json", "src_tokenizer.json")  # what the tasks train into a run directory
# what a fresh run writes into its directory, replacing what is there
RUN_FILES = (
    "config.json",
    *RUN_TOKENIZERS,
    "data.json",
    "metrics.jsonl",
    "loss.png",
    TENSORBOARD_DIR,
    "report.json",
)


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """An OSError raised while writing `path` names it: a failed write() (a full disk, a file-size limit)
    carries no file name of its own, and "No space left on device" alone does not say what was lost."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise


def outermost_missing(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (what a mkdir(parents=True) makes)."""
    return next((d for d in [*reversed(path.parents), path] if not d.exists()), None)


_LOCKS: dict[Path, tuple[Any, weakref.ref]] = {}  # run directories this process holds, and their holder


@atexit.register
def _close_locks() -> None:
    """The lock files held to the end, closed at exit (the kernel would release them; closing says the
    handles were meant to live that long instead of leaving ResourceWarnings)."""
    for handle, _ in _LOCKS.values():
        if handle is not None:
            handle.close()


def take_over(run_dir: Path) -> None:
    """Before a new holder reads the run directory's checkpoints: the holder in this process that still
    exists hands it over now (`holder._hand_over()`: finish its saves in flight, write nothing more there),
    so a save it had in flight is committed before the new one chooses where to resume."""
    entry = _LOCKS.get(Path(run_dir).resolve())
    previous = entry[1]() if entry is not None else None
    if previous is not None:
        previous._hand_over()


def lock_run_dir(run_dir: Path, holder: Any, exclusive: bool = True):
    """An exclusive lock on the run directory for as long as the returned file stays open: a second
    launch into the same --out (which would truncate the first's metrics and retrain its tokenizer) is
    an error naming the process that holds it. The kernel releases it when the process ends.
    exclusive=False (ranks other than 0, whose rank 0 holds the file lock): only the holder is recorded.

    Within one process the newest holder wins, so a run can be resumed (or a notebook cell rerun) in the
    process that stopped it: a holder that still exists is handed the directory over (`take_over`)."""
    key = run_dir.resolve()
    if key in _LOCKS:
        take_over(run_dir)
        handle = _LOCKS[key][0]
        _LOCKS[key] = (handle, weakref.ref(holder))
        return handle
    if not exclusive:
        _LOCKS[key] = (None, weakref.ref(holder))
        return None
    handle = open(run_dir / ".lock", "a+")  # noqa: SIM115 (held for the run's lifetime)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        error = in_use(run_dir, handle)
        handle.close()
        raise error from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    _LOCKS[key] = (handle, weakref.ref(holder))
    return handle


def is_run_dir(folder: Path) -> bool:
    """`folder` holds a tformer run's config.json."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and {"task", "model", "data", "optim"} <= config.keys()


def in_use(run_dir: Path, lock) -> BlockingIOError:
    """The error for a run directory whose lock file `lock` (open) another process holds: it names the
    process (the pid the holder wrote into the file)."""
    lock.seek(0)
    taken_by = lock.read().strip() or "another process"
    return BlockingIOError(
        f"the run directory {run_dir} is in use by {taken_by}; wait for it or choose another --out"
    )


def refuse_run_dir_in_use(run_dir: Path) -> None:
    """BlockingIOError where another process holds the run directory's lock (`lock_run_dir`), checked
    before anything else about the directory: its checkpoints would otherwise be named first (and
    `--resume`, which they ask for, then refused as in use). The lock is tried and let go at once; a
    directory this process holds is handed over instead (`take_over`)."""
    path = Path(run_dir) / ".lock"
    if run_dir.resolve() in _LOCKS or not path.is_file():
        return
    try:
        handle = open(path, "a+")  # noqa: SIM115 (closed below) (as lock_run_dir: NFS locks want a writer)
    except OSError:
        return  # not writable: lock_run_dir names what is wrong with it
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held (any other error: lock_run_dir decides)
            raise in_use(run_dir, handle) from None
        except OSError:
            return
        fcntl.flock(handle, fcntl.LOCK_UN)


def refuse_foreign_files(run_dir: Path) -> None:
    """A fresh run replaces RUN_FILES in its directory. That is what rerunning a run that stopped before
    its first checkpoint needs (its config.json is a run's config), but files of the same names that no
    run wrote (a config or tokenizer of the user's own) are never replaced: an error names them."""
    taken = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not taken:
        return
    if not is_run_dir(run_dir):
        raise FileExistsError(
            f"{run_dir} holds {', '.join(taken)}, which a new run would replace, and is not a tformer run "
            "(no run's config.json); choose another --out or move them"
        )


def remove_run_files(run_dir: Path) -> None:
    """A fresh run that stopped before training, in a directory that was there before it (a user's): the
    files it wrote there go (RUN_FILES; refuse_foreign_files let it replace only a run's own)."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)


def refuse_run_dir_in_data(run_dir: Path, data_paths: list[str]) -> None:
    """ValueError where a fresh run's directory is a user's data folder or lies inside one (`text:DIR`,
    `labels:DIR`): every later load of the data (a resume, `tformer eval`) would scan the run's
    checkpoints and logs as data, and a `labels:` corpus would take the run's folder for a label."""
    out = Path(run_dir).expanduser().resolve()
    for given in data_paths:
        data = Path(given).expanduser().resolve()
        if data.is_dir() and (out == data or data in out.parents):
            raise ValueError(
                f"the run directory {run_dir} lies inside the data folder {given}: its checkpoints and logs "
                "would be read as data by a resume or an evaluation; choose an --out outside it"
            )


def refuse_run_dir_in_checkpoints(run_dir: Path) -> None:
    """ValueError where a run's directory is, or lies inside, a checkpoint (a folder with a COMMITTED
    manifest), or is named as a checkpoint a run would write (`step_N` in a `checkpoints/` folder): its
    files would mix with the checkpoint's (`load_run` on either would read the other's weights), and the
    run that owns the checkpoint would delete them with it when keep_last prunes it (or write its own
    checkpoint of that step there). Nor a run's checkpoints/ folder itself (`--run` of that folder, which
    means its run, would find the new run instead) or its tensorboard/ folder or a folder in it (TensorBoard
    reads the folders in it too, and would show the new run's curves as the run's). A folder inside a run's
    checkpoints/ that is not named as a step is an ordinary directory."""
    out = Path(run_dir).expanduser().resolve()
    for folder in (out, *out.parents):
        if (folder / MARKER).is_file():
            where = "is the checkpoint" if folder == out else "lies inside the checkpoint"
            raise ValueError(
                f"the run directory {run_dir} {where} {folder}: its files would mix with the checkpoint's, "
                "and the run that saved it deletes it when keep_last prunes it; choose an --out outside it"
            )
    if out.parent.name == CHECKPOINTS_DIR and STEP_DIR.match(out.name):
        raise ValueError(
            f"the run directory {run_dir} is named as a checkpoint of the run in {out.parent.parent} "
            "(checkpoints/step_N), which would save that step there; choose another --out"
        )
    for folder in (out, *out.parents):
        if not (folder.name == TENSORBOARD_DIR or (folder == out and folder.name == CHECKPOINTS_DIR)):
            continue
        # a run that has started there (its lock or log), not only a config.json of a run's shape: a project
        # keeping its own config.json beside checkpoints/ or tensorboard/ folders of its own
        started = (folder.parent / ".lock").is_file() or (folder.parent / "metrics.jsonl").is_file()
        if started and is_run_dir(folder.parent):
            where = "is" if folder == out else "lies inside"
            mixed = "its checkpoints" if folder.name == CHECKPOINTS_DIR else "its TensorBoard logs"
            raise ValueError(
                f"the run directory {run_dir} {where} the {folder.name}/ folder of the run in {folder.parent}: "
                f"the new run's files would mix with {mixed}; choose an --out outside it"
            )


def release_run_dir(run_dir: Path, holder: Any) -> None:
    """`holder` gives the run directory up (the lock, if it is still the one holding it)."""
    key = run_dir.resolve()
    entry = _LOCKS.get(key)
    if entry is not None and entry[1]() is holder:
        del _LOCKS[key]
        if entry[0] is not None:
            entry[0].close()  # releases the run directory


def restore_run_tokenizer(run_dir: Path, meta: dict, checkpoint: Path) -> None:
    """A resumed run trains with the vocabularies its checkpoint was trained with (the checkpoint's
    meta.json holds them: "tokenizer", and a translation run's separate "src_tokenizer"). A file missing
    from the run directory is written back from there, with a warning (a task would train a new one on the
    data as it is now); one that differs from it is an error."""
    for key, name in zip(("tokenizer", "src_tokenizer"), RUN_TOKENIZERS):
        _restore_one(run_dir / name, meta.get(key), checkpoint)


def read_data_manifest(run_dir: Path) -> dict | None:
    """The run's data.json as a dict; None where it is missing or damaged (the check that reads it names
    a damaged one)."""
    from tformer.tasks.corpus import MANIFEST

    try:
        value = json.loads((run_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def restore_run_data_manifest(run_dir: Path, meta: dict, checkpoint: Path) -> None:
    """A resumed run checks its data against what it recorded when it started (data.json). A data.json
    missing from the run directory is written back from the checkpoint's meta.json ("data_manifest"),
    with a warning: without it the run would record the data as it is now and go on with changed data
    without a word. Checkpoints saved before 2026-12-03 hold none: the run then records it anew."""
    from tformer.tasks.corpus import MANIFEST

    saved, path = meta.get("data_manifest"), run_dir / MANIFEST
    if isinstance(saved, dict) and not path.exists():
        path.write_text(json.dumps(saved, indent=2), encoding="utf-8")
        warnings.warn(f"{path} was missing: restored from {checkpoint / 'meta.json'}", stacklevel=4)


def _restore_one(path: Path, saved: object, checkpoint: Path) -> None:
    if not isinstance(saved, str):
        return  # a checkpoint without this tokenizer: the task reads the run's own
    if not path.exists():
        path.write_text(saved, encoding="utf-8")
        warnings.warn(f"{path} was missing: restored from {checkpoint / 'meta.json'}", stacklevel=4)
        return
    from tformer.data.tokenizer import Tokenizer

    try:  # each as the installed tokenizers library reads it (its JSON layout changes between versions)
        same = Tokenizer.load(path).to_json_str() == Tokenizer.from_json_str(saved).to_json_str()
    except (OSError, ValueError):
        same = False
    if not same:
        raise CheckpointError(
            f"{path} is not the vocabulary {checkpoint.name} was trained with (its meta.json holds that one): "
            "the resumed run would read other token ids; restore the file (or delete it to have it restored) "
            "or start a new run"
        )
