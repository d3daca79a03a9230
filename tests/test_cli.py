"""Every CLI command end to end on tiny data, and user errors as one clear line with exit code 2."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_run import WORDS
from tformer.cli.main import main


def test_train_writes_the_run_directory(trained_run: Path) -> None:
    for name in ("config.json", "tokenizer.json", "metrics.jsonl", "loss.png", "report.json"):
        assert (trained_run / name).exists(), name
    assert json.loads((trained_run / "config.json").read_text())["steps"] == 4
    assert sorted(p.name for p in (trained_run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert (trained_run / "tensorboard").is_dir()


def test_no_progress_prints_plain_lines(trained_run: Path, capsys, tmp_path: Path) -> None:
    """--no-progress replaces the bar with lines a log file can hold: each logged step (loss, lr,
    tokens/s, ETA) and each evaluation, and no carriage returns."""
    sets = [f"data.corpus=text:{trained_run.parent / 'corpus'}", "data.vocab_size=300", "data.seq_len=32",
            "steps=4", "log_every=2", "eval_every=4", "save_every=4"]  # fmt: skip
    argv = ["train", "--preset", "tiny-lm", "--out", str(tmp_path / "r"), "--no-progress", "--no-sample"]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^step 2/4: loss \d+\.\d+, lr \S+, [\d,]+ tok/s, ETA \d+s$", out, re.M), out
    assert re.search(r"^step 4/4: loss ", out, re.M) and re.search(r"^step 4: eval_loss ", out, re.M), out
    assert "\r" not in out


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(
    trained_run: Path, capsys, tmp_path: Path, monkeypatch
) -> None:
    """Without --no-progress: a bar where stderr is a terminal, the plain lines where it is a file (a bar's
    carriage-return redraws had filled log files)."""
    sets = [f"data.corpus=text:{trained_run.parent / 'corpus'}", "data.vocab_size=300", "data.seq_len=32",
            "steps=4", "log_every=2", "eval_every=4", "save_every=4"]  # fmt: skip
    argv = ["train", "--preset", "tiny-lm", "--no-sample"] + [a for s in sets for a in ("--set", s)]
    assert main([*argv, "--out", str(tmp_path / "log")]) == 0  # stderr under pytest: not a terminal
    captured = capsys.readouterr()
    assert re.search(r"^step 2/4: loss ", captured.out, re.M) and "\r" not in captured.err
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main([*argv, "--out", str(tmp_path / "tty")]) == 0
    captured = capsys.readouterr()
    assert not re.search(r"^step 2/4: loss ", captured.out, re.M) and "\r" in captured.err  # the bar


def test_generate_and_eval(trained_run: Path, capsys, tmp_path: Path, monkeypatch) -> None:
    assert main(["generate", "--run", str(trained_run), "--prompt", "to be", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("to be")
    greedy = [
        "generate",
        "--run",
        str(trained_run),
        "--prompt",
        "to be",
        "--max-new-tokens",
        "30",
        "--greedy",
    ]
    assert main(greedy) == 0
    new = capsys.readouterr().out[len("to be") : -1]
    stop = new[len(new) // 2 : len(new) // 2 + 2]  # two characters from the middle of the continuation
    for stream in ([], ["--no-stream"]):  # streamed or printed at the end, the output ends before it
        assert main([*greedy, "--stop", stop, *stream]) == 0
        assert capsys.readouterr().out == "to be" + new[: new.find(stop)] + "\n", (stop, stream)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("to be\n\nthe question\n")

    def from_prompts(path: str) -> int:
        argv = [
            "generate",
            "--run",
            str(trained_run),
            "--prompts-file",
            path,
            "--greedy",
            "--max-new-tokens",
            "4",
        ]
        return main(argv)

    assert from_prompts(str(prompts)) == 0
    out, err = capsys.readouterr()
    blocks = out.split("--- prompt ")[1:]  # each output under its prompt's number
    assert len(blocks) == 2 and blocks[0].startswith("1 of 2 ---\nto be")
    assert blocks[1].startswith("2 of 2 ---\nthe question")
    assert "prompts.txt: line 2 is empty: skipped" in err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(prompts.read_bytes())))  # - is stdin
    assert from_prompts("-") == 0
    piped, err = capsys.readouterr()
    assert piped == out and "stdin: line 2 is empty: skipped" in err
    assert main(["eval", "--run", str(trained_run), "--split", "val", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["checkpoint_step"] == 4 and result["bits_per_char"] > 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--preset", "nope"], "unknown training preset 'nope'; available: shakespeare"),
        (
            ["train", "--preset", "tiny-lm", "--set", "model.dmodel=3"],
            "unknown key 'dmodel' in TrainConfig.model",
        ),
        (["train", "--preset", "tiny-lm", "--set", "data.corpus=wiki"], "unknown corpus 'wiki'; available:"),
        (["train", "--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
        (["generate", "--run", "/nonexistent", "--prompt", "x"], "/nonexistent does not exist"),
        (["train", "--config", "bad.yaml"], "bad.yaml: not a readable TrainConfig file (while parsing"),
        (["train", "--config", "bad.json"], "bad.json: not a readable TrainConfig file (Expecting"),
        (["train", "--config", "empty.yaml"], "empty.yaml: holds no TrainConfig fields"),
        (["train", "--config", "adir"], "config file adir does not exist or is not a file"),
        (["train", "--preset", "tiny-lm", "--set", "model.d_model=[1,"], "the value is not valid YAML"),
        (
            ["train", "--preset", "tiny-lm", "--set", "model.moe.foo=1"],
            "unknown key 'foo' in TrainConfig.model.moe",
        ),
        (
            ["train", "--preset", "tiny-lm", "--set", "optim.lr=.inf"],
            "TrainConfig.optim.lr must be a finite number",
        ),
        (
            ["train", "--preset", "tiny-lm", "--set", "optim.eps=-1"],
            "TrainConfig.optim.eps must be finite and > 0",
        ),
        (["train", "--preset", "tiny-lm", "--out", "afile"], "the run directory afile is a file"),
        (["generate", "--run", "afile", "--prompt", "x"], "afile is a file; give the run directory"),
        (
            ["translate", "--run", "afile", "--text", "a", "--temperature", "0.5", "--seed", "3"],
            "--temperature, --seed apply to sampling only: add --sample",
        ),
        (
            ["translate", "--run", "afile", "--text", "a", "--greedy", "--beam", "2"],
            "--beam applies to beam search",
        ),
        (["translate", "--run", "afile", "--text", "a", "--beam", "0"], "error: --beam must be >= 1, got 0"),
        (
            ["translate", "--run", "afile", "--text", "a", "--sample", "--length-penalty", "1"],
            "--length-penalty applies to beam search only, not with --sample",
        ),
        (["generate", "--run", "afile", "--prompt", "a", "--top-p", "2"], "error: --top-p must be in (0, 1]"),
        (
            ["generate", "--run", "afile", "--prompt", "a", "--max-new-tokens", "0"],
            "error: --max-new-tokens must",
        ),
        (
            ["train", "--preset", "tiny-lm", "--set", "model.arch=encoder"],
            "language modelling needs model.arch",
        ),
        (
            ["train", "--preset", "tiny-lm", "--set", "data.corpus=bbc-news"],
            "is a classification corpus, not a language-modelling one",
        ),
        (
            ["train", "--preset", "tiny-lm", "--set", "data.path=/x"],
            "data.path is not supported for corpus 'pydoc'",
        ),
        (
            [
                "train",
                "--preset",
                "tiny-lm",
                "--set",
                "data.corpus=shakespeare",
                "--set",
                "data.path=/nonexistent",
            ],
            "/nonexistent",
        ),
        (["eval", "--run", "x", "--max-batches", "-1"], "argument --max-batches: expected an integer >= 1"),
        (["classify", "--run", "x", "--batch-size", "0"], "argument --batch-size: expected an integer >= 1"),
        (["bench", "--threads", "-1"], "argument --threads: expected an integer >= 0"),
        (["generate", "--run", "x", "--temp", "0.5"], "unrecognized arguments: --temp 0.5; allowed options:"),
        (
            ["generate", "--run", "afile", "--prompt", "a", "--stop", ""],
            "--stop must be a list of non-empty strings, got ['']",
        ),
        (
            ["train", "--preset", "tiny-lm", "--set", "data.corpus=text:nothere.txt"],
            "nothere.txt' does not exist",
        ),
        (
            ["train", "--config", "run.txt"],
            "run.txt: not a readable TrainConfig file (read as JSON: name a YAML file .yaml or .yml)",
        ),
        (["train", "--preset", "tiny-lm", "--out", "afile/run"], "afile/run: Not a directory"),
        (
            ["bench", "--preset", "nope"],
            "unknown training preset 'nope'; tformer bench measures decoder LMs: shakespeare, "
            "shakespeare-dense, tiny-lm (or --config FILE.yaml)",
        ),
        (
            ["bench", "--preset", "tiny-translation"],
            "tformer bench measures decoder LMs (shakespeare, shakespeare-dense, tiny-lm); this config's",
        ),
        (["experiment", "norm", "--depths", "a,b"], "argument --depths: expected comma-separated integers"),
        (["experiment", "norm", "--depths", "2,2"], "argument --depths: a depth appears twice in '2,2'"),
        (
            ["experiment", "norm", "--quick", "--warmup-steps", "0", "--out", "fresh"],
            "--warmup-steps must be >= 1: the norm study compares arms with and without",
        ),
        (
            ["experiment", "norm", "--report-only", "--steps", "5", "--out", "adir"],
            "--report-only rebuilds the report from the run's logs; --steps would change nothing",
        ),
        (
            ["experiment", "norm", "--report-only", "--overwrite", "--out", "adir"],
            "--report-only rebuilds the report from the run's logs; --overwrite would change nothing",
        ),
        (["train", "--lr", "3"], "allowed options: --config, --help"),
        (
            ["train", "--preset", "tiny-lm", "--set", "=5"],
            "--set expects KEY=VALUE (for example model.d_model",
        ),
        # an empty path had read as the working directory, an empty preset as the default one
        (["eval", "--run", ""], "argument --run: is empty: give a path"),
        (["translate", "--run", "adir", "--file", " "], "argument --file: is empty: give a path"),
        (["train", "--config", ""], "argument --config: is empty: give a path"),
        (["train", "--preset", "", "--out", "fresh"], "unknown training preset ''; available: shakespeare"),
        (
            ["bench", "--preset", ""],
            "unknown training preset ''; tformer bench measures decoder LMs: shakespeare",
        ),
        # OpenMP had crashed (segfault) at some 100,000 threads
        (["bench", "--threads", "100000"], "argument --threads: expected at most 1,024 threads, got 100,000"),
        (["experiment", "norm", "--threads", "0"], "argument --threads: expected an integer >= 1, got 0"),
    ],
)
def test_user_errors_are_one_line(argv: list[str], needle: str, capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("steps: [1, 2\nmodel: {\n")
    (tmp_path / "bad.json").write_text('{"steps": 3,')
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "run.txt").write_text("steps: 3\n")  # YAML in a file not named .yaml
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()  # no run directory left behind


def test_a_closed_stdin_is_named(monkeypatch) -> None:
    """Started with stdin closed (`<&-`), Python's sys.stdin is None: reading it had raised AttributeError."""
    from tformer.cli.options import read_stdin
    from tformer.cli.translate import read_texts

    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(ValueError, match="stdin is closed: give the input as a file or pipe it in"):
        read_stdin()
    with pytest.raises(ValueError, match="stdin is closed"):
        read_texts(argparse.Namespace(text=None, file=None), "translate")


