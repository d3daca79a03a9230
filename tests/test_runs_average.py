"""Checkpoint averaging (`load_run(..., average=N)`, `--average N`) on the tiny CLI run, whose checkpoints
are steps 2 and 4: the mean against a naive one, what the commands print, and the errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tformer.cli.main import main
from tformer.config import ModelConfig
from tformer.model import build_model
from tformer.runs import load_run
from tformer.train.checkpoint import CheckpointError, checkpoint_meta, save_checkpoint


def test_the_average_is_the_mean_of_the_checkpoints_weights(trained_run: Path) -> None:
    ckpts = trained_run / "checkpoints"
    first, last = load_run(ckpts / "step_000002"), load_run(ckpts / "step_000004")
    mean = load_run(trained_run, average=2)
    assert (mean.step, mean.averaged_steps, last.averaged_steps) == (4, (2, 4), ())
    assert not mean.model.training and mean.tokenizer == last.tokenizer
    assert mean.train_config == last.train_config
    a, b, got = first.model.state_dict(), last.model.state_dict(), mean.model.state_dict()
    assert got.keys() == b.keys()
    moved = 0
    for name, value in got.items():  # the naive mean: each pair summed in float64, halved, cast back
        want = ((a[name].double() + b[name].double()) / 2).to(value.dtype)
        assert torch.equal(value, want), name
        moved += not torch.equal(value, b[name])
    assert moved > 0  # the two checkpoints differ, so the mean is neither of them
    assert mean.model.cfg.tie_embeddings  # a tied head stays tied
    assert mean.model.lm_head.weight is mean.model.tok_embed.weight
    alone = load_run(trained_run, average=1).model.state_dict()
    assert all(torch.equal(alone[k], b[k]) for k in b)


def test_eval_and_generate_say_whose_weights_they_use(trained_run: Path, capsys) -> None:
    run = str(trained_run)
    assert main(["eval", "--run", run, "--split", "val", "--average", "2", "--json"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert result["averaged_steps"] == [2, 4] and result["checkpoint_step"] == 4
    assert out.err == "tformer eval: weights: the mean of the checkpoints of steps 2, 4\n"
    assert main(["eval", "--run", run, "--split", "val", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["averaged_steps"] == [] and alone["eval_loss"] != result["eval_loss"]
    assert main(["eval", "--run", run, "--split", "val", "--average", "2"]) == 0
    assert "(step 4, the mean of the 2 checkpoints of steps 2-4): loss" in capsys.readouterr().out
    argv = ["generate", "--run", run, "--prompt", "to be", "--greedy", "--max-new-tokens", "3", "--no-stream"]
    assert main([*argv, "--average", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("to be") and "weights: the mean of the checkpoints of steps 2, 4" in out.err


def test_averaging_more_checkpoints_than_the_run_keeps_is_one_clear_error(trained_run: Path, capsys) -> None:
    with pytest.raises(ValueError, match=r"holds 2 committed checkpoint\(s\) \(step_000002, step_000004\); "
                       r"averaging 3 needs 3: .*--set save_every=100 --set keep_last=3"):  # fmt: skip
        load_run(trained_run, average=3)
    assert main(["generate", "--run", str(trained_run), "--prompt", "to", "--average", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "averaging 3 needs 3" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--run", str(trained_run), "--prompt", "to", "--average", "0"])
    assert exit_.value.code == 2 and "argument --average: expected an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_average_must_be_a_count(trained_run: Path, bad) -> None:
    with pytest.raises(ValueError, match="average must be a whole number >= 1"):
        load_run(trained_run, average=bad)


def test_averaging_takes_a_run_directory_not_one_checkpoint(trained_run: Path) -> None:
    one = trained_run / "checkpoints" / "step_000004"
    with pytest.raises(
        ValueError, match=f"takes a run directory; {one} is one checkpoint .*its run directory: "
    ):
        load_run(one, average=2)
    assert load_run(one).step == 4  # alone it loads


def test_checkpoints_of_another_model_are_not_averaged(trained_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    meta = checkpoint_meta(run / "checkpoints" / "step_000004")
    other = ModelConfig.from_dict(meta["model_config"]).replace(n_layers=1)
    meta = {**meta, "model_config": other.to_dict(),
            "train_config": {**meta["train_config"], "model": other.to_dict()}}  # fmt: skip
    save_checkpoint(run, 3, build_model(other), meta=meta)
    assert load_run(run / "checkpoints" / "step_000003").model.cfg.n_layers == 1  # a whole checkpoint
    with pytest.raises(CheckpointError, match=r"step_000003 holds another model config than .*step_000004"):
        load_run(run, average=2)
