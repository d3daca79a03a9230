"""Each study's --quick mode end to end through the CLI, in-process: it writes report.md, a
self-contained report.html and its PNGs, and the report's numbers are the ones its logs hold."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from tformer.cli.main import main
from tformer.experiments.runner import read_records
from tformer.experiments.study_dir import read_setting

PNGS = {
    "norm": ["norm_init_grads.png", "norm_loss.png", "norm_grad_norm.png", "norm_layer_grads.png"],
    "rope": ["rope_position_ppl.png", "rope_length_ppl.png", "rope_training.png"],
    "moe": ["moe_loss.png", "moe_load_heatmap.png", "moe_maxvio.png", "moe_disable.png"],
}


def run_quick(study: str, root: Path) -> tuple[Path, str]:
    import contextlib
    import io

    out = root / study
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["experiment", study, "--quick", "--out", str(out), "--threads", "1"])
    assert code == 0, buf.getvalue()
    return out, buf.getvalue()


@pytest.fixture(scope="module", params=["norm", "rope", "moe"])
def quick_run(request, tmp_path_factory) -> tuple[str, Path, str]:
    out, stdout = run_quick(request.param, tmp_path_factory.mktemp("experiments"))
    return request.param, out, stdout


def table_row(md: str, first_cell: str) -> list[str]:
    """The cells of the first Markdown table row whose first cell is `first_cell`."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row starting with {first_cell!r}")


def last_eval(run: Path, arm: str) -> float:
    return [r for r in read_records(run / "arms" / arm / "metrics.jsonl") if r["kind"] == "eval"][-1][
        "eval_loss"
    ]


def test_quick_run_writes_report_files(quick_run):
    study, out, stdout = quick_run
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    for png in PNGS[study]:
        assert (out / png).stat().st_size > 1000, png
        assert f"]({png})" in md
    assert page.count("data:image/png;base64,") == len(PNGS[study])
    assert not re.search(r'src="(?!data:)', page), "report.html must not reference outside files"
    assert "## Verdicts" in md and "Quick setting" in md
    assert re.search(r"\[(reproduced|not reproduced|inconclusive)\] ", stdout)
    assert (
        "quick setting (a smoke test of the pipeline): these verdicts say nothing about the claims" in stdout
    )
    assert json.loads((out / "setting.json").read_text())["study"] == study
    assert all((d / "metrics.jsonl").exists() for d in (out / "arms").iterdir())


def test_report_numbers_come_from_the_logs(quick_run):
    study, out, _ = quick_run
    md = (out / "report.md").read_text()
    if study == "norm":
        cells = table_row(md, "post-L2-warmup-s0")  # column 8: final val loss
        assert float(cells[7]) == pytest.approx(last_eval(out, "post-L2-warmup-s0"), abs=6e-5)
    elif study == "rope":
        cells = table_row(md, "RoPE")  # variant, seed, ppl @ 1L, ...
        records = read_records(out / "arms" / "rope-s0" / "metrics.jsonl")
        losses = next(
            r for r in records if r["kind"] == "position_eval" and r["method"] == "none" and r["factor"] == 1
        )["position_loss"]
        assert float(cells[2]) == pytest.approx(math.exp(sum(losses) / len(losses)), abs=6e-3)
    else:
        cells = table_row(md, "deepseekmoe-s0")
        assert float(cells[1]) == pytest.approx(last_eval(out, "deepseekmoe-s0"), abs=6e-5)
        records = read_records(out / "arms" / "deepseekmoe-s0" / "metrics.jsonl")
        layers = next(r for r in records if r["kind"] == "routing_eval")["layers"].values()
        assert float(cells[4]) == pytest.approx(sum(x["max_vio"] for x in layers) / len(layers), abs=6e-4)


def test_report_only_rebuilds_the_same_report(quick_run, capsys):
    study, out, _ = quick_run
    before = (out / "report.md").read_text()
    assert main(["experiment", study, "--report-only", "--out", str(out)]) == 0
    assert (out / "report.md").read_text() == before


