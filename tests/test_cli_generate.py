"""`tformer generate` end to end on a tiny trained run: sampling, prompts, truncation, errors, pipes."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend

from tformer.cli import generate as cli_generate
from tformer.cli.generate import newlines, read_prompts, sampling_from_args
from tformer.cli.main import _generate_args, main
from tformer.generate.engine import truncate_prompts
from tformer.model import compiled_step
from tformer.runs import load_run


def test_seeded_generation_is_deterministic(trained_run: Path, capsys) -> None:
    outs = []
    for _ in range(2):
        main(["generate", "--run", str(trained_run), "--prompt", "to", "--seed", "3", "--no-stream"])
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


def test_generate_refuses_other_tasks_and_prints_nothing_before_an_error(
    trained_run: Path, tmp_path: Path, capsys
) -> None:
    other = tmp_path / "cls"
    shutil.copytree(trained_run, other)
    step = sorted((other / "checkpoints").iterdir())[-1]
    meta = json.loads((step / "meta.json").read_text())
    meta["meta"]["train_config"]["task"] = "classification"
    data = json.dumps(meta).encode()
    (step / "meta.json").write_bytes(data)
    manifest = json.loads((step / "COMMITTED").read_text())  # a consistent checkpoint of another task
    manifest["files"]["meta.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "COMMITTED").write_text(json.dumps(manifest))
    assert main(["generate", "--run", str(other), "--prompt", "to"]) == 2
    captured = capsys.readouterr()
    assert "is a classification run, not a language-model run; use tformer classify" in captured.err
    assert main(["generate", "--run", str(trained_run), "--prompt", "to", "--max-new-tokens", "500"]) == 2
    assert capsys.readouterr().out == ""  # the prompt is not streamed before the error


def test_a_closed_pipe_at_exit_stops_quietly_too(trained_run: Path) -> None:
    """Output to a pipe is buffered and written when the command ends: a reader that has gone away (its
    end closed before anything is written) must not turn that into a Python error either."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    argv = ["generate", "--run", str(trained_run), "--prompt", "to", "--max-new-tokens", "2", "--no-stream"]
    code = f"import sys; from tformer.cli.main import main; sys.exit(main({argv!r}))"
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_a_closed_pipe_stops_quietly(trained_run: Path, capsys, monkeypatch) -> None:
    """`tformer generate ... | head -c 3`: the reader goes away; the command stops with 141 (128 + SIGPIPE)
    and no error message, as shell tools do."""

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["generate", "--run", str(trained_run), "--prompt", "to", "--max-new-tokens", "3"]) == 141
    assert capsys.readouterr().err == ""


