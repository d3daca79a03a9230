"""What `tformer train` under torchrun says when the checks every rank makes before training fail: an error
every rank meets in the same words once, a rank's own error with its rank, and a rank whose checks passed
stops at once with one line naming the ranks that failed (it had waited for them in the next collective)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_distributed import HERE, torchrun, torchrun_train
from tests.words import write_word_corpus

pytestmark = pytest.mark.distributed


def said(stderr: str) -> list[str]:
    """tformer's own lines (torchrun adds its report of the failed workers)."""
    return sorted(line for line in stderr.splitlines() if line.startswith("tformer train:"))


@pytest.mark.parametrize(
    ("failing", "words", "lines"),
    [
        ("0,1", "same", ["tformer train: error: the run directory fails a check"]),
        (
            "0,1",
            "own",
            ["tformer train: error (rank 1): rank 1's own", "tformer train: error: rank 0's own"],
        ),
        (
            "1",
            "own",
            [
                "tformer train: error (rank 1): rank 1's own",
                "tformer train: error: rank 1 failed with the error above; every rank stops",
            ],
        ),
        ("0", "own", ["tformer train: error: rank 0's own"]),
    ],
    ids=["same-everywhere", "each-its-own", "rank1-only", "rank0-only"],
)
def test_failed_checks_are_said_once(failing: str, words: str, lines: list[str]) -> None:
    proc = torchrun(str(HERE / "failing_checks.py"), failing, words, timeout=120)
    assert proc.returncode != 0
    assert said(proc.stderr) == sorted(lines), proc.stderr[-4000:]
    workers = proc.stderr.split("failed (exitcode")[0]  # before torchrun's report (and its traceback)
    assert "Traceback" not in workers, proc.stderr[-4000:]


def test_a_real_check_every_rank_fails_is_said_once(tmp_path: Path) -> None:
    """A second launch into a run directory that holds checkpoints, without --resume."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_word_corpus(corpus)
    out = tmp_path / "run"
    assert torchrun_train(out, corpus).returncode == 0
    proc = torchrun_train(out, corpus)
    assert proc.returncode != 0
    assert said(proc.stderr) == [
        f"tformer train: error: {out} already holds checkpoints; pass --resume or choose another --out"
    ], proc.stderr[-4000:]
