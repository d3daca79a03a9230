"""The command line on a run's checkpoints: paths, damaged or corrupt checkpoints, DCP checkpoints, resuming
with the run's own config, and the checkpoint metadata."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tests.cli_run import tiny_lm_argv
from tformer.cli.main import main


def test_run_paths_and_a_damaged_newest_checkpoint(trained_run: Path, capsys, tmp_path: Path) -> None:
    """The run's checkpoints folder is taken for the run; a newer checkpoint that never committed is
    named in a warning, and the newest committed one is used."""
    argv = ["--prompt", "to", "--max-new-tokens", "2", "--greedy", "--no-stream"]
    assert main(["generate", "--run", str(trained_run / "checkpoints"), *argv]) == 0
    assert capsys.readouterr().err == ""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "checkpoints" / "step_000004" / "COMMITTED").write_text("garbage")
    with pytest.warns(
        UserWarning,
        match=r"step_000004 is not a committed checkpoint .* the newest committed one, step_000002",
    ):
        assert main(["generate", "--run", str(run), *argv]) == 0


def test_corrupt_checkpoint_is_one_line_and_keeps_files(trained_run: Path, capsys, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    weights = copy / "checkpoints" / "step_000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["generate", "--run", str(copy), "--prompt", "to"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and err.count("\n") == 1
    assert weights.exists() and (copy / "checkpoints" / "step_000002" / "model.safetensors").exists()
    previous = copy / "checkpoints" / "step_000002"
    assert f"the run's previous checkpoint is {previous} (give its path to use it)" in err
    assert main(["generate", "--run", str(previous), "--prompt", "to", "--max-new-tokens", "2"]) == 0


def test_generate_and_eval_read_a_dcp_run(trained_run: Path, tmp_path: Path, capsys) -> None:
    """A run saved in the sharded DCP format (what torchrun runs write) opens directly in generate and
    eval, with the same weights as its single-process export."""
    from tformer.distributed.checkpoint import export_single_process
    from tformer.runs import load_run

    corpus = json.loads((trained_run / "config.json").read_text())["data"]["corpus"]
    out = tmp_path / "dcp-run"
    argv = tiny_lm_argv(out, corpus, steps=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main([*argv, "--set", "parallel.checkpoint=dcp"]) == 0
    assert not [w for w in seen if "distributed" in str(w.message)]  # DCP's note that it saves in one process
    direct = load_run(out)
    assert (direct.checkpoint / ".metadata").is_file() and direct.step == 2
    exported = load_run(export_single_process(direct.checkpoint, tmp_path / "exported"))
    assert not direct.model.training and not exported.model.training  # ready to run: dropout off
    for (name, a), b in zip(direct.model.state_dict().items(), exported.model.state_dict().values()):
        assert torch.equal(a, b), name
    capsys.readouterr()
    assert (
        main(["generate", "--run", str(out), "--prompt", "to be", "--max-new-tokens", "4", "--greedy"]) == 0
    )
    capsys.readouterr()
    assert main(["eval", "--run", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"] == pytest.approx(math.exp(result["eval_loss"]))
    assert result["bits_per_token"] == pytest.approx(result["eval_loss"] / math.log(2))


def test_a_safetensors_run_resumed_with_dcp_saves_continues_exactly(
    trained_run: Path, tmp_path: Path
) -> None:
    """The way from 1 to N processes (docs/distributed.md): resume a single-process run once with
    `--set parallel.checkpoint=dcp`; it loads its safetensors checkpoint, continues to the weights of the
    uninterrupted run and saves DCP."""
    from tformer.runs import load_run

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    argv = ["train", "--out", str(run), "--resume", "--no-progress", "--no-sample"]
    assert main([*argv, "--set", "parallel.checkpoint=dcp"]) == 0
    resumed, straight = load_run(run), load_run(trained_run)
    assert (resumed.checkpoint / ".metadata").is_file() and resumed.step == straight.step == 4
    for (name, a), b in zip(resumed.model.state_dict().items(), straight.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_dcp_run_resumed_in_one_process_keeps_saving_dcp(trained_run: Path, tmp_path: Path) -> None:
    """A run that saved DCP (as every torchrun run does), resumed in one process under parallel.checkpoint=auto,
    goes on saving DCP: it had switched to the single-process format, which a later torchrun resume refuses."""
    from tformer.distributed.checkpoint import is_dcp_checkpoint
    from tformer.train.checkpoint import latest_checkpoint

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    argv = ["train", "--out", str(run), "--resume", "--no-progress", "--no-sample"]
    assert main([*argv, "--set", "parallel.checkpoint=dcp"]) == 0
    assert is_dcp_checkpoint(latest_checkpoint(run))
    assert main([*argv, "--set", "parallel.checkpoint=auto", "--set", "steps=6"]) == 0
    latest = latest_checkpoint(run)
    assert latest.name == "step_000006" and is_dcp_checkpoint(latest)


def test_resume_takes_the_runs_own_config_and_refuses_changes_that_break_exactness(
    trained_run: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    for argv, needle in (
        (["--set", "optim.lr=0.5"], "optim.lr: 0.003 in the checkpoint, 0.5 now"),
        (
            ["--preset", "shakespeare"],
            "the config differs from the run's: data.corpus: 'text:",  # the corpus first (resume.FIRST)
        ),
        (  # a dense run made MoE: the section is named once (each of its settings had been listed)
            ["--set", "model.moe.n_experts=4"],
            "the config differs from the run's: model.moe: None in the checkpoint, {'n_experts': 4, ",
        ),
    ):
        assert main(["train", "--out", str(run), "--resume", "--no-progress", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing written
    # no --preset: the run's config.json (a tiny-lm run on a text folder), longer by --set steps
    assert (
        main(["train", "--out", str(run), "--resume", "--no-progress", "--no-sample", "--set", "steps=6"])
        == 0
    )
    assert (run / "checkpoints" / "step_000006").is_dir()
    assert json.loads((run / "config.json").read_text())["steps"] == 6
    (run / "config.json").unlink()  # without it: the newest checkpoint's config (steps 6), plus --set
    assert (
        main(["train", "--out", str(run), "--resume", "--no-progress", "--no-sample", "--set", "steps=7"])
        == 0
    )
    assert (run / "checkpoints" / "step_000007").is_dir()
    assert json.loads((run / "config.json").read_text())["batch_size"] == 8  # the run's, not a preset's


def test_metadata_without_a_key_names_it(trained_run: Path, monkeypatch) -> None:
    import tformer.runs as runs
    from tformer.train.checkpoint import CheckpointError

    real = runs.checkpoint_meta
    monkeypatch.setattr(
        runs, "checkpoint_meta", lambda p: {k: v for k, v in real(p).items() if k != "model_config"}
    )
    with pytest.raises(CheckpointError, match="meta.json: run metadata without the key 'model_config'"):
        runs.load_run(trained_run)


def test_async_save_in_one_process_is_said_to_wait_for_dcp(trained_run: Path, tmp_path: Path) -> None:
    """Under checkpoint=auto one process saves safetensors, synchronously: async_save is named as unused
    there; a DCP run resumed in one process (which keeps saving DCP) saves asynchronously, unwarned."""
    from tformer.tasks import make_task
    from tformer.train.config import TrainConfig
    from tformer.train.loop import Trainer

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    cfg = TrainConfig.from_dict(json.loads((run / "config.json").read_text())).with_overrides(
        {"parallel.async_save": True}
    )
    with pytest.warns(
        UserWarning, match="async_save=True: this run saves single-process .* async saves are DCP's"
    ):
        Trainer(cfg, tmp_path / "fresh", make_task("lm"), progress=False).close()
    argv = ["train", "--out", str(run), "--resume", "--no-progress", "--no-sample"]
    assert main([*argv, "--set", "parallel.checkpoint=dcp", "--set", "steps=5"]) == 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = Trainer(cfg.replace(steps=6), run, make_task("lm"), resume=True, progress=False)
        trainer.close()
    assert not [w for w in seen if "async" in str(w.message)], [str(w.message) for w in seen]


def test_a_run_stopped_early_is_said_when_its_weights_are_used(
    trained_run: Path, capsys, tmp_path: Path
) -> None:
    """generate and eval of a run whose newest checkpoint is short of its steps say so on stderr (a run
    stopped by Ctrl-C had been used as if finished), with the command that continues it, its path quoted
    for the shell (translate, classify and export load runs through the same `load_run_arg`); a checkpoint
    named by its folder says which step of the run it is; a finished run says nothing."""
    import shlex

    run = tmp_path / "a run"
    shutil.copytree(trained_run, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")  # as a run stopped after step 2 of 4 leaves it
    argv = ["--prompt", "to", "--max-new-tokens", "2", "--greedy", "--no-stream"]
    assert main(["generate", "--run", str(run), *argv]) == 0
    err = capsys.readouterr().err
    assert err == (
        f"tformer generate: note: the checkpoint used is of step 2 of the run's 4 (if the run stopped early, "
        f"`tformer train --out {shlex.quote(str(run.resolve()))} --resume` continues it)\n"
    )
    assert "'" in err  # the space in the path is quoted
    assert main(["eval", "--run", str(run)]) == 0
    assert "tformer eval: note: the checkpoint used is of step 2 of the run's 4" in capsys.readouterr().err
    assert main(["generate", "--run", str(trained_run / "checkpoints" / "step_000002"), *argv]) == 0
    assert capsys.readouterr().err == "tformer generate: note: the weights of step 2 of the run's 4\n"
    assert main(["generate", "--run", str(trained_run), *argv]) == 0
    assert capsys.readouterr().err == ""
    # a damaged newer checkpoint, which a resume refuses to pass: the note says to move it first
    damaged = tmp_path / "damaged"
    shutil.copytree(trained_run, damaged)
    (damaged / "checkpoints" / "step_000004" / "COMMITTED").unlink()
    assert main(["generate", "--run", str(damaged), *argv]) == 0
    err = capsys.readouterr().err
    checkpoints = shlex.quote(str((damaged / "checkpoints").resolve()))
    assert (
        f"note: the checkpoint used is of step 2 of the run's 4 (if the run stopped early, move step_000004 "
        f"out of {checkpoints}, then `tformer train --out {shlex.quote(str(damaged.resolve()))} --resume` "
        "continues it)\n"
    ) in err, err
