"""Scoring a translation run on pairs of the user's own: `tformer eval --pairs-file` and `evaluate_pairs`
(tformer.tasks.translation_eval)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from tests.cli_run import tiny_lm_argv
from tformer.cli.main import main
from tformer.runs import load_run
from tformer.tasks.translation import evaluate_pairs, load_translation_corpus


@pytest.fixture(scope="module")
def run(dictionary_file: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mt") / "run"
    argv = ["train", "--preset", "tiny-translation", "--set", f"data.path={dictionary_file}"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    return out


def eval_json(capsys, *argv: str) -> dict:
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_file_of_the_test_split_scores_as_the_split_does(run: Path, tmp_path: Path, capsys) -> None:
    """The test split written as source<TAB>reference lines (an empty line among them, skipped) gives the
    split's scores, loss and translations, sample for sample (--max-batches 2: 64 pairs spread over it)."""
    test = list(load_translation_corpus(load_run(run).train_config.data)["test"])
    path = tmp_path / "newstest.tsv"
    lines = [f"{p.src}\t{p.tgt}\n" for p in test]
    path.write_text("".join(lines[:3] + ["\n"] + lines[3:]), encoding="utf-8")
    split = eval_json(capsys, "--run", str(run), "--max-batches", "2")
    mine = eval_json(capsys, "--run", str(run), "--pairs-file", str(path), "--max-batches", "2")
    assert mine["data"] == f"pairs file {path}" and split["data"].endswith("test split")
    assert mine["sentences"] == 64 and mine["split_sentences"] == len(test)
    differ = {"data", "scored", "sentences_per_s", "translations"}
    assert {k: v for k, v in mine.items() if k not in differ} == {
        k: v for k, v in split.items() if k not in differ
    }
    assert re.fullmatch(
        r"translations_pairs_newstest-[0-9a-f]{8}_sample\.txt", Path(mine["translations"]).name
    )
    assert Path(mine["translations"]).read_text() == Path(split["translations"]).read_text()
    assert main(["eval", "--run", str(run), "--pairs-file", str(path), "--max-batches", "1"]) == 0
    assert (
        f"pairs file {path} (step 4, 32 of the pairs' {len(test)} sentences, --max-batches"
        in capsys.readouterr().out
    )


