"""A study's directory and setting: what a failed study leaves in a user's directory, setting.json files
of the wrong shape, damaged arms on --resume, the Python API's run / report, bounds checked before any
arm trains, a diverged warm-up arm in the norm verdicts, the vocabulary a report states."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from tformer.cli.main import main
from tformer.experiments import norm
from tformer.experiments.runner import ArmLog, scored_windows, vocabulary_words

from .test_parts import norm_grid

QUICK = ["--quick", "--threads", "1"]


def test_a_failed_study_in_a_users_directory_removes_what_it_wrote(tmp_path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    # fails once the data, tokenizer and setting are written: no full batch
    assert main(["experiment", "norm", *QUICK, "--batch-size", "100000", "--out", str(out)]) == 2
    assert "lower the batch size" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # not read as an unfinished study after
    assert main(["experiment", "norm", *QUICK, "--vocab-size", "10", "--out", str(out)]) == 2
    assert "--vocab-size must be from 260" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--seeds", "100000000"], "--seeds must be at most 1,000"),
        (["--depths", "2,99999999999999999999"], "the model does not fit in memory"),
        (["--lr", "-1"], "--lr must be > 0"),
        (
            ["--steps", "1", "--warmup-steps", "0"],
            "--warmup-steps must be >= 1",
        ),  # not "give --steps 2", then this
    ],
)
def test_sizes_past_the_machine_are_refused_before_any_arm_trains(argv, needle, tmp_path, capsys) -> None:
    t0 = time.perf_counter()
    assert main(["experiment", "norm", *QUICK, "--out", str(tmp_path / "s"), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "s").exists() and time.perf_counter() - t0 < 20  # it had hung building arms


FULL_SETTING = norm.QUICK.to_dict()


@pytest.mark.parametrize(
    "payload, needle",
    [
        ({"study": "norm"}, "'mode' must be 'quick' or 'full', got nothing"),
        ({"setting": {}}, "'study' must be one of moe, norm, rope, got nothing"),
        ({"study": "norm", "mode": "quick", "setting": [1]}, "'setting' must be a JSON object"),
        (
            {"study": "norm", "mode": "quick", "setting": {**FULL_SETTING, "steps": "10"}},
            'setting steps = "10"',
        ),
        ({"study": "norm", "mode": "quick", "setting": {}}, "the setting lacks"),
        ({"study": "norm", "mode": "quick", "setting": {**FULL_SETTING, "seeds": 0}}, "seeds must be >= 1"),
    ],
)
def test_a_setting_json_of_the_wrong_shape_is_named(payload, needle, tmp_path, capsys) -> None:
    (tmp_path / "setting.json").write_text(json.dumps(payload))
    for option in ("--report-only", "--resume"):
        assert main(["experiment", "norm", option, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "setting.json" in err and "Traceback" not in err, err


def test_resume_trains_again_an_arm_whose_metrics_were_damaged(tmp_path, capsys) -> None:
    out = tmp_path / "study"
    assert main(["experiment", "norm", *QUICK, "--depths", "2", "--out", str(out)]) == 0
    metrics = out / "arms" / "pre-L2-warmup-s0" / "metrics.jsonl"
    whole = metrics.read_text()
    lines = whole.splitlines(keepends=True)
    metrics.write_text("".join(lines[: len(lines) // 3]))  # cut short between records; its DONE marker stays
    capsys.readouterr()  # (one cut inside a record: experiments/test_quick.py)
    assert main(["experiment", "norm", "--report-only", "--out", str(out)]) == 2
    assert "not pre-L2-warmup-s0" in capsys.readouterr().err
    with pytest.warns(UserWarning, match=f"{re.escape(str(metrics))} does not show the arm's end"):
        assert main(["experiment", "norm", "--resume", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pre-L2-warmup-s0: val loss" in printed and printed.count("kept from the earlier attempt") == 3
    assert untimed(metrics.read_text()) == untimed(whole)  # each arm seeded on its own: the same records


def untimed(text: str) -> list[dict]:
    """metrics.jsonl records without their wall-clock times."""
    return [{k: v for k, v in json.loads(line).items() if k != "time_s"} for line in text.splitlines()]


def test_the_python_api_makes_the_directory_and_refuses_another_setting(tmp_path) -> None:
    setting = norm.QUICK.replace(depths=(2,), steps=6)
    out = tmp_path / "new" / "study"
    norm.run(setting, str(out))  # a directory that does not exist yet, given as a str
    _, summary = norm.report(str(out))
    assert "pre-L2-warmup-s0" in summary
    with pytest.raises(ValueError, match=r"another setting \(steps 6 -> 8; lr 0.001 -> 0.5\)"):
        norm.run(setting.replace(steps=8, lr=0.5), out)


def test_a_diverged_warm_up_arm_counts_against_needing_warm_up() -> None:
    s = norm.NormSetting(depths=(2,), seeds=1, steps=6, warmup_steps=2)
    claim = "Post-Norm needs learning-rate warm-up more than Pre-Norm"
    # Post-Norm diverged with warm-up and trained without: dropping warm-up helped it
    helped = {("post", True): math.nan, ("post", False): 6.0, ("pre", True): 2.9, ("pre", False): 2.95}
    assert {v.claim: v for v in norm.verdicts(norm_grid(helped, 4.0), s)}[claim].holds is False
    # both placements diverged with warm-up only: neither needs it more
    both = {("post", True): math.nan, ("post", False): 6.0, ("pre", True): math.nan, ("pre", False): 3.0}
    assert {v.claim: v for v in norm.verdicts(norm_grid(both, 4.0), s)}[claim].holds is None


def test_the_vocabulary_stated_is_the_one_the_arms_trained_with() -> None:
    arms = [ArmLog("a", 0, {}, {"vocab_size": 5983}, []), ArmLog("b", 0, {}, {"vocab_size": 5983}, [])]
    assert vocabulary_words(arms, 60000) == "5,983 (60,000 asked: the training text held no more merges)"
    assert vocabulary_words(arms[:1], 5983) == "5983"


def test_a_depth_of_one_block_leaves_the_init_gradient_claim_open() -> None:
    s = norm.NormSetting(depths=(1,), seeds=1, steps=6, warmup_steps=2)
    arms = norm_grid({(p, w): 3.0 for p in ("post", "pre") for w in (True, False)}, 4.0)
    for a in arms:  # one block: its ratio last / first is 1 by construction
        a.records[0]["layer_grad_norms"] = {"blocks.0": 1.0}
    verdict = norm.verdicts(arms, s)[0]
    assert verdict.claim.startswith("At initialisation") and verdict.holds is None


def test_the_windows_stated_are_the_ones_scored(tmp_path, capsys) -> None:
    arms = [ArmLog("a", 0, {}, {}, [{"kind": "eval", "step": 4, "eval_loss": 3.0, "windows_scored": 1936}])]
    assert scored_windows(arms, 2048) == 1936 and scored_windows([], 2048) == 2048
    (tmp_path / "setting.json").write_text(
        json.dumps({"study": "norm", "mode": "quick", "setting": FULL_SETTING})
    )
    assert main(["experiment", "norm", "--report-only", "--out", str(tmp_path)]) == 2  # setting, no arms yet
    assert "is incomplete: 0 of 8 arms finished" in capsys.readouterr().err  # (it had been "No such file")


def test_begin_study_takes_a_setting_as_its_file_will_hold_it(tmp_path) -> None:
    from tformer.experiments.study_dir import begin_study

    listed = norm.QUICK.replace(
        depths=[2, 4]
    )  # a list from Python: compared as the tuple the file gives back
    for _ in range(2):
        begin_study(tmp_path / "a", "norm", listed, norm.QUICK)
    with pytest.raises(ValueError, match=r"the setting given: setting steps = 16.0 is not a int"):
        begin_study(tmp_path / "b", "norm", norm.QUICK.replace(steps=16.0), norm.QUICK)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tokenizer.json").write_text("{}")  # a training run's: not taken as the study's
    with pytest.raises(ValueError, match="holds tokenizer.json of something else"):
        begin_study(tmp_path / "run", "norm", norm.QUICK, norm.QUICK)


def test_device_auto_is_recorded_as_the_device_it_picked(tmp_path) -> None:
    """setting.json (and so the report's "fp32 on ...") holds the device the arms trained on, not "auto"; a
    second call with "auto" is the same setting."""
    from tformer.experiments.study_dir import begin_study, setting_of

    auto = norm.QUICK.replace(device="auto")
    for _ in range(2):
        begin_study(tmp_path / "a", "norm", auto, norm.QUICK)
    assert setting_of(tmp_path / "a", norm.NormSetting).device == "cpu"  # this machine has no CUDA
    from tformer.experiments.study_dir import write_setting

    (tmp_path / "b").mkdir()  # a study saved with "auto" before it was resolved goes on (it had been refused)
    write_setting(tmp_path / "b", "norm", "quick", auto)
    begin_study(tmp_path / "b", "norm", auto, norm.QUICK)


def test_resume_with_quick_of_a_full_study_is_refused(tmp_path, capsys) -> None:
    """--quick names a quick study's default --out; given with --resume on a full study's directory it had
    been dropped without a word."""
    (tmp_path / "setting.json").write_text(
        json.dumps({"study": "norm", "mode": "full", "setting": FULL_SETTING})
    )
    assert main(["experiment", "norm", "--resume", "--quick", "--out", str(tmp_path)]) == 2
    assert "holds a full norm study, not a quick one; --resume goes on" in capsys.readouterr().err


def test_the_steadier_gradients_evidence_shows_both_schedules_the_rule_reads() -> None:
    s = norm.NormSetting(depths=(2,), seeds=1, steps=6, warmup_steps=2)
    arms = norm_grid({(p, w): 3.0 for p in ("post", "pre") for w in (True, False)}, 4.0)
    (verdict,) = [
        v for v in norm.verdicts(arms, s) if v.claim.startswith("Pre-Norm's gradients are steadier")
    ]
    assert "CV with warm-up: Post L2" in verdict.evidence and "; without: Post L2" in verdict.evidence


def test_a_study_continued_packs_a_text_file_as_it_began(tmp_path) -> None:
    """A text: file is packed with its pieces joined; the study's own data.json had dropped that flag, so a
    study continued later (--resume) packed the same file into other windows."""
    from tformer.experiments.runner import Setting, StudyData

    text = tmp_path / "big.txt"
    text.write_text("".join(f"line {i} of a text the study reads\n" for i in range(3000)))
    setting = Setting(corpus=f"text:{text}", vocab_size=300, seq_len=32, steps=2, warmup_steps=1, seeds=1)
    (tmp_path / "study").mkdir()
    first = StudyData(setting, tmp_path / "study")
    again = StudyData(setting, tmp_path / "study")
    assert first.task.join is True and again.task.join is True
