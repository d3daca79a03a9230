"""What a resume may change, checked on configs alone (no training): every resumable setting, sections
named by their top key, where the data lives, and the paths a run records absolute."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

import tformer.distributed.checkpoint as dcp
from tformer.config import MoEConfig
from tformer.train.checkpoint import CheckpointError
from tformer.train.presets import tiny_lm
from tformer.train.resume import (
    absolute_data_paths,
    check_resume_config,
    warn_compile_switch,
    warn_precision_switch,
    warn_rank_count_change,
)


def saved(cfg) -> dict:
    return {"train_config": cfg.to_dict()}


def test_cadence_evaluation_and_where_it_runs_may_change():
    cfg = tiny_lm()
    for changed in (
        cfg.replace(eval_batches=cfg.eval_batches + 3),
        cfg.replace(sample_tokens=cfg.sample_tokens + 5),
        cfg.replace(parallel=cfg.parallel.replace(timeout_s=cfg.parallel.timeout_s + 60)),
        cfg.replace(parallel=cfg.parallel.replace(async_save=not cfg.parallel.async_save)),
    ):
        for model in (False, True):
            check_resume_config(changed, saved(cfg), Path("ckpt"), model=model)


def test_a_moved_data_path_may_change_but_not_the_batch():
    cfg = tiny_lm().replace(data=tiny_lm().data.replace(path="/data/old"))
    check_resume_config(
        cfg.replace(data=cfg.data.replace(path="/data/new")), saved(cfg), Path("c"), model=False
    )
    bigger = cfg.batch_size + 1
    with pytest.raises(
        CheckpointError, match=rf"batch_size: {cfg.batch_size} in the checkpoint, {bigger} now"
    ):
        check_resume_config(cfg.replace(batch_size=bigger), saved(cfg), Path("c"), model=False)


def test_model_settings_are_checked_only_with_model_true():
    """model=False (before the task reads data) names the data, optimizer and run settings; model=True
    the model.* ones: each check names only its own."""
    cfg = tiny_lm()
    wider = cfg.replace(model=cfg.model.replace(d_model=cfg.model.d_model * 2))
    check_resume_config(wider, saved(cfg), Path("c"), model=False)
    with pytest.raises(CheckpointError, match="model.d_model"):
        check_resume_config(wider, saved(cfg), Path("c"), model=True)
    seeded = cfg.replace(seed=cfg.seed + 1)
    check_resume_config(seeded, saved(cfg), Path("c"), model=True)
    with pytest.raises(CheckpointError, match="seed"):
        check_resume_config(seeded, saved(cfg), Path("c"), model=False)


def test_a_config_from_another_task_names_the_task_and_the_model_arch_first():
    """A config.json copied from another kind of run differs in tens of settings; the four the error
    shows start with the task (then the corpus), and the model check starts with model.arch."""
    from tformer.train.presets import tiny_classification, tiny_translation

    lm = tiny_lm()
    for other in (tiny_translation(), tiny_classification()):
        with pytest.raises(CheckpointError) as run:
            check_resume_config(other, saved(lm), Path("c"), model=False)
        shown = str(run.value).split("differs from the run's: ")[1]
        assert shown.startswith(f"task: 'lm' in the checkpoint, {other.task!r} now; data.corpus: ")
        with pytest.raises(CheckpointError) as built:
            check_resume_config(other, saved(lm), Path("c"), model=True)
        shown = str(built.value).split("differs from the run's: ")[1]
        assert shown.startswith(f"model.arch: 'decoder' in the checkpoint, {other.model.arch!r} now; ")


def test_relative_paths_are_made_absolute_against_the_base(tmp_path: Path):
    """A config file's relative paths are relative to its folder (`base`), not the working directory."""
    cfg = tiny_lm().replace(data=tiny_lm().data.replace(corpus="text:notes", path="dict/words.txt"))
    out = absolute_data_paths(cfg, base=tmp_path)
    assert out.data.corpus == f"text:{tmp_path / 'notes'}"
    assert out.data.path == str(tmp_path / "dict" / "words.txt")
    here = absolute_data_paths(cfg)
    assert here.data.corpus == f"text:{os.path.join(os.getcwd(), 'notes')}"
    assert here.data.path == os.path.join(os.getcwd(), "dict", "words.txt")
    assert absolute_data_paths(out) == out  # absolute paths stay as they are


def test_a_compile_switch_without_dropout_is_not_said():
    cfg = tiny_lm()
    quiet = cfg.replace(model=cfg.model.replace(dropout=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_compile_switch(quiet.replace(compile=not quiet.compile), saved(quiet))
    with pytest.warns(UserWarning, match="model.dropout=0.1"):
        dropped = cfg.replace(model=cfg.model.replace(dropout=0.1))
        warn_compile_switch(dropped.replace(compile=not dropped.compile), saved(dropped))


def test_a_change_of_fsdp_compute_precision_on_resume_is_said():
    """parallel.param_dtype may change (a sharded run resumed in one process must drop it), but the steps
    then compute in another precision: said, as dtype's change is refused."""
    from tformer.train.config import ParallelConfig

    cfg = tiny_lm()
    bf16 = cfg.replace(parallel=ParallelConfig(data="fsdp", param_dtype="bfloat16"))
    with pytest.warns(
        UserWarning, match=r"parallel.param_dtype is 'float32' on resume of a run trained with 'bfloat16'"
    ):
        warn_precision_switch(cfg, saved(bf16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_precision_switch(bf16, saved(bf16))
        warn_precision_switch(cfg, saved(cfg))


def test_a_section_dropped_now_is_named_once():
    """A run with model.moe resumed without it: the section is named as a whole (its settings as a dict),
    not setting by setting."""
    cfg = tiny_lm()
    moe = cfg.replace(model=cfg.model.replace(moe=MoEConfig(n_experts=4, top_k=2)))
    with pytest.raises(
        CheckpointError, match=r"model.moe: \{.*'n_experts': 4.*\} in the checkpoint, None now"
    ) as err:
        check_resume_config(cfg, saved(moe), Path("c"), model=True)
    assert "model.moe.n_experts" not in str(err.value)


def test_an_encoder_setting_a_decoder_never_read_is_no_change():
    """A saved config this version no longer reads (an option since retired) is compared as saved: its
    n_encoder_layers, which a decoder never read, is no change (it is None once the config is read)."""
    cfg = tiny_lm()
    meta = saved(cfg)
    meta["train_config"]["parallel"]["retired_option"] = 1
    meta["train_config"]["model"]["n_encoder_layers"] = 3
    check_resume_config(cfg, meta, Path("c"), model=True)


@pytest.mark.parametrize("saved_ranks", [2, 8])
def test_a_changed_rank_count_is_said_either_way(monkeypatch, saved_ranks):
    monkeypatch.setattr(dcp, "saved_data_world_size", lambda path: saved_ranks)
    with pytest.warns(
        UserWarning, match=rf"was trained by {saved_ranks} data-parallel rank\(s\), this run has 4"
    ):
        warn_rank_count_change(Path("run/step_00000002"), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_rank_count_change(Path("run/step_00000002"), saved_ranks)
