"""Opening runs (tformer.runs) on the tiny CLI run: checkpoint lookup, the previous checkpoint an error
names, the model's mode, task checks, and the small helpers the commands' messages use."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tformer.runs import check_texts, find_checkpoint, first_few, load_run, require_task
from tformer.train.checkpoint import CheckpointError


def test_a_folder_of_weights_alone_is_a_checkpoint(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert find_checkpoint(tmp_path) == tmp_path
    (tmp_path / "notes.txt").write_text("a file")
    with pytest.raises(FileNotFoundError, match="is a file; give the run directory"):
        find_checkpoint(tmp_path / "notes.txt")


def test_a_damaged_newest_checkpoint_names_the_one_before_it(trained_run: Path, tmp_path: Path):
    """Three checkpoints (1, 2, 4), the newest damaged: the error names step 2, the one before it."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step_000002", ckpts / "step_000001")
    weights = ckpts / "step_000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"previous checkpoint is .*step_000002 \(give its path"):
        load_run(run)


def test_a_loaded_run_is_in_eval_mode_and_checked_for_its_task(trained_run: Path):
    run = require_task(Path(trained_run), "lm", "language-model")  # a Path, loaded here
    assert not run.model.training and not any(m.training for m in run.model.modules())
    with pytest.raises(
        ValueError, match=r"is a language-model run, not a translation run; use tformer generate"
    ):
        require_task(run, "translation", "translation")


def test_texts_of_blanks_are_empty():
    assert check_texts(["a", " b "]) == ["a", " b "]
    with pytest.raises(ValueError, match="text 1 is empty"):
        check_texts(["a", " \n\t"])


def test_first_few_marks_only_what_it_leaves_out():
    assert first_few([1, 2, 3, 4, 5]) == "1, 2, 3, 4, 5"
    assert first_few([1, 2, 3, 4, 5, 6]) == "1, 2, 3, 4, 5, ..."
    assert first_few([7, 8], n=1) == "7, ..."


def test_weights_that_are_not_finite_are_named_when_a_run_loads(trained_run: Path, tmp_path: Path):
    """A checkpoint whose weights hold NaN loads with a warning naming them: a one-prompt generation had
    printed text as if nothing were wrong (torch's fused attention of an unpadded batch leaves a NaN key out
    of its softmax, so the logits stayed finite)."""
    import warnings

    import torch

    from tformer.train.checkpoint import checkpoint_meta, save_checkpoint

    run = load_run(trained_run)
    with torch.no_grad():
        run.model.blocks[0].attn.k_proj.weight[0, 0] = float("nan")
    saved = save_checkpoint(tmp_path / "run", run.step, run.model, meta=checkpoint_meta(run.checkpoint))
    with pytest.warns(
        UserWarning, match=r"1 tensor\(s\) hold NaN or infinite values \(blocks.0.attn.k_proj"
    ) as record:
        load_run(saved)
    assert record[0].filename == __file__  # the warning points at the caller of load_run
    save_checkpoint(tmp_path / "run", run.step + 1, run.model, meta=checkpoint_meta(run.checkpoint))
    with pytest.warns(UserWarning, match="hold NaN or infinite values") as record:
        load_run(tmp_path / "run", average=2)  # each checkpoint averaged is checked, named from here too
    assert [w.filename for w in record if "NaN" in str(w.message)] == [__file__, __file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_run(trained_run)  # finite weights: nothing said
