"""The trainer: learning, exact resume with dropout on, the non-finite guard, gradient accumulation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.words import WORDS
from tformer.tasks import make_task
from tformer.train.config import DataConfig, OptimConfig, TrainConfig
from tformer.train.loop import Trainer
from tformer.train.presets import tiny_lm
from tformer.train.step import NonFiniteError


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    gen = torch.Generator().manual_seed(0)
    for i in range(12):
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (400,), generator=gen)]
        (root / f"doc{i:02d}.txt").write_text(" ".join(words) + "\n")
    return root


def small_config(corpus_dir: Path, **changes) -> TrainConfig:
    base = tiny_lm()
    cfg = base.replace(
        model=base.model.replace(d_model=32, d_ff=64, n_heads=2, dropout=0.1, max_seq_len=32),
        data=DataConfig(corpus=f"text:{corpus_dir}", vocab_size=300, seq_len=32),
        optim=OptimConfig(lr=1e-2, warmup_steps=2, fused=False),
        steps=8,
        batch_size=4,
        eval_every=4,
        eval_batches=2,
        save_every=4,
        log_every=1,
    )
    return cfg.replace(**changes)


def losses(run_dir: Path) -> list[str]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [float(r["loss"]).hex() for r in records if r["kind"] == "train"]


def test_exact_resume_with_dropout(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir)
    Trainer(cfg, tmp_path / "a", make_task("lm"), progress=False).fit()
    Trainer(cfg, tmp_path / "b", make_task("lm"), progress=False).fit(until=4)
    assert len(losses(tmp_path / "b")) == 4
    Trainer(cfg, tmp_path / "b", make_task("lm"), resume=True, progress=False).fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert len(set(losses(tmp_path / "a"))) > 1


def test_rerun_without_resume_refuses_to_overwrite(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=2, save_every=1)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit()
    with pytest.raises(ValueError, match="already holds checkpoints; pass --resume"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        Trainer(cfg, tmp_path / "empty", make_task("lm"), resume=True, progress=False)


def test_tiny_model_overfits_one_batch(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir)
    trainer = Trainer(cfg, tmp_path / "o", make_task("lm"), progress=False)
    batch = trainer.loader.next_batch(trainer.device)
    model, opt = trainer.model, torch.optim.AdamW(trainer.model.parameters(), lr=1e-2)
    model.eval()  # no dropout: pure memorisation
    first = None
    for _ in range(150):
        loss, n = trainer.task.loss(model, batch)
        loss = loss / n
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 4.0 and loss.item() < 0.3, (first, loss.item())


class NaNTask:
    """Wraps the LM task; its loss is NaN from step `bad_from` on."""

    def __init__(self, bad_from: int) -> None:
        self.inner, self.calls, self.bad_from = make_task("lm"), 0, bad_from

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def loss(self, model, batch):
        self.calls += 1
        loss, n = self.inner.loss(model, batch)
        return (loss * math.nan if self.calls >= self.bad_from else loss), n


def test_nonfinite_steps_are_skipped_then_stop_the_run(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, max_nonfinite=3, steps=10)
    trainer = Trainer(cfg, tmp_path / "n", NaNTask(bad_from=3), progress=False)
    with pytest.raises(NonFiniteError, match="step 5: 3 consecutive steps with a non-finite loss"):
        trainer.fit()
    assert trainer.state.skipped_steps == 3
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    skips = [json.loads(x) for x in (tmp_path / "n" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in skips if r["kind"] == "skip"] == [3, 4, 5]


def test_gradient_accumulation_equals_the_big_batch(corpus_dir: Path, tmp_path: Path) -> None:
    from tformer.train.step import autocast_context, train_step

    grads = []
    for accum, bs in ((1, 8), (2, 4)):
        cfg = small_config(
            corpus_dir,
            batch_size=bs,
            grad_accum=accum,
            model=small_config(corpus_dir).model.replace(dropout=0.0),
        )
        trainer = Trainer(cfg, tmp_path / f"g{accum}", make_task("lm"), progress=False)
        big = trainer.task.train_ds
        from tformer.data.datasets import collate_lm

        micro = [collate_lm([big[i] for i in range(j * bs, (j + 1) * bs)]) for j in range(accum)]
        before = [p.detach().clone() for p in trainer.model.parameters()]
        train_step(
            trainer.model,
            trainer.task.loss,
            micro,
            trainer.task.count_targets,
            trainer.optimizer,
            trainer.scheduler,
            0.0,
            autocast_context(trainer.device, "float32"),
        )
        grads.append([p.detach() - b for p, b in zip(trainer.model.parameters(), before)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bf16_on_cpu_without_bf16_instructions_warns(monkeypatch):
    import warnings

    from tformer.train import step

    monkeypatch.setattr(step, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="without bf16 instructions"):
        step.autocast_context(torch.device("cpu"), "bfloat16")
    monkeypatch.setattr(step, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step.autocast_context(torch.device("cpu"), "bfloat16")
        step.autocast_context(torch.device("cpu"), "float32")


def test_cpu_bf16_detection_reads_this_machine():
    from tformer.train.step import cpu_has_native_bf16

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = cpu_has_native_bf16()
    if found is not None:
        assert found == ("avx512_bf16" in flags or "amx_bf16" in flags)
