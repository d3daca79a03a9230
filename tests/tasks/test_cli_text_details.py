"""Details of `tformer translate` and `tformer classify` (cli/translate.py, cli/classify.py) the end-to-end
tests leave open: --text with --file, `--file -`, the prompt on a terminal, the warnings' words, the
--max-len boundary, output flushed line by line, --nbest's lines and refusals, and --batch-size reaching
the classifier."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from tformer.cli.main import main
from tformer.cli.translate import AlignedOutput, read_texts
from tformer.runs import load_run
from tformer.tasks.classification import Classifier
from tformer.tasks.translation import load_translator


@pytest.fixture(scope="module")
def translation_run(dictionary_file: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mt") / "run"
    argv = ["train", "--preset", "tiny-translation", "--set", f"data.path={dictionary_file}"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def classification_run(bbc_root: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cls") / "run"
    argv = ["train", "--preset", "tiny-classification", "--set", f"data.path={bbc_root}", "--set", "steps=2"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    return out


def without_cut_note(err: str) -> str:
    """stderr without the note on outputs cut at the length limit (a tiny model's outputs seldom end; the
    note's own test is `test_outputs_cut_at_the_length_limit_are_named_by_line`)."""
    return "".join(line for line in err.splitlines(keepends=True) if "reached the length limit" not in line)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class FlushLog(io.StringIO):
    """stdout that records how much had been written at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[int] = []

    def flush(self) -> None:
        self.flushed.append(len(self.getvalue()))


def test_text_and_file_together_are_refused(translation_run: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "in.txt"
    path.write_text("Der Hund.\n", encoding="utf-8")
    for command in ("translate", "classify"):
        assert main([command, "--run", str(translation_run), "--text", "Hund", "--file", str(path)]) == 2
        err = capsys.readouterr().err
        assert (
            err == f"tformer {command}: error: give --text or --file, not both (or neither, to read stdin)\n"
        )


def test_the_text_is_stripped() -> None:
    args = argparse.Namespace(text="  Der Hund. \t", file=None)
    given = read_texts(args, "translate")
    assert (given.texts, given.numbers, given.n_lines, given.where) == (["Der Hund."], [1], 1, "--text")


def test_file_dash_reads_stdin_and_a_terminal_is_told_what_is_awaited(
    translation_run: Path, capsys, monkeypatch
) -> None:
    run = str(translation_run)
    monkeypatch.setattr("sys.stdin", io.StringIO("Der Hund.\n\nDie Katze.\n"))
    assert main(["translate", "--run", run, "--file", "-", "--greedy"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split("\n")) == 4 and captured.out.split("\n")[1] == ""
    assert (
        without_cut_note(captured.err) == "tformer translate: warning: stdin line 2 is empty: skipped\n"
    )  # a pipe: no prompt
    for file in ([], ["--file", "-"]):  # neither --text nor --file, or --file -: both read stdin
        monkeypatch.setattr("sys.stdin", Terminal("Der Hund.\n"))
        assert main(["translate", "--run", run, "--greedy", *file]) == 0
        captured = capsys.readouterr()
        assert (
            without_cut_note(captured.err)
            == "tformer translate: reading stdin, one text per line (end with Ctrl-D)\n"
        )
        assert len(captured.out.splitlines()) == 1


def test_truncation_warnings_name_the_text_or_the_one_line(
    translation_run: Path, capsys, monkeypatch
) -> None:
    run = str(translation_run)
    assert main(["translate", "--run", run, "--greedy", "--max-len", "3", "--text", "Hund " * 60]) == 0
    assert (
        without_cut_note(capsys.readouterr().err)
        == "tformer translate: warning: the text is longer than 31 tokens (the model reads 32, the EOS among them): truncated\n"
    )
    monkeypatch.setattr("sys.stdin", io.StringIO("Der Hund.\n" + "Hund " * 60 + "\n"))
    assert main(["translate", "--run", run, "--greedy", "--max-len", "3"]) == 0
    assert without_cut_note(capsys.readouterr().err) == (
        "tformer translate: warning: stdin: line 2 is longer than 31 tokens (the model reads 32, the EOS among them): truncated\n"
    )
    assert main(["translate", "--run", run, "--greedy", "--max-len", "3", "--text", "Der Hund."]) == 0
    assert without_cut_note(capsys.readouterr().err) == ""  # no source cut: nothing said of sources


def test_max_len_warns_only_above_the_context(translation_run: Path, capsys) -> None:

    context = load_translator(load_run(translation_run)).model.cfg.max_seq_len
    argv = ["translate", "--run", str(translation_run), "--greedy", "--text", "Der Hund.", "--max-len"]
    assert main([*argv, str(context)]) == 0
    assert without_cut_note(capsys.readouterr().err) == ""
    assert main([*argv, str(context + 1)]) == 0
    assert f"--max-len {context + 1} is above the model's context" in capsys.readouterr().err


def test_outputs_cut_at_the_length_limit_are_named_by_line(
    translation_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """An output that stopped at the length limit before an end token (Hypothesis.finished False) is cut:
    one warning after the outputs names its input lines and the limit; outputs that ended say nothing."""
    from tformer.generate.beam import Hypothesis
    from tformer.tasks.translation import Translator

    def search(self, sources, cfg, generator=None):  # outputs of sources of 12 tokens or more are cut
        return [Hypothesis([5], -1.0, -1.0, finished=len(s) < 12) for s in sources]

    def nbest(self, sources, cfg, n_best):  # each list's second is cut
        return [
            [Hypothesis([5], -1.0, -1.0, len(s) < 12), Hypothesis([6], -2.0, -2.0, False)] for s in sources
        ]

    monkeypatch.setattr(Translator, "hypotheses", search)
    monkeypatch.setattr(Translator, "nbest", nbest)
    translator = load_translator(load_run(translation_run))
    context = translator.model.cfg.max_seq_len
    short, long = "Hund.", "Der alte Hund sieht die Katze."
    assert [len(translator.encode([text])[0][0]) >= 12 for text in (short, long)] == [False, True]  # premise
    default = f"1.5 x the source's tokens + 10, at most the model's context of {context} (--max-len sets one)"
    path = tmp_path / "in.txt"
    cases = [  # (input lines, options, the warning without its "tformer translate: warning: ")
        (
            [short, long, "", short, long],
            [],
            f"{path}: the outputs of 2 lines reached the length limit, {default}, before an end token: cut "
            "(lines 2, 5)",
        ),
        (
            [short, long],
            [],
            f"{path}: the output of line 2 reached the length limit, {default}, before an end token: cut",
        ),
        (  # each list's second is cut
            [short, long],
            ["--nbest", "2"],
            f"{path}: 3 outputs in the 2-best lists of 2 lines reached the length limit, {default}, before an end "
            "token: cut (lines 1, 2)",
        ),
        (
            [short],
            ["--nbest", "2"],
            f"{path}: 1 output in the 2-best list of line 1 reached the length limit, {default}, before an end "
            "token: cut",
        ),
        (
            [long],
            ["--greedy", "--max-len", "9"],
            f"{path}: the output of line 1 reached the length limit, --max-len 9, before an end token: cut",
        ),
        (
            [long],
            ["--greedy", "--max-len", str(context + 1)],
            f"{path}: the output of line 1 reached the length limit, the model's context of {context} tokens, "
            "before an end token: cut",
        ),
    ]
    for lines, options, message in cases:
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        assert main(["translate", "--run", str(translation_run), "--file", str(path), *options]) == 0
        assert capsys.readouterr().err.splitlines()[-1] == f"tformer translate: warning: {message}"
    argv = ["translate", "--run", str(translation_run), "--text"]
    for text, options, which in [(long, [], "the output"), (short, ["--nbest", "2"], "1 of the 2 outputs")]:
        n = len(translator.encode([text])[0][0])  # the limit: 1.5 x the source's tokens + 10, its number
        assert main([*argv, text, *options]) == 0
        assert capsys.readouterr().err == (
            f"tformer translate: warning: {which} reached the length limit, {int(1.5 * n) + 10} tokens (from the "
            f"source's {n}; --max-len sets one), before an end token: cut\n"
        )
    assert main([*argv, short]) == 0
    assert capsys.readouterr().err == ""  # it ended: nothing said


def test_nbest_prints_numbered_lines_best_first_the_first_the_one_best(
    translation_run: Path, tmp_path: Path, capsys
) -> None:
    path = tmp_path / "in.txt"
    path.write_text("Der alte Hund sieht die Katze.\n\nDer Hund.\n", encoding="utf-8")
    argv = ["translate", "--run", str(translation_run), "--file", str(path), "--beam", "5"]
    assert main([*argv, "--nbest", "3"]) == 0
    captured = capsys.readouterr()
    rows = [line.split("\t") for line in captured.out.splitlines()]
    assert [row[0] for row in rows] == ["1", "1", "1", "3", "3", "3"]  # none for the skipped line 2
    assert "line 2 is empty: skipped" in captured.err
    for group in (rows[:3], rows[3:]):
        scores = [float(row[2]) for row in group]
        assert scores == sorted(scores, reverse=True)
    assert main([*argv, "--scores"]) == 0
    one_best = capsys.readouterr().out.splitlines()
    assert one_best[0] == "\t".join(rows[0][1:]) and one_best[2] == "\t".join(rows[3][1:])
    assert main([*argv, "--nbest", "2", "--scores"]) == 0  # --scores adds nothing to the n-best lines
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["\t".join(row) for row in rows[:2] + rows[3:5]]
    assert "--scores is implied by --nbest" in captured.err
    assert main([*argv, "--nbest", "5"]) == 0  # as many as the beam keeps
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == ["1"] * 5 + ["3"] * 5


def test_nbest_numbers_the_lines_of_every_chunk_and_flushes_each_input_line(
    translation_run: Path, tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "in.txt"
    path.write_text("Der Hund.\nDie Katze.\n\nDas Kind.\nDer Mann.\n", encoding="utf-8")
    monkeypatch.setattr("tformer.cli.translate.CHUNK_LINES", 2)  # chunks: lines 1-2, 4-5
    log = FlushLog()
    monkeypatch.setattr("sys.stdout", log)
    argv = ["translate", "--run", str(translation_run), "--file", str(path), "--beam", "3", "--nbest", "2"]
    assert main(argv) == 0
    lines = log.getvalue().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["1", "1", "2", "2", "4", "4", "5", "5"]
    ends = [len("".join(line + "\n" for line in lines[: 2 * k])) for k in range(1, 5)]
    assert set(ends) <= set(log.flushed)  # each input line's two were flushed as soon as printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nbest", "2", "--greedy"], "--nbest applies to beam search only, not with --greedy"),
        (["--nbest", "2", "--sample"], "--nbest applies to beam search only, not with --sample"),
        (
            ["--nbest", "5"],
            "--nbest 5 is above --beam 4 (the default): a beam keeps at most that many (give --beam 5 or more)",
        ),
        (
            ["--nbest", "3", "--beam", "2"],
            "--nbest 3 is above --beam 2: a beam keeps at most that many (give --beam 3 or more)",
        ),
    ],
)
def test_nbest_outside_what_the_beam_keeps_is_refused(
    translation_run: Path, capsys, extra: list[str], message: str
) -> None:
    assert main(["translate", "--run", str(translation_run), "--text", "Der Hund.", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"tformer translate: error: {message}\n" and captured.out == ""


def test_nbest_must_be_a_positive_count(translation_run: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["translate", "--run", str(translation_run), "--text", "Der Hund.", "--nbest", "0"])
    assert exit_info.value.code == 2 and "--nbest" in capsys.readouterr().err


def test_aligned_output_flushes_each_line(monkeypatch) -> None:
    """Each output is flushed as it is printed (an interrupted run keeps what it printed)."""
    log = FlushLog()
    monkeypatch.setattr("sys.stdout", log)
    out = AlignedOutput(4)
    out.print("a", 1)
    assert log.getvalue() == "a\n" and log.flushed[-1] == 2
    out.print("b", 3)
    assert log.getvalue() == "a\n\nb\n" and log.flushed[-1] == 5
    out.close()
    assert log.getvalue() == "a\n\nb\n\n" and log.flushed[-1] == 6


def test_classify_json_lines_are_flushed_and_warnings_named_by_classify(
    classification_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    path = tmp_path / "texts.txt"
    path.write_text("software computer\n\nminister election\n", encoding="utf-8")
    log = FlushLog()
    monkeypatch.setattr("sys.stdout", log)
    assert main(["classify", "--run", str(classification_run), "--file", str(path), "--json"]) == 0
    lines = log.getvalue().splitlines(keepends=True)
    assert [json.loads(line)["line"] for line in lines] == [1, 3]
    assert len(lines[0]) in log.flushed  # the first line was flushed before the second was written
    assert capsys.readouterr().err == f"tformer classify: warning: {path} line 2 is empty: skipped\n"


def test_a_text_of_invisible_characters_only_is_empty(
    classification_run: Path, tmp_path: Path, capsys
) -> None:
    """A zero-width space or a byte-order mark alone is no text: an error for --text, a skipped line in a
    file, an error in Python, as spaces are (they had been classified)."""
    from tformer.runs import load_run
    from tformer.tasks.classification import load_classifier

    for text in ("\u200b", "\ufeff", " \u200b\u2060 "):
        assert main(["classify", "--run", str(classification_run), "--text", text]) == 2
        assert "error: the text is empty" in capsys.readouterr().err
        with pytest.raises(ValueError, match="text 0 is empty"):
            load_classifier(load_run(classification_run)).classify([text])
    path = tmp_path / "texts.txt"
    path.write_text("software computer\n\u200b\nminister \u200belection\n", encoding="utf-8")
    assert main(["classify", "--run", str(classification_run), "--file", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["line"] for line in captured.out.splitlines()] == [1, 3]  # line 3 keeps its ZWSP
    assert captured.err == f"tformer classify: warning: {path} line 2 is empty: skipped\n"


def test_classify_batch_size_reaches_the_classifier(classification_run: Path, monkeypatch, capsys) -> None:

    sizes: list[int] = []
    real = Classifier.probabilities

    def spy(self, ids, batch_size=32):
        sizes.append(batch_size)
        return real(self, ids, batch_size=batch_size)

    monkeypatch.setattr(Classifier, "probabilities", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("software\nminister\nmatch\n"))
    assert main(["classify", "--run", str(classification_run), "--batch-size", "2"]) == 0
    assert sizes == [2] and len(capsys.readouterr().out.splitlines()) == 3


def test_labels_of_a_run_trained_before_names_were_checked_print_on_one_line(
    classification_run: Path, monkeypatch, capsys
) -> None:
    """Label names with a line break or an escape character (refused since, but a run trained before keeps
    them) had broken classify's one line per text and eval's per-class rows: escaped in text output, kept
    as they are in JSON."""
    import tformer.tasks.classification as TC

    real = TC.load_classifier

    def old_run(*args, **kwargs):
        classifier = real(*args, **kwargs)
        classifier.labels = ("bad\nname", "esc\x1b[31m", *classifier.labels[2:])
        return classifier

    monkeypatch.setattr(TC, "load_classifier", old_run)
    monkeypatch.setattr("sys.stdin", io.StringIO("software\nminister\n"))
    assert main(["classify", "--run", str(classification_run)]) == 0
    out = capsys.readouterr().out
    assert (
        len(out.splitlines()) == 2 and "bad\\nname=" in out and "esc\\x1b[31m=" in out and "\x1b" not in out
    )
    monkeypatch.setattr("sys.stdin", io.StringIO("software\n"))
    assert main(["classify", "--run", str(classification_run), "--json"]) == 0
    assert "bad\nname" in json.loads(capsys.readouterr().out)["probabilities"]
    per_class = {"bad\nname": {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 3}}
    result = {"data": "x", "checkpoint_step": 1, "n": 3, "accuracy": 1.0, "macro_f1": 1.0, "eval_loss": 0.1,
              "texts_truncated": 0, "per_class": per_class, "confusion_png": None}  # fmt: skip
    assert len(TC.format_result(result).splitlines()) == 2 and "  bad\\nname " in TC.format_result(result)