def test_generate_errors(trained_run: Path, capsys) -> None:
    assert main(["generate", "--run", str(trained_run), "--prompt", "  "]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--run", str(trained_run)]) == 2  # no prompt option at all
    assert "no prompt: give --prompt TEXT or --prompts-file FILE" in capsys.readouterr().err
    long_prompt = " ".join(["to be"] * 100)
    assert main(["generate", "--run", str(trained_run), "--prompt", long_prompt]) == 2
    err = capsys.readouterr().err
    assert "leaves no room for new tokens in the model's context of 64 tokens" in err
    assert "(or pass --truncate-prompt to keep a prompt's last tokens)" in err
    assert "--max-new-tokens" not in err  # the default budget is not a number the user typed
    assert main(["generate", "--run", str(trained_run), "--prompt", "to", "--max-new-tokens", "500"]) == 2
    err = capsys.readouterr().err
    assert "+ --max-new-tokens 500 exceeds the model's context" in err and "lower --max-new-tokens to" in err
    # the advice counts the new tokens asked for (it had said 63 where 59 fit with 5 new tokens)
    assert (
        main(["generate", "--run", str(trained_run), "--prompt", long_prompt, "--max-new-tokens", "5"]) == 2
    )
    assert "give at most 59 tokens with --max-new-tokens 5" in capsys.readouterr().err
    # 63 tokens with this run's tokenizer (no BOS is added) + 5 new: over by 4 either way
    fits = " ".join(["to"] * 62)
    assert main(["generate", "--run", str(trained_run), "--prompt", fits, "--max-new-tokens", "5"]) == 2
    assert (
        "lower --max-new-tokens to at most 1, or shorten the prompt to at most 59 tokens"
        in capsys.readouterr().err
    )
    path = trained_run.parent / "prompts.txt"
    path.write_text("to be\n\n" + long_prompt + "\n")
    assert main(["generate", "--run", str(trained_run), "--prompts-file", str(path)]) == 2
    assert f"error: the prompt on line 3 of {path} (" in capsys.readouterr().err  # its line, empty ones too
    # without --max-new-tokens: 200 or what the context (64) leaves after the prompt
    assert main(["generate", "--run", str(trained_run), "--prompt", "to", "--greedy", "--no-stream"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("to") and len(out) > len("to\n")


def test_generate_can_truncate_a_long_prompt(trained_run: Path, capsys) -> None:
    long_prompt = " ".join(["to be"] * 100)
    argv = [
        "generate",
        "--run",
        str(trained_run),
        "--prompt",
        long_prompt,
        "--max-new-tokens",
        "8",
        "--greedy",
    ]
    assert main([*argv, "--truncate-prompt", "--no-stream"]) == 0
    out, err = capsys.readouterr()
    assert (
        "warning: the prompt is longer than the context allows (64 tokens with 8 new tokens): only its last 56"
        in err
    )
    assert out.startswith(long_prompt) and "Traceback" not in err
    # --min-new-tokens beyond half the context: the prompt is cut further (it had been refused)
    assert main([*argv[:-3], "--truncate-prompt", "--min-new-tokens", "50", "--greedy", "--no-stream"]) == 0
    assert "only its last 14 tokens are used" in capsys.readouterr().err
    # without --max-new-tokens: the cut prompt leaves half the context (32 of 64) for new tokens
    assert (
        main(
            ["generate", "--run", str(trained_run), "--prompt", long_prompt, "--truncate-prompt", "--greedy"]
        )
        == 0
    )
    assert "(64 tokens with 32 new tokens): only its last 32" in capsys.readouterr().err
    assert main([*argv[:-3], "--max-new-tokens", "64", "--truncate-prompt"]) == 2  # no room left for a prompt
    err = capsys.readouterr().err
    assert "--max-new-tokens 64 leaves no room for a prompt" in err and "Traceback" not in err
    # without --max-new-tokens the count is --min-new-tokens's (the message had named --max-new-tokens)
    assert main([*argv[:-3], "--min-new-tokens", "64", "--truncate-prompt"]) == 2
    err = capsys.readouterr().err
    assert "--min-new-tokens 64 leaves no room for a prompt" in err and "--max-new-tokens" not in err


def test_truncate_prompts_keeps_the_tail() -> None:
    kept, cut = truncate_prompts([[1, 2, 3, 4, 5], [6, 7]], max_new_tokens=6, max_seq_len=9)
    assert kept == [[3, 4, 5], [6, 7]] and cut == [0]
    with pytest.raises(ValueError, match="max_new_tokens=9 leaves no room"):
        truncate_prompts([[1]], max_new_tokens=9, max_seq_len=9)


def test_prompt_escapes() -> None:
    """\\n in a prompt, a prompts-file line or a stop string is a newline; \\\\ is one backslash, so a
    literal backslash-n can be written; any other backslash is kept."""
    assert newlines(r"a\nb") == "a\nb" and newlines(r"a\\nb") == "a\\nb"
    assert newlines(r"x\\y") == "x\\y" and newlines(r"tab\t") == "tab\\t" and newlines("plain") == "plain"


def test_greedy_says_which_sampling_options_it_ignores(trained_run: Path, capsys) -> None:
    argv = ["generate", "--run", str(trained_run), "--prompt", "to be", "--greedy", "--max-new-tokens", "4"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--temperature", "1.5", "--seed", "9"]) == 0  # had been ignored silently
    out, err = capsys.readouterr()
    assert "warning: --temperature, --seed apply to sampling only: ignored with --greedy" in err
    assert out == plain
    assert main([*argv, "--temperature", "0", "--repetition-penalty", "1.3"]) == 0  # both read by greedy
    assert "ignored" not in capsys.readouterr().err
    for bad, needle in (("--top-p", "--top-p must be in (0, 1]"), ("--temperature", "--temperature must be")):
        value = "2" if bad == "--top-p" else "nan"  # an invalid value is an error, ignored or not (a
        assert main([*argv, bad, value]) == 2  # NaN temperature had only been warned about)
        err = capsys.readouterr().err
        assert needle in err and "ignored" not in err, err


def test_compile_reaches_generate_and_decodes_the_same_text(trained_run: Path, capsys, monkeypatch) -> None:
    """--compile decodes through the compiled step's program (run eagerly here, so the test does not
    compile; tests/generate/test_compiled_step.py compiles it) and prints the flat step's greedy text."""
    calls: list[int] = []
    monkeypatch.setattr(
        compiled_step,
        "compiled_step_program",
        lambda: lambda *args: calls.append(1) or compiled_step.step_program(*args),
    )
    argv = ["generate", "--run", str(trained_run), "--prompt", "to be", "--greedy", "--no-stream"]
    argv += ["--max-new-tokens", "6"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--compile"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain and len(calls) == 5  # every step after the prompt's
    assert "compiling the decoding step with torch.compile" in captured.err
    monkeypatch.setattr(compiled_step, "why_not_compiled", lambda model: "block 0's MoE drops tokens")
    # a model it cannot compile: no "compiling" line before generate's warning
    assert main([*argv, "--compile"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain and "compiling the decoding step" not in captured.err


def test_min_new_tokens_reaches_generate_and_is_checked(trained_run: Path, capsys, monkeypatch) -> None:
    seen = []
    real = cli_generate.generate
    monkeypatch.setattr(cli_generate, "generate", lambda m, p, s, **kw: seen.append(s) or real(m, p, s, **kw))
    argv = ["generate", "--run", str(trained_run), "--prompt", "to be", "--greedy", "--no-stream"]
    assert main([*argv, "--max-new-tokens", "6", "--min-new-tokens", "4"]) == 0
    assert seen[-1].min_new_tokens == 4 and seen[-1].max_new_tokens == 6
    capsys.readouterr()
    assert main([*argv, "--max-new-tokens", "3", "--min-new-tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert (
        "--min-new-tokens must be >= 0 and <= --max-new-tokens (3), got 5" in err and "Traceback" not in err
    )
    # without --max-new-tokens the budget fitted to the context is at least the minimum asked for
    assert main([*argv, "--min-new-tokens", "70"]) == 2
    err = capsys.readouterr().err
    assert (
        "--min-new-tokens 70 does not fit: the model's context of 64 tokens leaves 61 after the prompt" in err
    )
    assert main([*argv, "--min-new-tokens", "60"]) == 0  # 60 of the 61 left
    assert seen[-1].min_new_tokens == 60 and seen[-1].max_new_tokens == 61


def test_sampling_defaults_and_prompts_file_escapes(tmp_path: Path) -> None:
    """What `tformer generate --help` promises when no sampling option is given: temperature 0.8, top-k
    50, top-p 1, seed 0, 200 new tokens (more when --min-new-tokens asks for more); a prompts file's lines
    read \\n as a newline, as --prompt does."""
    args = argparse.Namespace(
        temperature=None, top_k=None, top_p=None, seed=None, repetition_penalty=1.0, max_new_tokens=None,
        min_new_tokens=0, stop=[], greedy=False,
    )  # fmt: skip
    cfg = sampling_from_args(args)
    assert (cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, cfg.max_new_tokens) == (0.8, 50, 1.0, 0, 200)
    args.min_new_tokens = 300
    assert sampling_from_args(args).max_new_tokens == 300
    path = tmp_path / "prompts.txt"
    path.write_text("to be\\nor not\nsay \\\\n\n")
    prompts, _ = read_prompts(argparse.Namespace(prompts_file=str(path), prompt=None))
    assert prompts == ["to be\nor not", "say \\n"]


def test_streaming_writes_a_tail_held_for_a_stop_string_that_never_comes(trained_run: Path, capsys) -> None:
    """A stop string that begins with the last character of the text (and never completes) holds that
    character back while streaming; the end of the run writes it: streamed and printed output agree."""
    argv = ["generate", "--run", str(trained_run), "--prompt", "to be", "--greedy", "--max-new-tokens", "6"]
    assert main([*argv, "--no-stream"]) == 0
    new = capsys.readouterr().out[len("to be") : -1]
    assert new and not new.endswith("\ufffd")
    stop = new[-1] + "@@"  # "@@" never follows in the text: the stop string is never whole
    assert stop not in new
    for stream in (["--no-stream"], []):
        assert main([*argv, "--stop", stop, *stream]) == 0
        assert capsys.readouterr().out == "to be" + new + "\n", stream


def test_generate_stops_at_the_runs_eos_and_pads_with_its_pad(trained_run: Path, capsys, monkeypatch) -> None:
    """The ids generate gets are the run's tokenizer's <eos> and <pad>, as the tokenizers library reads
    the tokenizer stored with the run."""
    seen = []
    real = cli_generate.generate
    monkeypatch.setattr(
        cli_generate, "generate", lambda m, p, s, **kw: seen.append(kw) or real(m, p, s, **kw)
    )
    argv = ["generate", "--run", str(trained_run), "--prompt", "to be", "--greedy", "--max-new-tokens", "3"]
    for stream in ([], ["--no-stream"]):
        assert main([*argv, *stream]) == 0
    library = Backend.from_str(load_run(trained_run).tokenizer.to_json_str())
    assert len(seen) == 2
    for kw in seen:
        assert kw["eos_id"] == library.token_to_id("<eos>") and kw["pad_id"] == library.token_to_id("<pad>")


def test_min_new_tokens_may_take_all_the_room_the_context_leaves(
    trained_run: Path, capsys, monkeypatch
) -> None:
    """Without --max-new-tokens, a minimum equal to what the context leaves after the prompt fits (one more
    does not: tested above)."""
    seen = []
    real = cli_generate.generate
    monkeypatch.setattr(cli_generate, "generate", lambda m, p, s, **kw: seen.append(s) or real(m, p, s, **kw))
    run_ = load_run(trained_run)
    room = run_.model.cfg.max_seq_len - len(run_.tokenizer.encode("to be"))
    argv = ["generate", "--run", str(trained_run), "--prompt", "to be", "--greedy", "--no-stream"]
    assert main([*argv, "--min-new-tokens", str(room)]) == 0
    assert seen[-1].min_new_tokens == seen[-1].max_new_tokens == room
    assert main([*argv, "--min-new-tokens", str(room + 1)]) == 2
    assert f"leaves {room} after the prompt" in capsys.readouterr().err


def test_prompts_file_lines_of_only_whitespace_are_skipped(tmp_path: Path, capsys) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("to be\n   \n\t\nthe question\n")
    prompts, names = read_prompts(argparse.Namespace(prompts_file=str(path), prompt=None))
    assert prompts == ["to be", "the question"]
    assert names == [f"the prompt on line 1 of {path}", f"the prompt on line 4 of {path}"]
    err = capsys.readouterr().err
    assert "line 2 is empty: skipped" in err and "line 3 is empty: skipped" in err


def test_greedy_names_one_ignored_option_in_the_singular(capsys) -> None:
    parser = argparse.ArgumentParser()
    _generate_args(parser)
    args = parser.parse_args(["--run", "r", "--prompt", "p", "--greedy", "--top-k", "5"])
    assert sampling_from_args(args).temperature == 0.0
    assert "warning: --top-k applies to sampling only: ignored with --greedy" in capsys.readouterr().err


def test_prompt_and_prompts_file_together_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("to be\n")
    with pytest.raises(ValueError, match="give --prompt or --prompts-file, not both"):
        read_prompts(argparse.Namespace(prompts_file=str(path), prompt="the question"))


def spy_on_generate(monkeypatch, on_call) -> None:
    """Call on_call(prompts) as the command calls `generate`, before it runs."""
    real = cli_generate.generate

    def spy(model, prompts, sampling, **kwargs):
        on_call(prompts)
        return real(model, prompts, sampling, **kwargs)

    monkeypatch.setattr(cli_generate, "generate", spy)


def test_no_stream_writes_nothing_until_generation_ends(trained_run: Path, capsys, monkeypatch) -> None:
    """Streamed, the prompt is written before the first token (and tokens as they come); with --no-stream
    stdout is untouched until generate returns, and the text is the same."""
    before = []
    spy_on_generate(monkeypatch, lambda prompts: before.append(capsys.readouterr().out))
    argv = ["generate", "--run", str(trained_run), "--prompt", "to be", "--greedy", "--max-new-tokens", "4"]
    outs = []
    for stream in ([], ["--no-stream"]):
        assert main([*argv, *stream]) == 0
        outs.append(capsys.readouterr().out)
    assert before == ["to be", ""]
    assert before[0] + outs[0] == outs[1]


def test_every_sampling_option_reaches_the_sampling_config() -> None:
    """Each value typed on the command line is the value generate samples with (none replaced by its
    default)."""
    parser = argparse.ArgumentParser()
    _generate_args(parser)
    argv = ["--run", "r", "--prompt", "p", "--temperature", "1.3", "--top-k", "7", "--top-p", "0.6"]
    argv += ["--seed", "11", "--repetition-penalty", "1.4", "--max-new-tokens", "9", "--min-new-tokens", "2"]
    cfg = sampling_from_args(parser.parse_args(argv))
    assert (cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed) == (1.3, 7, 0.6, 11)
    assert (cfg.repetition_penalty, cfg.max_new_tokens, cfg.min_new_tokens) == (1.4, 9, 2)


def test_device_option_of_the_commands_that_run_a_model(trained_run: Path, capsys) -> None:
    """generate, eval, translate and classify take --device (cpu by default; auto picks a GPU where there is
    one and gives the same tokens here); a device torch does not know is one line; export has none."""
    argv = ["--prompt", "to be", "--max-new-tokens", "6", "--greedy", "--no-stream"]
    assert main(["generate", "--run", str(trained_run), *argv]) == 0
    default = capsys.readouterr().out
    assert main(["generate", "--run", str(trained_run), "--device", "auto", *argv]) == 0
    if not __import__("torch").cuda.is_available():
        assert capsys.readouterr().out == default
    assert main(["eval", "--run", str(trained_run), "--device", "cpu", "--max-batches", "1"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["generate", "--run", str(trained_run), "--device", "tpu0", *argv]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("tformer generate: error: device 'tpu0' is not one torch knows")
        and err.count("\n") == 1
    )
    for command in ("translate", "classify"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--device DEVICE" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "--device" not in capsys.readouterr().out


def test_num_samples_draws_each_prompt_that_often_in_one_batch(
    trained_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    rows = []
    spy_on_generate(monkeypatch, lambda prompts: rows.append([list(ids) for ids in prompts]))
    path = tmp_path / "prompts.txt"
    path.write_text("to be\nthe king\n", encoding="utf-8")
    argv = ["generate", "--run", str(trained_run), "--prompts-file", str(path), "--max-new-tokens", "20"]
    argv += ["--num-samples", "3", "--temperature", "1.0", "--top-k", "0", "--seed", "5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    tok = load_run(trained_run).tokenizer
    assert rows == [[tok.encode("to be")] * 3 + [tok.encode("the king")] * 3]
    parts = re.split(r"^--- (.*) ---\n", out, flags=re.M)[1:]
    heads, texts = parts[0::2], parts[1::2]
    assert heads == [f"prompt {i} of 2, sample {j} of 3" for i in (1, 2) for j in (1, 2, 3)]
    assert all(t.startswith("to be") for t in texts[:3]) and all(t.startswith("the king") for t in texts[3:])
    assert len(set(texts[:3])) > 1 and len(set(texts[3:])) > 1  # one stream: the copies draw apart
    assert main(argv) == 0 and capsys.readouterr().out == out  # seeded


def test_num_samples_of_one_prompt_are_headed_and_not_streamed(
    trained_run: Path, capsys, monkeypatch
) -> None:
    before = []
    spy_on_generate(monkeypatch, lambda prompts: before.append(capsys.readouterr().out))
    argv = [
        "generate",
        "--run",
        str(trained_run),
        "--prompt",
        "to be",
        "--max-new-tokens",
        "4",
        "--num-samples",
        "2",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert before == [""] and lines[0] == "--- sample 1 of 2 ---" and "--- sample 2 of 2 ---" in lines


@pytest.mark.parametrize("greedy", [["--greedy", "--seed", "3"], ["--temperature", "0", "--seed", "3"]])
def test_num_samples_with_greedy_decoding_is_refused(trained_run: Path, capsys, greedy: list[str]) -> None:
    """Refused before anything else is said (--seed, ignored by greedy decoding, is not warned of first)."""
    argv = ["generate", "--run", str(trained_run), "--prompt", "to", "--num-samples", "2", *greedy]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "tformer generate: error: --num-samples 2 with greedy decoding would print the same text 2 times\n"
    )


def test_num_samples_must_be_a_positive_count(trained_run: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--run", str(trained_run), "--prompt", "to", "--num-samples", "0"])
    assert exit_info.value.code == 2 and "--num-samples" in capsys.readouterr().err


def test_num_samples_cut_a_long_prompt_once_and_warn_once(trained_run: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("to be\n" + " ".join(["to be"] * 100) + "\n", encoding="utf-8")
    argv = ["generate", "--run", str(trained_run), "--prompts-file", str(path), "--max-new-tokens", "8"]
    assert main([*argv, "--num-samples", "2", "--truncate-prompt"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("warning:") == 1
    assert f"the prompt on line 2 of {path} is longer than the context allows" in captured.err
    assert captured.out.count("--- prompt 2 of 2, sample ") == 2
