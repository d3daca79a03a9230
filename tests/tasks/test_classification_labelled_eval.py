"""Scoring a classification run on labelled texts of the user's own: `tformer eval --labelled-file` and
`evaluate_labelled` (tformer.tasks.classification)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from tformer.cli.main import main
from tformer.runs import load_run
from tformer.tasks.classification import evaluate_labelled, evaluate_run, run_labels
from tformer.tasks.corpus import load_task_corpus


@pytest.fixture(scope="module")
def run(bbc_root: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cls") / "run"
    argv = ["train", "--preset", "tiny-classification", "--set", f"data.path={bbc_root}", "--set", "steps=2"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    return out


def eval_json(capsys, *argv: str) -> dict:
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_test_split_as_labelled_texts_scores_as_the_split_does(run: Path) -> None:
    loaded = load_run(run)
    docs = load_task_corpus(loaded.train_config.data, "classification")["test"]
    split = evaluate_run(loaded, "test")
    mine = evaluate_labelled(loaded, [(d.label, d.text) for d in docs], name="bbc_test")
    assert mine["data"] == "bbc_test" and mine["scored"] == "labelled" and split["scored"] == "split"
    differ = {"data", "scored", "confusion_png"}
    assert {k: v for k, v in mine.items() if k not in differ} == {
        k: v for k, v in split.items() if k not in differ
    }
    assert Path(mine["confusion_png"]).name == "eval_confusion_labelled_bbc_test.png"
    assert Path(mine["confusion_png"]).with_suffix(".json").exists()


def test_a_labelled_file_is_read_a_text_a_line_split_at_its_first_tab(
    run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    loaded = load_run(run)
    docs = load_task_corpus(loaded.train_config.data, "classification")["test"]
    items = [(d.label, " ".join(d.text.split())) for d in docs] * 4  # one line each; repeats scored too
    items[0] = (items[0][0], "a text\twith a tab in it")  # the text keeps its tabs
    assert len(items) > 8  # the premise: more than one batch of the run's 8
    path = tmp_path / "mine.tsv"
    path.write_text("\n".join(f"{label}\t{text}" for label, text in items) + "\n\n", encoding="utf-8")
    result = eval_json(capsys, "--run", str(run), "--labelled-file", str(path))
    expected = evaluate_labelled(loaded, items, name="mine")
    assert result["data"] == f"labelled file {path}" and result["n"] == result["texts"] == len(items)
    assert {k: v for k, v in result.items() if k not in ("data", "confusion_png")} == {
        k: v for k, v in expected.items() if k not in ("data", "confusion_png")
    }
    # the file's outputs: its stem and a digest of its path (a mine.tsv elsewhere writes its own)
    assert re.fullmatch(r"eval_confusion_labelled_mine-[0-9a-f]{8}\.png", Path(result["confusion_png"]).name)
    monkeypatch.setattr("sys.stdin", io.StringIO(path.read_text(encoding="utf-8")))
    from_stdin = eval_json(capsys, "--run", str(run), "--labelled-file", "-", "--max-batches", "1")
    assert from_stdin["data"] == "labelled file stdin"
    assert Path(from_stdin["confusion_png"]).name == "eval_confusion_labelled_stdin_sample.png"
    spaced = [(f" {label} ", text) for label, text in items]  # spaces around a label: the label
    assert evaluate_labelled(loaded, spaced, name="mine")["accuracy"] == expected["accuracy"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{label}\t{text}\r" for label, text in items)))
    assert eval_json(capsys, "--run", str(run), "--labelled-file", "-")["n"] == len(
        items
    )  # lines ended by \r
    assert main(["eval", "--run", str(run), "--labelled-file", str(path), "--max-batches", "1"]) == 0
    assert f"(step 2, 8 of the labelled texts' {len(items)} texts, --max-batches)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "business\tMarkets rose.\nsport\n",
            "line 2: expected one label<TAB>text line, found 0 tabs: 'sport'",
        ),
        (
            "\tMarkets rose.\n",
            "line 1: expected one label<TAB>text line, found an empty side: '\\tMarkets rose.'",
        ),
        ("\n\n", "holds no label<TAB>text line"),
    ],
)
def test_a_bad_labelled_file_is_named_with_its_line(
    run: Path, tmp_path: Path, capsys, text: str, message: str
) -> None:
    path = tmp_path / "labelled.tsv"
    path.write_text(text, encoding="utf-8")
    assert main(["eval", "--run", str(run), "--labelled-file", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"tformer eval: error: {path} {message}\n" and captured.out == ""


def test_a_label_the_run_never_trained_on_is_named_with_its_classes(
    run: Path, tmp_path: Path, capsys
) -> None:
    labels = run_labels(load_run(run))
    path = tmp_path / "labelled.tsv"
    path.write_text(f"{labels[0]}\tMarkets rose.\nweather\tRain again.\n", encoding="utf-8")
    assert main(["eval", "--run", str(run), "--labelled-file", str(path)]) == 2
    classes = ", ".join(map(repr, labels))
    assert capsys.readouterr().err == (
        "tformer eval: error: the labelled texts hold labels the run never trained on: 'weather' (its classes: "
        f"{classes}); use the run's class names\n"
    )


def test_labelled_file_on_another_task_or_beside_a_split_is_refused(
    run: Path, dictionary_file: Path, tmp_path: Path, capsys
) -> None:
    path = tmp_path / "labelled.tsv"
    path.write_text("business\tMarkets rose.\n", encoding="utf-8")
    assert main(["eval", "--run", str(run), "--split", "val", "--labelled-file", str(path)]) == 2
    assert "not --split and --labelled-file\n" in capsys.readouterr().err
    assert main(["eval", "--run", str(run), "--pairs-file", str(path)]) == 2
    assert capsys.readouterr().err == (
        "tformer eval: error: --pairs-file is for translation runs; this is a classification run\n"
    )
    mt = tmp_path / "mt"
    argv = [
        "train",
        "--preset",
        "tiny-translation",
        "--set",
        f"data.path={dictionary_file}",
        "--set",
        "steps=1",
    ]
    assert main([*argv, "--out", str(mt), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(mt), "--labelled-file", str(path)]) == 2
    assert capsys.readouterr().err == (
        "tformer eval: error: --labelled-file is for classification runs; this is a translation run\n"
    )


def test_evaluate_labelled_names_bad_arguments(run: Path) -> None:
    with pytest.raises(TypeError, match="items must be a list of .label, text. pairs, got str"):
        evaluate_labelled(run, "business\tMarkets rose.")
    with pytest.raises(ValueError, match="no items to score"):
        evaluate_labelled(run, [])
    with pytest.raises(TypeError, match=r"items\[1\] must be a .label, text. pair of two str"):
        evaluate_labelled(run, [("business", "a"), ("business", 3)])
    with pytest.raises(ValueError, match=r"items\[0\] has an empty text"):
        evaluate_labelled(run, [("business", " ")])
    with pytest.raises(ValueError, match="name must be a non-empty str usable in a file name"):
        evaluate_labelled(run, [("business", "Markets rose.")], name="a/b")
