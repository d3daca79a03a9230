"""A run directory whose small JSON files were damaged or edited (data.json, config.json, metrics.jsonl):
one line naming the file, or the damaged record skipped; never a traceback."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tformer.cli.main import main
from tformer.json_files import read_json, read_json_lines
from tformer.train.metrics import read_metrics


def test_read_json_names_the_file_and_what_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    assert read_json(path) == {"a": 1}
    for text, said in (("[]", "holds an array where tformer wrote an object"), ("true", "holds true / false"),
                       ("{bad", "is not a readable JSON file (Expecting property name")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ValueError, match="^" + re.escape(str(path)) + ".*" + re.escape(said)):
            read_json(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="is not a readable JSON file"):
        read_json(path)
    path.write_text('{"a": 1}\n[2]\n{"b": \n\n{"c": 3}\n')
    assert read_json_lines(path) == [{"a": 1}, {"c": 3}]
    assert read_json_lines(tmp_path / "none.jsonl") == []


@pytest.mark.parametrize("text", ["[]", "{bad", "{}"])
def test_a_damaged_data_json_is_named(trained_run: Path, tmp_path: Path, capsys, text: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "data.json").write_text(text)
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    for argv in (["eval", "--run", str(run)], ["train", "--out", str(run), "--resume", "--set", "steps=9"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{run / 'data.json'} " in err and "damaged or edited?" in err and "Traceback" not in err
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == saved  # nothing trained or lost


def test_a_config_json_that_is_not_a_mapping_is_named(trained_run: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "config.json").write_text("[]")
    assert main(["train", "--out", str(run), "--resume", "--set", "steps=9"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'config.json'}: a TrainConfig file holds a mapping of its fields, got a list" in err


def test_an_edited_metrics_record_is_skipped_and_the_resumed_run_finishes(
    trained_run: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = read_metrics(run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train"}\n{"kind": "train", "step": "x", "loss": 1.0}\n{"step": 1}\n')
    assert read_metrics(run) == before
    steps = max(r["step"] for r in before) + 1
    assert main(["train", "--out", str(run), "--resume", "--set", f"steps={steps}", "--no-progress"]) == 0
    records = read_metrics(run)
    assert records[: len(before)] == before and records[-1]["step"] == steps
    assert (run / "loss.png").stat().st_size > 0