def test_every_pair_is_scored_repeats_too_and_stdin_is_read(run: Path, monkeypatch, capsys) -> None:
    pairs = [("Der Hund.", "The dog."), ("Die Katze.", "The cat.")] * 2 + [("Der Mann.", "The man.")]
    result = evaluate_pairs(run, pairs)
    assert result["sentences"] == result["split_sentences"] == 5 and result["data"] == "pairs"
    assert result["scored"] == "pairs"
    lines = Path(result["translations"]).read_text().splitlines()
    assert Path(result["translations"]).name == "translations_pairs.txt" and len(lines) == 5  # no name
    assert lines[0] == lines[2] and lines[1] == lines[3]  # the repeats translated (and scored) again
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{s}\t{t}\n" for s, t in pairs)))
    from_stdin = eval_json(capsys, "--run", str(run), "--pairs-file", "-")
    assert from_stdin["data"] == "pairs file stdin" and from_stdin["bleu"] == result["bleu"]
    assert Path(from_stdin["translations"]).name == "translations_pairs_stdin.txt"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "Der Hund.\tThe dog.\nDie Katze.\n",
            "line 2: expected one source<TAB>reference pair, found 0 tabs: 'Die Katze.'",
        ),
        (
            "Der Hund.\tThe dog.\tnoch\n",
            "line 1: expected one source<TAB>reference pair, found 2 tabs: 'Der Hund.\\tThe dog.\\tnoch'",
        ),
        (
            "\nDer Hund.\t \n",
            "line 2: expected one source<TAB>reference pair, found an empty side: 'Der Hund.\\t '",
        ),
        ("\n\n", "holds no source<TAB>reference pair"),
        (
            "Der Hund.\tThe dog.\n \t \n",
            "line 2: expected one source<TAB>reference pair, found an empty side: ' \\t '",
        ),
    ],
)
def test_a_bad_pairs_file_is_named_with_its_line(
    run: Path, tmp_path: Path, capsys, text: str, message: str
) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_text(text, encoding="utf-8")
    assert main(["eval", "--run", str(run), "--pairs-file", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"tformer eval: error: {path} {message}\n" and captured.out == ""


def test_pairs_file_with_a_split_or_on_another_task_is_refused(run: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_text("Der Hund.\tThe dog.\n", encoding="utf-8")
    assert main(["eval", "--run", str(run), "--split", "val", "--pairs-file", str(path)]) == 2
    assert capsys.readouterr().err == (
        "tformer eval: error: give one of --split, --text-file, --pairs-file and --labelled-file, not --split and "
        "--pairs-file\n"
    )
    assert main(["eval", "--run", str(run), "--text-file", str(path), "--pairs-file", str(path)]) == 2
    assert "not --text-file and --pairs-file\n" in capsys.readouterr().err
    lm = tmp_path / "lm"
    assert main(tiny_lm_argv(lm, "shakespeare", 2)) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(lm), "--pairs-file", str(path)]) == 2
    assert capsys.readouterr().err == (
        "tformer eval: error: --pairs-file is for translation runs; this is an lm run (--text-file scores a text)\n"
    )


def test_pairs_file_on_a_classification_run_is_refused(bbc_root: Path, tmp_path: Path, capsys) -> None:
    cls = tmp_path / "cls"
    argv = ["train", "--preset", "tiny-classification", "--set", f"data.path={bbc_root}", "--set", "steps=2"]
    assert main([*argv, "--out", str(cls), "--no-progress"]) == 0
    capsys.readouterr()
    path = tmp_path / "pairs.tsv"
    path.write_text("Der Hund.\tThe dog.\n", encoding="utf-8")
    assert main(["eval", "--run", str(cls), "--pairs-file", str(path)]) == 2
    assert capsys.readouterr().err == (
        "tformer eval: error: --pairs-file is for translation runs; this is a classification run\n"
    )


def test_the_scoring_module_imports_first_or_second() -> None:
    """tasks.translation offers translation_eval's names; either module can be the first imported."""
    import subprocess
    import sys

    for first in ("tformer.tasks.translation_eval", "tformer.tasks.translation"):
        code = f"import {first}; from tformer.tasks.translation import evaluate_pairs, evaluate_run, format_result"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    import tformer.tasks.translation as translation

    with pytest.raises(AttributeError, match="has no attribute 'evaluate_everything'"):
        translation.evaluate_everything  # noqa: B018


def test_a_file_name_with_a_backslash_is_kept_apart_from_the_split_files(
    run: Path, tmp_path: Path, capsys
) -> None:
    path = tmp_path / "news\\test.tsv"
    path.write_text("Der Hund.\tThe dog.\nDie Katze.\tThe cat.\n", encoding="utf-8")
    result = eval_json(capsys, "--run", str(run), "--pairs-file", str(path))
    assert re.fullmatch(r"translations_pairs_news_test-[0-9a-f]{8}\.txt", Path(result["translations"]).name)
    assert evaluate_pairs(run, [("Der Hund.", "The dog.")], name="test")["translations"].endswith(
        "translations_pairs_test.txt"
    )  # not the test split's translations_test.txt


def test_same_named_files_in_two_folders_keep_their_outputs_apart(run: Path, tmp_path: Path, capsys) -> None:
    """The outputs of a pairs file are named by its stem and a digest of its path: a second test.tsv in
    another folder does not overwrite the first one's translations."""
    written = {}
    for folder, pairs in (
        ("a", "Der Hund.\tThe dog.\n"),
        ("b", "Die Katze.\tThe cat.\nDer Mann.\tThe man.\n"),
    ):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "test.tsv"
        path.write_text(pairs, encoding="utf-8")
        written[folder] = Path(
            eval_json(capsys, "--run", str(run), "--pairs-file", str(path))["translations"]
        )
    assert written["a"] != written["b"] and written["a"].name.startswith("translations_pairs_test-")
    assert len(written["a"].read_text().splitlines()) == 1 and len(written["b"].read_text().splitlines()) == 2
    again = eval_json(
        capsys, "--run", str(run), "--pairs-file", str(tmp_path / "a" / ".." / "a" / "test.tsv")
    )
    assert Path(again["translations"]) == written["a"]  # the same file by another spelling: the same name


def test_a_long_file_name_gives_output_names_the_file_system_takes(run: Path, tmp_path: Path, capsys) -> None:
    """The file's name is cut to 96 bytes in its outputs' names (with the digest and the prefix, a name of
    over 224 bytes had passed the file system's 255 and the translations were lost after the search); a
    side of invisible characters only is empty."""
    path = tmp_path / ("ü" * 120 + ".tsv")  # 240 bytes
    path.write_text("Der Hund.\tThe dog.\n", encoding="utf-8")
    result = eval_json(capsys, "--run", str(run), "--pairs-file", str(path))
    written = Path(result["translations"])
    assert (
        written.exists()
        and len(written.name.encode()) <= 255
        and written.name.startswith("translations_pairs_üü")
    )
    path.write_text("Der Hund.\tThe dog.\n\u200b\tThe cat.\n", encoding="utf-8")
    assert main(["eval", "--run", str(run), "--pairs-file", str(path)]) == 2
    assert "line 2: expected one source<TAB>reference pair, found an empty side" in capsys.readouterr().err


def test_evaluate_pairs_names_bad_arguments(run: Path) -> None:
    with pytest.raises(TypeError, match="pairs must be a list of .source, reference. pairs, got str"):
        evaluate_pairs(run, "Der Hund.\tThe dog.")
    with pytest.raises(ValueError, match="no pairs to score"):
        evaluate_pairs(run, [])
    with pytest.raises(TypeError, match=r"pairs\[1\] must be a .source, reference. pair of two str"):
        evaluate_pairs(run, [("a", "b"), ("a", "b", "c")])
    with pytest.raises(ValueError, match=r"pairs\[0\] has an empty reference"):
        evaluate_pairs(run, [("Der Hund.", "  ")])
    with pytest.raises(ValueError, match="name must be a non-empty str usable in a file name .or None."):
        evaluate_pairs(run, [("Der Hund.", "The dog.")], name="../x")
    with pytest.raises(ValueError, match="max_batches must be an integer >= 1"):
        evaluate_pairs(run, [("Der Hund.", "The dog.")], max_batches=0)