def test_report_only_of_an_interrupted_study_names_what_is_missing(quick_run, tmp_path, capsys):
    """A study stopped after some arms (one arm gone, one cut before its last evaluation): --report-only
    says so instead of failing inside a plot or a table."""
    study, out, _ = quick_run
    copy = tmp_path / "stopped"
    shutil.copytree(out, copy)
    arms = sorted((copy / "arms").iterdir())
    shutil.rmtree(arms[-1])
    log = arms[0] / "metrics.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:3]))
    assert main(["experiment", study, "--report-only", "--out", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"is incomplete: {len(arms) - 2} of {len(arms)} arms finished" in err, err
    assert arms[0].name in err and "Traceback" not in err
    # an arm killed during its analyses (after training to the end): no DONE marker, not finished
    shutil.copytree(out, copy, dirs_exist_ok=True)
    (arms[1] / "DONE").unlink()
    assert main(["experiment", study, "--report-only", "--out", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"is incomplete: {len(arms) - 1} of {len(arms)} arms finished" in err and arms[1].name in err, err


def cut_in_its_last_record(log: Path) -> str:
    """`log` cut in the middle of its last line (an audit cut a finished arm's file by 50 bytes, which
    left its final eval whole and took half an analysis record); the file as it was."""
    whole = log.read_text()
    log.write_text(whole[: len(whole) - 1 - len(whole.splitlines()[-1]) // 2])
    return whole


def untimed(log: Path) -> list[dict]:
    """A metrics.jsonl's records without their wall-clock times."""
    return [{k: v for k, v in r.items() if k != "time_s"} for r in read_records(log)]


def claims(run: Path) -> list[str]:
    """The claims table of a quick run's report.md: each claim, its rule, verdict and evidence."""
    return [
        line for line in (run / "report.md").read_text().splitlines() if "(quick run: not evidence)" in line
    ]


def test_report_only_names_a_damaged_setting_and_a_finished_arms_half_written_record(
    quick_run, tmp_path, capsys
):
    """A finished arm's metrics.jsonl whose last record was cut in half after the arm finished (a killed
    arm leaves such a line, a finished one never does): --report-only names the file and says to train
    the arm again, instead of a report from part of its records (the line had been skipped without a
    word, and the moe study's verdict on expert specialisation flipped)."""
    study, out, _ = quick_run
    copy = tmp_path / "damaged"
    shutil.copytree(out, copy)
    log = sorted((copy / "arms").iterdir())[0] / "metrics.jsonl"
    lines = cut_in_its_last_record(log).count("\n")
    assert main(["experiment", study, "--report-only", "--out", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tformer experiment: error: {log} is damaged: line {lines} is not a whole record")
    assert "train it again with --resume" in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert (copy / "report.md").read_text() == (out / "report.md").read_text()  # left as it was
    (copy / "setting.json").write_text("[]")
    assert main(["experiment", study, "--report-only", "--out", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"{copy / 'setting.json'} holds an array where tformer wrote an object" in err
    assert "Traceback" not in err


def test_resume_trains_only_the_arms_that_did_not_finish(quick_run, tmp_path, capsys):
    """A study stopped with one arm cut mid-training and one never started: --resume keeps the finished
    arms' logs byte for byte and trains the two again, to the losses of the uninterrupted run."""
    study, out, _ = quick_run
    copy = tmp_path / "stopped"
    shutil.copytree(out, copy)
    for name in ("report.md", "report.html"):
        (copy / name).unlink()
    arms = sorted((copy / "arms").iterdir())
    shutil.rmtree(arms[-1])
    (arms[0] / "DONE").unlink()
    log = arms[0] / "metrics.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:3]))
    kept = {a.name: (a / "metrics.jsonl").read_bytes() for a in arms[1:-1]}
    assert main(["experiment", study, "--quick", "--out", str(copy)]) == 2  # a fresh start is refused
    assert "continue it with --resume" in capsys.readouterr().err
    assert main(["experiment", study, "--resume", "--out", str(copy), "--threads", "1"]) == 0
    assert capsys.readouterr().out.count("(kept from the earlier attempt)") == len(kept)
    assert {n: (copy / "arms" / n / "metrics.jsonl").read_bytes() for n in kept} == kept

    def losses(run: Path, arm: str) -> list[tuple[int, float]]:
        return [
            (r["step"], r["loss"])
            for r in read_records(run / "arms" / arm / "metrics.jsonl")
            if r["kind"] == "train"
        ]

    for arm in (arms[0].name, arms[-1].name):
        assert losses(copy, arm) == losses(out, arm) and losses(out, arm)
    assert (copy / "report.md").is_file()
    # a finished study: nothing trains, the report is made again
    assert main(["experiment", study, "--resume", "--out", str(copy)]) == 0
    printed = capsys.readouterr().out
    assert "every arm had finished: nothing to train" in printed and "trained in" not in printed
    # setting.json records the threads the arms trained with; a resume with others says so
    assert read_setting(copy)["threads"] == 1
    shutil.rmtree(copy / "arms" / arms[-1].name)
    assert main(["experiment", study, "--resume", "--out", str(copy), "--threads", "2"]) == 0
    assert capsys.readouterr().err == (
        "tformer experiment: warning: this --resume computes otherwise than the study's finished arms did "
        "(threads 1 -> 2): the 1 arm left can differ from an uninterrupted study's in the last digits; "
        "--threads 1 trains them as the first ones\n"
    )
    assert main(["experiment", study, "--resume", "--out", str(copy), "--steps", "3"]) == 2
    assert (
        "--resume goes on with the run's own settings; --steps would change nothing"
        in capsys.readouterr().err
    )


def test_resume_trains_again_a_finished_arm_whose_last_record_was_cut(quick_run, tmp_path):
    """A finished arm whose metrics.jsonl lost half its last record is not kept by --resume: it is trained
    again, with a warning naming the file, to the records and report of the undamaged study. An arm killed
    while training (no DONE marker) whose last line is half written is what a kill leaves: trained again
    without a warning."""
    study, out, _ = quick_run
    copy = tmp_path / "damaged"
    shutil.copytree(out, copy)
    (copy / "report.md").unlink()
    arms = sorted((copy / "arms").iterdir())
    cut, killed = arms[0] / "metrics.jsonl", arms[1] / "metrics.jsonl"
    cut_in_its_last_record(cut)
    lines = killed.read_text().splitlines(keepends=True)
    killed.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    (arms[1] / "DONE").unlink()
    with pytest.warns(UserWarning, match=re.escape(f"{cut} is damaged: line")) as caught:
        assert main(["experiment", study, "--resume", "--out", str(copy), "--threads", "1"]) == 0
    named = [str(w.message) for w in caught if "metrics.jsonl" in str(w.message)]
    assert len(named) == 1 and named[0].endswith("the arm is trained again")  # none for the killed arm
    for arm in arms[:2]:
        assert untimed(arm / "metrics.jsonl") == untimed(out / "arms" / arm.name / "metrics.jsonl")
    assert all((arm / "DONE").is_file() for arm in arms)
    assert claims(copy) == claims(out) and claims(out)


def test_existing_run_is_not_overwritten(quick_run, capsys):
    study, out, _ = quick_run
    assert main(["experiment", study, "--quick", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.slow
def test_norm_encoder_decoder_arm(tmp_path):
    """Post- vs Pre-Norm on translation (trans-de-en, installed by `make data`) with BLEU in the report."""
    args = ["experiment", "norm", "--quick", "--arch", "encoder_decoder", "--depths", "2", "--steps", "6"]
    assert main([*args, "--out", str(tmp_path), "--threads", "1"]) == 0
    md = (tmp_path / "report.md").read_text()
    cells = table_row(md, "pre-L2-warmup-s0")
    evals = [
        r
        for r in read_records(tmp_path / "arms" / "pre-L2-warmup-s0" / "metrics.jsonl")
        if r["kind"] == "eval"
    ]
    assert float(cells[-1]) == pytest.approx(evals[-1]["bleu"], abs=6e-3)
    assert "loses BLEU" in md
