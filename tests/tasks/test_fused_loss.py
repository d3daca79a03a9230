"""`fused_loss: true` trains the language model and the translation model through the fused head and loss
(tformer.model.loss), and the losses follow those of the logits path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tformer.model.transformer as transformer
from tests.train.helpers import small_config
from tests.words import write_word_corpus
from tformer.tasks import make_task
from tformer.train.config import TrainConfig
from tformer.train.loop import Trainer
from tformer.train.presets import tiny_translation


def train_losses(run_dir: Path) -> list[float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [float(r["loss"]) for r in records if r["kind"] == "train"]


def eval_losses(run_dir: Path) -> list[float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [float(r["eval_loss"]) for r in records if r["kind"] == "eval"]


def lm_config(tmp_path: Path) -> TrainConfig:
    root = tmp_path / "corpus"
    root.mkdir()
    write_word_corpus(root)
    return small_config(root, steps=6, eval_every=6, eval_batches=1, save_every=6, label_smoothing=0.1)


def translation_config(dictionary: Path) -> TrainConfig:
    cfg = tiny_translation()
    return cfg.replace(data=cfg.data.replace(path=str(dictionary)), steps=4, log_every=1)


@pytest.mark.parametrize("task", ["lm", "translation"])
def test_fused_loss_trains_as_the_logits_path(task: str, tmp_path: Path, dictionary_file: Path, count_calls):
    cfg = lm_config(tmp_path) if task == "lm" else translation_config(dictionary_file)
    assert cfg.fused_loss is False  # the default: the logits path, faster at these vocabularies
    calls = count_calls(transformer, "linear_cross_entropy")
    Trainer(cfg, tmp_path / "logits", make_task(task), progress=False).fit()
    assert not calls
    trainer = Trainer(cfg.replace(fused_loss=True), tmp_path / "fused", make_task(task), progress=False)
    trainer.fit()
    trained = len(calls)
    assert trained > cfg.steps  # one micro-batch per step, each through the fused head, and the evaluation
    logits, fused = train_losses(tmp_path / "logits"), train_losses(tmp_path / "fused")
    assert len(logits) == len(fused) == cfg.steps
    assert fused == pytest.approx(logits, rel=1e-4)  # fp32 rounding apart, the same training
    assert eval_losses(tmp_path / "fused") == pytest.approx(eval_losses(tmp_path / "logits"), rel=1e-4)
    assert len(eval_losses(tmp_path / "fused")) == 1
    trainer.task.evaluate(trainer.model, max_batches=1)  # the evaluation alone: the fused head, no logits
    assert len(calls) > trained


def test_a_resume_may_switch_the_fused_loss(tmp_path: Path) -> None:
    cfg = lm_config(tmp_path).replace(save_every=3)
    Trainer(cfg, tmp_path / "logits", make_task("lm"), progress=False).fit()
    Trainer(cfg, tmp_path / "switched", make_task("lm"), progress=False).fit(until=3)
    fused = cfg.replace(fused_loss=True)
    Trainer(fused, tmp_path / "switched", make_task("lm"), resume=True, progress=False).fit()
    saved = json.loads((tmp_path / "switched" / "config.json").read_text())
    assert saved["fused_loss"] is True
    assert train_losses(tmp_path / "switched") == pytest.approx(train_losses(tmp_path / "logits"), rel=1e-4)


@pytest.mark.slow
def test_the_fused_loss_under_torch_compile(tmp_path: Path) -> None:
    """`compile: true` compiles the model's forward, the fused head and loss included (its targets are
    checked without a host read there): the same losses as the eager fused run, to fp32 rounding."""
    cfg = lm_config(tmp_path).replace(fused_loss=True, steps=3, eval_every=3)
    cfg = cfg.replace(model=cfg.model.replace(dropout=0.0))  # compiled dropout draws other masks
    Trainer(cfg, tmp_path / "eager", make_task("lm"), progress=False).fit()
    Trainer(cfg.replace(compile=True), tmp_path / "compiled", make_task("lm"), progress=False).fit()
    eager, compiled = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert len(compiled) == 3 and compiled == pytest.approx(eager, rel=1e-4)
