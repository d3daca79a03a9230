"""`tformer experiment` around a study's training: what a stopped or failed new study leaves, and the
warm-up rule for --steps (the studies' training itself is stubbed: tests/experiments runs it)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tformer.cli.main import main
from tformer.experiments import STUDIES


def norm_study_stopping(monkeypatch, stop: BaseException):
    """The norm study, its training replaced by a first arm that starts and then stops with `stop`."""
    module = importlib.import_module(STUDIES["norm"])

    def first_arm_stops(setting, out) -> None:
        (Path(out) / "arms" / "first").mkdir(parents=True, exist_ok=True)
        raise stop

    monkeypatch.setattr(module, "run", first_arm_stops)
    return module


@pytest.mark.parametrize("stop, kept", [(KeyboardInterrupt, True), (ValueError("no data"), False)])
def test_a_fresh_study_stopped_early_is_kept_for_resume_and_a_failed_one_removed(
    stop, kept: bool, monkeypatch, tmp_path: Path, capsys
) -> None:
    """Ctrl-C in the first arm of a new study keeps its directory and says how to go on (--resume, also
    when a resumed study is stopped again); a failure there (bad data, a batch that does not fit) leaves
    nothing behind."""
    norm_study_stopping(monkeypatch, stop)
    out = tmp_path / "study"
    code = main(["experiment", "norm", "--quick", "--out", str(out)])
    assert code == (130 if kept else 2)
    assert out.is_dir() == kept
    hint = f"tformer experiment: stopped; `tformer experiment norm --resume --out {out}` continues the study"
    err = capsys.readouterr().err
    assert (hint in err) == kept, err
    if kept:
        assert main(["experiment", "norm", "--resume", "--out", str(out)]) == 130
        assert hint in capsys.readouterr().err


def test_steps_that_exactly_cover_the_warm_up_and_the_measured_steps_are_enough(
    monkeypatch, tmp_path: Path, capsys
) -> None:
    study = norm_study_stopping(monkeypatch, KeyboardInterrupt)  # past the checks: training starts, stops
    after = study.STEPS_AFTER_WARMUP
    argv = ["experiment", "norm", "--quick", "--steps", str(4 + after), "--warmup-steps", "4"]
    assert main([*argv, "--out", str(tmp_path / "edge")]) == 130
    capsys.readouterr()
    assert main([*argv[:-1], "5", "--out", str(tmp_path / "over")]) == 2
    assert f"--steps {4 + after} must cover --warmup-steps 5" in capsys.readouterr().err
