"""The run directory's helpers on their own: what mkdir would make, the lock's holder, foreign files,
writes that name their file, tokenizers restored from a checkpoint's meta."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tformer.tasks.corpus import train_tokenizer
from tformer.train.checkpoint import CheckpointError
from tformer.train.run_dir import (
    lock_run_dir,
    outermost_missing,
    refuse_foreign_files,
    release_run_dir,
    restore_run_tokenizer,
    writing,
)


class Holder:
    def __init__(self):
        self.handed_over = 0

    def _hand_over(self):
        self.handed_over += 1


def test_outermost_missing_is_the_first_folder_mkdir_makes(tmp_path: Path):
    assert outermost_missing(tmp_path / "a" / "b" / "c") == tmp_path / "a"
    (tmp_path / "a").mkdir()
    assert outermost_missing(tmp_path / "a" / "b" / "c") == tmp_path / "a" / "b"
    assert outermost_missing(tmp_path / "a") is None


def test_a_config_json_that_is_not_a_runs_is_never_replaced(tmp_path: Path):
    """A config.json naming only a task (the user's own file) is not a run's: a fresh run refuses it."""
    (tmp_path / "config.json").write_text(json.dumps({"task": "lm", "notes": "mine"}))
    with pytest.raises(FileExistsError, match="is not a tformer run"):
        refuse_foreign_files(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"task": "lm", "model": {}, "data": {}, "optim": {}}))
    refuse_foreign_files(tmp_path)  # a run's config: the run may be rerun


def lock_is_free(run_dir: Path) -> bool:
    with open(run_dir / ".lock", "a+") as other:  # another open file: as another process sees the lock
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(other, fcntl.LOCK_UN)
        return True


def test_the_lock_names_its_process_and_only_its_holder_releases_it(tmp_path: Path):
    first, stranger = Holder(), Holder()
    (tmp_path / ".lock").write_text("pid 999999999 of a run long gone")
    lock_run_dir(tmp_path, first)
    try:
        assert (tmp_path / ".lock").read_text() == f"pid {os.getpid()}"
        assert not lock_is_free(tmp_path)
        release_run_dir(tmp_path, stranger)  # not the holder: nothing released
        assert not lock_is_free(tmp_path)
        second = Holder()
        lock_run_dir(tmp_path, second)  # a newer holder in this process: the older hands over
        assert first.handed_over == 1 and not lock_is_free(tmp_path)
        release_run_dir(tmp_path, second)
        assert lock_is_free(tmp_path)
    finally:
        release_run_dir(tmp_path, first)


def test_a_failed_write_names_its_file(tmp_path: Path):
    with pytest.raises(OSError) as err, writing(tmp_path / "metrics.jsonl"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert err.value.filename == str(tmp_path / "metrics.jsonl") and err.value.errno == errno.ENOSPC


def tokenizer_json(words: str) -> str:
    """A small BPE vocabulary of its own on `words` (short texts run out of merges: said, not needed here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return train_tokenizer([words * 20], 300).to_json_str()


def test_missing_tokenizers_are_restored_each_to_its_own_file(tmp_path: Path):
    target, source = tokenizer_json("the cat sat on the mat "), tokenizer_json("der Hund lief nach Hause ")
    with pytest.warns(UserWarning, match="was missing: restored"):
        restore_run_tokenizer(tmp_path, {"tokenizer": target, "src_tokenizer": source}, tmp_path / "step_2")
    assert (tmp_path / "tokenizer.json").read_text(encoding="utf-8") == target
    assert (tmp_path / "src_tokenizer.json").read_text(encoding="utf-8") == source
    restore_run_tokenizer(tmp_path, {"tokenizer": target, "src_tokenizer": source}, tmp_path / "step_2")
    with pytest.raises(CheckpointError, match="is not the vocabulary step_2 was trained with"):
        restore_run_tokenizer(tmp_path, {"tokenizer": source}, tmp_path / "step_2")


def test_an_unreadable_tokenizer_file_is_not_the_checkpoints(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="is not the vocabulary"):
        restore_run_tokenizer(tmp_path, {"tokenizer": tokenizer_json("a b c d ")}, tmp_path / "step_2")


def test_a_lock_held_to_the_end_of_the_process_is_closed_quietly(tmp_path: Path):
    """A run directory locked until the process exits (a finished Trainer never released) leaves no
    ResourceWarning about its lock file at exit."""
    code = (
        "import sys; from pathlib import Path; from tformer.train.run_dir import lock_run_dir\n"
        "class Holder: pass\n"
        "keep = Holder(); lock_run_dir(Path(sys.argv[1]), keep)\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "always::ResourceWarning", "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "ResourceWarning" not in done.stderr
    assert (tmp_path / ".lock").read_text().startswith("pid ")  # it was taken