def test_out_of_memory_is_one_line(capsys, monkeypatch) -> None:
    """An allocation the machine cannot hold (a huge --beam had asked for 25.6 GB) ends in one line."""
    import tformer.cli.train as train_cli

    def allocate(args):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 25600000000 bytes"
        )

    monkeypatch.setattr(train_cli, "run", allocate)
    assert main(["train", "--preset", "tiny-lm"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tformer train: error: out of memory ([enforce fail") and err.count("\n") == 1, err
    assert "use smaller sizes" in err


def test_under_torchrun_other_ranks_repeat_no_config_error_and_name_their_own(capsys, monkeypatch) -> None:
    """Every rank meets the same config error: rank 0 says it once. An error that may be one rank's own
    (a file) is said with the rank."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "--preset", "tiny-lm", "--set", "model.d_model=-1"]) == 2
    assert capsys.readouterr().err == ""
    assert main(["generate", "--run", "/nonexistent/run", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("tformer generate: error (rank 1): ")


@pytest.mark.parametrize("world_size", [None, "1"])
@pytest.mark.parametrize("rank", ["3", "abc"])
def test_a_rank_set_outside_torchrun_still_says_its_errors(capsys, monkeypatch, rank, world_size) -> None:
    """RANK left by a scheduler (no WORLD_SIZE above 1) or not a number is not torchrun's: the error is
    said, without a rank (it had been kept silent as another rank's, or raised a ValueError traceback)."""
    monkeypatch.setenv("RANK", rank)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    assert main(["train", "--preset", "tiny-lm", "--set", "model.d_model=-1"]) == 2
    assert capsys.readouterr().err.startswith("tformer train: error: TrainConfig.model.d_model must be >= 1")


def test_unknown_option_lists_the_allowed_ones(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--preset", "tiny-lm", "--lr", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --lr 3; allowed options: --config, --help" in capsys.readouterr().err


def test_an_unknown_option_before_the_command_is_named_as_tformers(capsys) -> None:
    """`tformer --bogus` had said only that a command is required; `tformer --bogus train` had listed the
    train command's options for an option it never reached."""
    for argv in (["--bogus"], ["--bogus", "train", "--preset", "tiny-lm"], ["-x", "generate"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"tformer: error: unknown option {argv[0]} before the command; tformer takes --help"
        )
        assert "train, generate, translate, classify, eval" in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        main([])
    assert "required: command (one of train, generate, translate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("tformer ")


def test_input_that_is_not_utf8_text_is_one_line(
    trained_run: Path, capsys, tmp_path: Path, monkeypatch
) -> None:
    """Bytes that are not UTF-8 on the command line (Python keeps them as surrogate escapes) or a binary
    file: named, not a tokenizers library error or a score of binary data."""
    binary = tmp_path / "ls.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x00\x00" * 10)
    bad_arg = b"caf\xe9".decode("utf-8", "surrogateescape")
    for argv, needle in (
        (["generate", "--run", str(trained_run), "--prompt", bad_arg], "--prompt is not valid UTF-8 text"),
        (["eval", "--run", str(trained_run), "--text-file", str(binary)], "ls.bin is not a text file"),
        (["generate", "--run", str(trained_run), "--prompts-file", str(binary)], "ls.bin is not a text file"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


def test_a_run_directory_in_use_by_another_process_is_refused(
    trained_run: Path, capsys, tmp_path: Path
) -> None:
    """A second launch into a running run's --out had truncated its metrics and retrained its tokenizer:
    a run before its first checkpoint (a fresh launch there) and one with checkpoints (--resume)."""
    import subprocess
    import sys

    early, later = tmp_path / "early", tmp_path / "later"
    shutil.copytree(trained_run, later)
    shutil.copytree(trained_run, early, ignore=shutil.ignore_patterns("checkpoints"))

    def files(d: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name != ".lock"}

    before = {d: files(d) for d in (early, later)}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from tformer.train.run_dir import "
         f"lock_run_dir; h = [lock_run_dir(Path(d), sys) for d in {[str(early), str(later)]!r}]; print('held', "
         "flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        # (later without --resume: its checkpoints had been named first, and the --resume they asked for
        # then refused as in use)
        for run, extra in ((early, []), (later, ["--resume"]), (later, [])):
            argv = ["train", "--out", str(run), "--no-progress", "--config", str(run / "config.json")]
            assert main([*argv, *extra] if not extra else argv[:4] + extra) == 2
            err = capsys.readouterr().err
            assert f"is in use by pid {holder.pid}; wait for it or choose another --out" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert {d: files(d) for d in (early, later)} == before


def test_a_run_on_a_text_folder_notices_that_its_splits_changed(
    trained_run: Path, capsys, tmp_path: Path
) -> None:
    """The LM task records its splits (data.json); files added to the folder since move documents between
    splits, so a resume would go on with other data: refused, naming the split."""
    config = json.loads((trained_run / "config.json").read_text())
    manifest = json.loads((trained_run / "data.json").read_text())
    assert set(manifest["ids_sha256"]) == {"train", "val", "test"}
    corpus = tmp_path / "corpus"
    shutil.copytree(config["data"]["corpus"].removeprefix("text:"), corpus)
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    config["data"]["corpus"] = f"text:{corpus}"
    (run / "config.json").write_text(json.dumps(config))
    argv = ["train", "--out", str(run), "--resume", "--no-progress", "--no-sample", "--set"]
    assert main([*argv, "steps=5"]) == 0  # the folder moved: fine; step 5 records the new place
    for i in range(12):
        (corpus / f"new{i}.txt").write_text(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(300)))
    capsys.readouterr()
    assert main([*argv, "steps=6"]) == 2
    err = capsys.readouterr().err
    assert "split(s) of" in err and "differ from those this run recorded" in err, err
    with pytest.warns(UserWarning, match="the train split differs from the one this run recorded"):
        assert main(["eval", "--run", str(run), "--split", "train", "--max-batches", "1", "--json"]) == 0


def test_version(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"tformer {version('tformer')}\n"


def test_eval_on_a_text_file(trained_run: Path, capsys, tmp_path: Path, monkeypatch) -> None:
    """Perplexity of a user's text in the run's windows; a text shorter than one window is scored as one
    shorter window, with a warning that says so."""
    long_text = tmp_path / "long.txt"
    long_text.write_text(" ".join(WORDS[j % len(WORDS)] for j in range(400)))
    assert main(["eval", "--run", str(trained_run), "--text-file", str(long_text), "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["data"] == str(long_text) and 0 < result["bits_per_char"] < 20 and err == ""
    assert result["windows_scored"] == result["windows"] > 1 and result["predictions"] > 0
    from tformer.runs import load_run

    text = long_text.read_text()  # every token of the text and its EOS over every character and the EOS
    per_char = (len(load_run(trained_run).tokenizer.encode(text)) + 1) / (len(text) + 1)
    assert result["bits_per_char"] == pytest.approx(result["eval_loss"] * per_char / math.log(2), rel=1e-9)
    # a sample (--max-batches) says so: it had printed the same line as the whole text's
    assert main(["eval", "--run", str(trained_run), "--text-file", str(long_text), "--max-batches", "1"]) == 0
    out = capsys.readouterr().out
    assert f"| 8 of its {result['windows']} windows (--max-batches)" in out and " predictions" in out
    short = tmp_path / "short.txt"
    short.write_text("to be")
    assert main(["eval", "--run", str(trained_run), "--text-file", str(short), "--json"]) == 0
    out, err = capsys.readouterr()
    assert math.isfinite(json.loads(out)["eval_loss"])
    assert "short.txt holds" in err and "data.seq_len + 1 = 33: scored as one window of" in err
    # "-" (and a pipe, /dev/stdin) is read like a file: the same score
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(long_text.read_bytes())))
    assert main(["eval", "--run", str(trained_run), "--text-file", "-", "--json"]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert piped["data"] == "stdin" and piped["eval_loss"] == result["eval_loss"]
    assert main(["eval", "--run", str(trained_run), "--text-file", str(tmp_path), "--json"]) == 2
    assert "is a directory, not a file" in capsys.readouterr().err
    assert main(["eval", "--run", str(trained_run), "--text-file", str(short), "--split", "val"]) == 2
    assert (
        "give one of --split, --text-file, --pairs-file and --labelled-file, not --split and --text-file"
        in capsys.readouterr().err
    )


def test_help_does_not_import_torch() -> None:
    """`tformer --help` and every command's --help answer without importing torch (~0.2 s, not ~4 s);
    the package's public names still resolve, importing torch where they need it."""
    code = """
import contextlib, io, sys
from tformer.cli.main import COMMANDS, main
for argv in [["--help"], *[[name, "--help"] for name in COMMANDS]]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
import tformer
tformer.ModelConfig, tformer.get_preset("tiny")
before = "torch" in sys.modules
tformer.build_model
from tformer.data import Tokenizer
from tformer.train import save_weights
print(before, "torch" in sys.modules, Tokenizer.__name__, save_weights.__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "Tokenizer", "save_weights"], out.stdout + out.stderr


def test_ctrl_c_while_a_command_loads_is_one_line(monkeypatch, capsys) -> None:
    """A Ctrl-C in the first second of a command, while torch is imported, had printed a traceback."""
    import importlib

    def interrupted(name: str, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    try:
        status = main(["eval", "--run", "nowhere"])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped main() as a traceback")
    assert status == 130
    assert capsys.readouterr().err == "tformer eval: interrupted\n"


def test_a_command_line_error_is_said_by_rank_0_only(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, said in (("1", ""), ("0", "tformer train: error: unrecognized arguments: --lr 3")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stop:
            main(["train", "--lr", "3"])
        assert stop.value.code == 2 and capsys.readouterr().err.startswith(said)
    monkeypatch.setenv("WORLD_SIZE", "1")  # RANK set outside torchrun (a scheduler's): said as usual
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit):
        main(["train", "--lr", "3"])
    assert "unrecognized arguments: --lr 3" in capsys.readouterr().err


def test_a_rank_whose_peer_failed_says_one_line(monkeypatch, capsys) -> None:
    """Under torchrun, a rank waiting in a collective when another rank raised had printed gloo's
    traceback below the real error."""
    import tformer.cli.evaluate as evaluate

    def peer_gone(args):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38577")

    monkeypatch.setattr(evaluate, "run", peer_gone)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):  # rank 0 had printed gloo's traceback when rank 1 failed
        monkeypatch.setenv("RANK", rank)
        assert main(["eval", "--run", "x"]) == 1
        assert capsys.readouterr().err == (
            f"tformer eval: rank {rank} stopped: another rank failed or exited (its error, if it raised one, "
            "is above)\n"
        )

    def timed_out(args):
        raise RuntimeError(
            "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation"
        )

    monkeypatch.setattr(evaluate, "run", timed_out)
    monkeypatch.setenv("RANK", "1")
    assert main(["eval", "--run", "x"]) == 1
    assert "rank 1 stopped: a collective timed out (parallel.timeout_s)" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")  # rank 0 keeps the traceback of a timeout: it may be a deadlock
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        main(["eval", "--run", "x"])
    monkeypatch.setattr(evaluate, "run", peer_gone)
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process, or another error: not hidden
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        main(["eval", "--run", "x"])


def test_demo_builds_every_architecture_and_reports_its_last_step(capsys) -> None:
    assert main(["demo", "--steps", "12"]) == 0
    out = capsys.readouterr().out
    for arch in ("decoder", "encoder", "encoder_decoder"):
        assert f"built {arch} " in out
    steps = [line.split()[:4] for line in out.splitlines() if line.startswith("step")]
    assert [s[1] for s in steps] == ["1", "10", "12"]  # the last step is reported, not only every 10th
    assert float(steps[-1][3]) < float(steps[0][3])  # it learns


def test_an_empty_out_and_a_stop_string_that_is_not_utf8_are_named(capsys) -> None:
    assert main(["train", "--preset", "tiny-lm", "--out", ""]) == 2
    assert "--out is empty: give a run directory" in capsys.readouterr().err
    assert main(["experiment", "rope", "--quick", "--out", " "]) == 2
    assert "--out is empty: give a directory" in capsys.readouterr().err
    from tformer.cli.generate import sampling_from_args
    from tformer.cli.main import _generate_args

    parser = argparse.ArgumentParser()
    _generate_args(parser)
    args = parser.parse_args(["--run", "r", "--prompt", "p", "--stop", "ab\udcff"])  # a byte not UTF-8
    with pytest.raises(ValueError, match="--stop is not valid UTF-8 text"):
        sampling_from_args(args)


def test_python_warnings_are_one_line_named_by_the_command(tmp_path: Path) -> None:
    """A Python warning raised inside a command prints as `tformer <cmd>: warning: <message>`, without
    the file, line and category Python's default format adds. In a separate process: pytest's own
    warning capture would record the warning instead of printing it."""
    argv = ["train", "--preset", "tiny-lm", "--out", str(tmp_path / "run")]
    argv += ["--set", "model.n_encoder_layers=2", "--set", "model.d_model=-1"]  # the warning, then an error
    code = f"import sys; from tformer.cli.main import main; sys.exit(main({argv!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "tformer train: warning: TrainConfig.model: n_encoder_layers=2 dropped: arch 'decoder' has no "
        "separate encoder (it uses n_layers and vocab_size)",
        "tformer train: error: TrainConfig.model.d_model must be >= 1, got -1",
    ]
