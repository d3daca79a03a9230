"""The trainer: learning, exact resume with dropout on, the non-finite guard, gradient accumulation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tformer.tasks import make_task
from tformer.train.checkpoint import latest_checkpoint
from tformer.train.config import DataConfig, OptimConfig, TrainConfig
from tformer.train.loop import Trainer
from tformer.train.optim import lr_factor
from tformer.train.presets import tiny_lm
from tformer.train.step import NonFiniteError


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
    """Every step's loss and gradient norm, bit for bit."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        f"{float(r['loss']).hex()} {float(r['grad_norm']).hex()}" for r in records if r["kind"] == "train"
    ]


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
    report = Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit()
    assert json.loads((tmp_path / "r" / "report.json").read_text()) == report  # not only from the CLI
    with pytest.raises(ValueError, match="already holds checkpoints; pass --resume"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        Trainer(cfg, tmp_path / "empty", make_task("lm"), resume=True, progress=False)
    for step in (1, 2):  # every checkpoint's manifest damaged: the newest is named, not only "none"
        (tmp_path / "r" / "checkpoints" / f"step_{step:06d}" / "COMMITTED").write_text("{")
    named = r"r holds no committed checkpoint \(.*step_000002 has no readable commit manifest"
    with pytest.raises(FileNotFoundError, match=named):
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    from tformer.runs import load_run

    with pytest.raises(FileNotFoundError, match=named):
        load_run(tmp_path / "r")
    with pytest.raises(TypeError, match="the run must be a path .*got NoneType"):
        load_run(None)
    with pytest.raises(TypeError, match="run_dir must be a path, got NoneType"):
        Trainer(cfg, None, make_task("lm"), progress=False)


def test_a_newer_trainer_takes_the_run_directory_over_in_a_process(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=2)
    first = Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False)
    first.fit(until=2)
    second = Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    for use in (first.fit, first.save):  # the first would write checkpoints and metrics beside it
        with pytest.raises(RuntimeError, match="a newer Trainer in this process took the run directory"):
            use()
    first.close()  # leaves the lock with the second
    second.fit(until=3)
    probe = "import pathlib, sys; from tformer.train.run_dir import lock_run_dir; lock_run_dir(pathlib.Path(sys.argv[1]), sys)"
    other = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "r")], capture_output=True, text=True)
    assert (
        other.returncode != 0 and f"in use by pid {os.getpid()}" in other.stderr
    )  # another process is refused
    del second  # dropped without close(): the next Trainer takes the directory over
    assert Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()["step"] == 4
    assert [r["step"] for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"] == [1, 2, 3, 4]  # fmt: skip


def test_a_resume_checks_its_documents_and_vocabulary(corpus_dir: Path, tmp_path: Path) -> None:
    """A document edited in place (same name) changes the data a resume would read: refused. The run's
    tokenizer.json, deleted, is restored from the checkpoint (a new one had been trained on the data as
    it is now); replaced by another vocabulary, it is an error."""
    import shutil

    from tformer.schema import ConfigError
    from tformer.train.checkpoint import CheckpointError

    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    cfg = small_config(corpus, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    doc = sorted(corpus.iterdir())[0]
    original = doc.read_text()
    doc.write_text(" ".join(reversed(original.split())) + "\n")
    with pytest.raises(ConfigError, match=r"split\(s\) of .* differ .* added, removed, renamed or edited"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    doc.write_text(original)
    tokenizer = (tmp_path / "r" / "tokenizer.json").read_text()
    (tmp_path / "r" / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match=r"tokenizer.json was missing: restored from .*step_000002"):
        resumed = Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    assert json.loads((tmp_path / "r" / "tokenizer.json").read_text()) == json.loads(tokenizer)
    resumed.close()
    other = json.loads(tokenizer)  # two tokens' ids swapped: another vocabulary
    vocab = other["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "r" / "tokenizer.json").write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match=r"is not the vocabulary step_000002 was trained with"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)


def test_a_resume_at_its_last_step_reports_that_step_evaluated(corpus_dir: Path, tmp_path: Path) -> None:
    """steps lowered to the checkpoint's step: no step runs, but the run ends as a run does, evaluated at
    its last step; the report's step is the run's, its evaluation's step `eval_step` (it had said 3)."""
    cfg = small_config(corpus_dir, steps=8, save_every=5, eval_every=3)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=5)
    report = Trainer(cfg.replace(steps=5), tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()
    assert report["step"] == 5 and report["eval_step"] == 5 and "eval_loss" in report
    partial = Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit(until=7)
    assert partial["step"] == 7 and partial["eval_step"] == 6


def test_a_run_saved_before_a_setting_existed_resumes(corpus_dir: Path, tmp_path: Path) -> None:
    """A checkpoint written before a config field was added (rope.yarn_ramp here) lacks it: the field
    takes its default, not a refused change ("None in the checkpoint")."""
    from tformer.train.checkpoint import CheckpointError, checkpoint_meta
    from tformer.train.resume import check_resume_config

    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    ckpt = latest_checkpoint(tmp_path / "r")
    meta = checkpoint_meta(ckpt)
    del meta["train_config"]["model"]["rope"]["yarn_ramp"]

    from tformer import ModelConfig

    cfg = cfg.replace(model=ModelConfig.from_dict(meta["model_config"]))  # as the task resolves it
    for model in (False, True):
        check_resume_config(cfg, meta, ckpt, model=model)
    with pytest.raises(
        CheckpointError, match=r"model.rope.yarn_ramp: 'rotations' in the checkpoint, 'dims' now"
    ):
        changed = cfg.model.replace(rope=cfg.model.rope.replace(yarn_ramp="dims"))
        check_resume_config(cfg.replace(model=changed), meta, ckpt, model=True)


def test_switching_compile_on_resume_with_dropout_is_said(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    with pytest.warns(
        UserWarning,
        match=r"compile=True on resume of a run with compile=False and model.dropout=0.1: .* not be bit-identical",
    ):
        Trainer(
            cfg.replace(compile=True), tmp_path / "r", make_task("lm"), resume=True, progress=False
        ).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = cfg.replace(model=cfg.model.replace(dropout=0.0))
        Trainer(quiet, tmp_path / "q", make_task("lm"), progress=False).fit(until=2)
        Trainer(
            quiet.replace(compile=True), tmp_path / "q", make_task("lm"), resume=True, progress=False
        ).close()


def test_a_newer_trainer_resumes_from_the_save_the_older_had_in_flight(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """The older Trainer's fit failed in step 5 with step 4's async save in flight: the newer one commits
    it before choosing where to resume (it had resumed from an older step, then met step 4 again as
    'checkpoint exists already')."""
    from tformer.train.config import ParallelConfig

    parallel = ParallelConfig(checkpoint="dcp", async_save=True)
    cfg = small_config(corpus_dir, steps=6, save_every=2, eval_every=100, parallel=parallel)
    task, calls = make_task("lm"), []
    loss = task.loss

    def failing_loss(model, batch):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("step 5 fails")
        return loss(model, batch)

    task.loss = failing_loss
    first = Trainer(cfg, tmp_path / "r", task, progress=False)
    with pytest.raises(RuntimeError, match="step 5 fails"):
        first.fit()
    second = Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    assert second.state.step == 4 and second.fit()["step"] == 6


def test_a_new_run_never_replaces_files_no_run_wrote(corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A directory holding a config or tokenizer of the user's own is refused, untouched; a run that
    stopped before its first checkpoint (its config.json, written first, is a run's) is started again."""
    cfg = small_config(corpus_dir, steps=1, save_every=1)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text('{"mine": 1}')
    (mine / "notes.txt").write_text("kept")
    with pytest.raises(FileExistsError, match="holds tokenizer.json, which a new run would replace"):
        Trainer(cfg, mine, make_task("lm"), progress=False)
    assert (mine / "tokenizer.json").read_text() == '{"mine": 1}'
    (mine / "tokenizer.json").unlink()
    (mine / "config.json").write_text('{"my": "settings"}')
    with pytest.raises(FileExistsError, match="holds config.json, which .* not a tformer run"):
        Trainer(cfg, mine, make_task("lm"), progress=False)
    assert (mine / "config.json").read_text() == '{"my": "settings"}'
    (mine / "config.json").unlink()
    for name in (
        "src_tokenizer.json",
        "data.json",
        "metrics.jsonl",
        "loss.png",
        "report.json",
        "tensorboard",
    ):
        path = mine / name
        path.mkdir() if name == "tensorboard" else path.write_text("the user's")
        with pytest.raises(FileExistsError, match=f"holds {name}, which a new run would replace"):
            Trainer(cfg, mine, make_task("lm"), progress=False)
        assert path.is_dir() if name == "tensorboard" else path.read_text() == "the user's"
        path.rmdir() if name == "tensorboard" else path.unlink()

    stopped = tmp_path / "stopped"
    stopped.mkdir()

    def fails(_):
        raise MemoryError("out of memory")

    monkeypatch.setattr("tformer.train.loop.build_model", fails)  # after the tokenizer and data.json
    with pytest.raises(MemoryError):
        Trainer(cfg, stopped, make_task("lm"), progress=False)
    assert {"config.json", "tokenizer.json", "data.json"} <= {p.name for p in stopped.iterdir()}
    monkeypatch.undo()
    Trainer(cfg, stopped, make_task("lm"), progress=False).fit()  # a second try goes ahead
    assert latest_checkpoint(stopped).name == "step_000001"


def test_the_trainer_names_arguments_it_cannot_use(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=1, save_every=1)
    with pytest.raises(TypeError, match="cfg must be a TrainConfig .*, got ModelConfig"):
        Trainer(cfg.model, tmp_path / "a", "lm", progress=False)
    with pytest.raises(TypeError, match="task must be a task name or tformer.tasks.make_task"):
        Trainer(cfg, tmp_path / "a", None, progress=False)
    trainer = Trainer(cfg, tmp_path / "a", "lm", progress=False)  # a task name is made into the task
    for until in ("1", 1.5, 0):
        with pytest.raises(ValueError, match="until must be a step number >= 1"):
            trainer.fit(until=until)
    trainer.fit()
    trainer.close()
    with pytest.raises(RuntimeError, match=r"this Trainer is closed; a new Trainer\(..., resume=True\)"):
        trainer.fit()


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
    with pytest.raises(NonFiniteError, match="step 5: 3 consecutive steps with a non-finite loss") as info:
        trainer.fit()
    assert str(info.value).endswith(
        f"the last checkpoint, {tmp_path / 'n' / 'checkpoints' / 'step_000004'}, is intact."
    )
    again = Trainer(cfg.replace(save_every=10), tmp_path / "m", NaNTask(bad_from=3), progress=False)
    with pytest.raises(NonFiniteError, match=r"no checkpoint was written\.$"):  # it had called one intact
        again.fit()
    assert trainer.state.skipped_steps == 3
    assert (tmp_path / "n" / "loss.png").is_file()  # the curve up to the stop
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    skips = [json.loads(x) for x in (tmp_path / "n" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in skips if r["kind"] == "skip"] == [3, 4, 5]
    first = Trainer(cfg.replace(max_nonfinite=2), tmp_path / "f", NaNTask(bad_from=1), progress=False)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(NonFiniteError, match="step 2: 2"):
        warnings.simplefilter("always")
        first.fit()
    assert (tmp_path / "f" / "loss.png").is_file()  # a plot without any loss: no legend warning
    assert not [w for w in seen if "legend" in str(w.message)]


def test_the_nonfinite_stop_names_the_ranks_under_torchrun() -> None:
    """The words a multi-rank stop uses (the 2-rank runs check `nonfinite_ranks` itself)."""
    from types import SimpleNamespace

    from tformer.train.loop import nonfinite_stop

    on = SimpleNamespace(nonfinite_ranks=[1, 3], loss=float("nan"), grad_norm=float("nan"))
    assert "steps with a non-finite loss or gradient norm (non-finite loss on rank 1, 3) (loss nan" in (
        nonfinite_stop(7, 3, 4, on)
    )
    behind = SimpleNamespace(nonfinite_ranks=[], loss=2.5, grad_norm=float("inf"))
    assert "(every rank's loss was finite; the gradients were summed over ranks, so no rank is named)" in (
        nonfinite_stop(7, 3, 2, behind)
    )
    assert "rank" not in nonfinite_stop(7, 3, 1, on)  # one process: nothing to name


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
        # plain SGD at lr 1 so the weight change is minus the gradient the step applied (the first AdamW
        # update is g / (|g| + eps), which turns rounding in a tiny gradient into a large change)
        sgd = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        train_step(
            trainer.model,
            trainer.task.loss,
            micro,
            trainer.task.count_targets,
            sgd,
            torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0),
            0.0,
            autocast_context(trainer.device, "float32"),
        )
        grads.append([b - p.detach() for p, b in zip(trainer.model.parameters(), before)])
    assert max(float(g.abs().max()) for g in grads[0]) > 1e-3  # gradients that the tolerance can see
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


def one_step(trainer: Trainer, loss_fn=None, optimizer=None, batch=None, grad_clip: float = 1.0):
    from tformer.train.step import autocast_context, train_step

    return train_step(
        trainer.model,
        loss_fn or trainer.task.loss,
        [batch if batch is not None else trainer.loader.next_batch(trainer.device)],
        trainer.task.count_targets,
        optimizer or trainer.optimizer,
        trainer.scheduler,
        grad_clip,
        autocast_context(trainer.device, "float32"),
    )


def test_inf_gradient_with_finite_loss_is_skipped_before_the_optimizer(
    corpus_dir: Path, tmp_path: Path
) -> None:
    trainer = Trainer(small_config(corpus_dir), tmp_path / "i", make_task("lm"), progress=False)
    param = next(trainer.model.parameters())

    class Inf(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sum() * 0

        @staticmethod
        def backward(ctx, g):
            return torch.full_like(param, math.inf)

    def loss_fn(model, batch):
        loss, n = trainer.task.loss(model, batch)
        return loss + Inf.apply(param), n

    before = [p.detach().clone() for p in trainer.model.parameters()]
    r = one_step(trainer, loss_fn)  # clip_grad_norm_ would turn these gradients into NaN
    assert math.isfinite(r.loss) and not math.isfinite(r.grad_norm) and r.skipped
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    assert all(p.grad is None for p in trainer.model.parameters())
    r = one_step(trainer)  # the next step trains normally
    assert not r.skipped and math.isfinite(r.grad_norm)
    assert not all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_bf16_autocast_tracks_float32(corpus_dir: Path, tmp_path: Path) -> None:
    """C8: the same run under bf16 autocast stays within bf16 rounding of float32 (per step: loss within
    0.2%, gradient norm within 1%; measured: 1e-4 and 1e-3), keeps float32 weights, and does run in
    bf16 (the numbers differ)."""
    cfg = small_config(corpus_dir, model=small_config(corpus_dir).model.replace(dropout=0.0), steps=6)
    curves = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(cfg.replace(dtype=dtype), tmp_path / dtype, make_task("lm"), progress=False)
        trainer.fit()
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        records = [json.loads(x) for x in (tmp_path / dtype / "metrics.jsonl").read_text().splitlines()]
        curves[dtype] = [(r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train"]
    assert len(curves["float32"]) == len(curves["bfloat16"]) == 6
    for (loss32, norm32), (loss16, norm16) in zip(curves["float32"], curves["bfloat16"]):
        assert abs(loss16 - loss32) <= 2e-3 * loss32 and abs(norm16 - norm32) <= 1e-2 * norm32
    assert curves["float32"] != curves["bfloat16"]


def test_clipping_bounds_the_norm_the_optimizer_sees(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, model=small_config(corpus_dir).model.replace(dropout=0.0))
    trainer = Trainer(cfg, tmp_path / "c", make_task("lm"), progress=False)
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            return super().step(closure)

    spy = Spy(trainer.model.parameters(), lr=0.0)
    batch = trainer.loader.next_batch(trainer.device)
    unclipped = one_step(trainer, optimizer=spy, batch=batch, grad_clip=0.0)
    max_norm = unclipped.grad_norm / 4
    clipped = one_step(trainer, optimizer=spy, batch=batch, grad_clip=max_norm)
    assert clipped.grad_norm == pytest.approx(unclipped.grad_norm, rel=1e-5)  # the pre-clip norm is logged
    assert seen[0] == pytest.approx(unclipped.grad_norm, rel=1e-5)
    assert seen[1] <= max_norm + 1e-6 and seen[1] == pytest.approx(max_norm, rel=1e-4)


def test_batch_with_every_target_ignored_has_zero_loss(corpus_dir: Path, tmp_path: Path) -> None:
    from tformer.data.datasets import IGNORE_INDEX

    trainer = Trainer(small_config(corpus_dir), tmp_path / "z", make_task("lm"), progress=False)
    batch = trainer.loader.next_batch(trainer.device)
    batch = batch._replace(targets=torch.full_like(batch.targets, IGNORE_INDEX))
    r = one_step(trainer, batch=batch)
    assert (r.loss, r.grad_norm, r.targets, r.skipped) == (0.0, 0.0, 1, False)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_loss_spike_is_logged_and_training_goes_on(corpus_dir: Path, tmp_path: Path) -> None:
    class SpikeTask(NaNTask):
        def loss(self, model, batch):
            self.calls += 1
            loss, n = self.inner.loss(model, batch)
            return (loss * 50 if self.calls == self.bad_from else loss), n

    cfg = small_config(
        corpus_dir, steps=26, eval_every=26, save_every=26, optim=OptimConfig(lr=1e-4, fused=False)
    )
    trainer = Trainer(cfg, tmp_path / "s", SpikeTask(bad_from=24), progress=False)
    trainer.fit()
    records = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    spikes = [r for r in records if r["kind"] == "spike"]
    assert [r["step"] for r in spikes] == [24], spikes
    assert spikes[0]["loss"] > 3 * spikes[0]["running_mean"] > 0
    assert trainer.state.step == 26 and trainer.state.skipped_steps == 0
    off = Trainer(cfg.replace(spike_factor=0.0), tmp_path / "s0", SpikeTask(bad_from=24), progress=False)
    off.fit()
    assert not [x for x in (tmp_path / "s0" / "metrics.jsonl").read_text().splitlines() if '"spike"' in x]


def test_distributed_checkpoint_without_its_index_is_skipped_and_refused(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """B1 for the torch.distributed.checkpoint format (here written by one process)."""
    from tformer.runs import load_run
    from tformer.train.checkpoint import CheckpointError, latest_checkpoint
    from tformer.train.config import ParallelConfig

    cfg = small_config(
        corpus_dir, steps=2, save_every=1, eval_every=2, parallel=ParallelConfig(checkpoint="dcp")
    )
    Trainer(cfg, tmp_path / "d", make_task("lm"), progress=False).fit()
    first, second = (tmp_path / "d" / "checkpoints" / f"step_00000{i}" for i in (1, 2))
    assert latest_checkpoint(tmp_path / "d") == second
    (second / ".metadata").unlink()  # the writers "died" after the manifest, before DCP's index
    assert latest_checkpoint(tmp_path / "d") == first
    with pytest.raises(
        CheckpointError, match=r"step_000002: distributed \(DCP\) checkpoint without its .metadata"
    ):
        load_run(second)
    assert load_run(tmp_path / "d").step == 1
    with pytest.raises(CheckpointError, match="step_000002 is not a committed checkpoint"):
        Trainer(cfg.replace(steps=3), tmp_path / "d", make_task("lm"), resume=True, progress=False)
    second.rename(tmp_path / "damaged")  # what the message asks for
    resumed = Trainer(cfg.replace(steps=3), tmp_path / "d", make_task("lm"), resume=True, progress=False)
    assert resumed.state.step == 1
    resumed.close()


@pytest.mark.parametrize("coef", [0.0, 0.05])
def test_moe_aux_loss_is_logged_and_part_of_the_objective(
    corpus_dir: Path, tmp_path: Path, coef: float
) -> None:
    """RELIABILITY E9: coefficient 0 -> the aux term is exactly 0; > 0 -> finite, logged, and it alone
    moves the router (the task loss is zeroed here)."""
    from tformer.config import MoEConfig

    base = small_config(corpus_dir)
    moe = MoEConfig(n_experts=4, top_k=2, aux_loss_coef=coef, bias_update_rate=0.0)
    cfg = base.replace(model=base.model.replace(moe=moe, dropout=0.0), steps=2, eval_every=2, save_every=2)
    Trainer(cfg, tmp_path / "m", make_task("lm"), progress=False).fit()
    records = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    aux = [r["aux_loss"] for r in records if r["kind"] == "train"]
    assert len(aux) == 2 and all(math.isfinite(a) for a in aux)
    assert all(a == 0.0 for a in aux) if coef == 0 else all(a > 0 for a in aux)

    trainer = Trainer(cfg, tmp_path / "z", make_task("lm"), progress=False)

    def no_task_loss(model, batch):
        loss, n = trainer.task.loss(model, batch)
        return loss * 0, n

    r = one_step(trainer, no_task_loss)  # the only gradient left is the aux loss's
    assert (r.grad_norm > 0) == (coef > 0), r.grad_norm


def test_distributed_checkpoint_retention_keeps_the_newest(corpus_dir: Path, tmp_path: Path) -> None:
    """B4 for the DCP format: keep_last=2 after 5 saves leaves the 2 newest committed directories."""
    from tformer.train.checkpoint import list_checkpoints
    from tformer.train.config import ParallelConfig

    cfg = small_config(
        corpus_dir,
        steps=5,
        save_every=1,
        eval_every=5,
        keep_last=2,
        parallel=ParallelConfig(checkpoint="dcp"),
    )
    Trainer(cfg, tmp_path / "k", make_task("lm"), progress=False).fit()
    kept = list_checkpoints(tmp_path / "k")
    assert [p.name for p in kept] == ["step_000004", "step_000005"]
    assert all((p / ".metadata").is_file() for p in kept)
    assert sorted(p.name for p in (tmp_path / "k" / "checkpoints").iterdir()) == [
        "step_000004",
        "step_000005",
    ]


def test_a_resume_with_more_steps_lays_the_schedule_over_them_from_the_next_step(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """The first resumed step had run at the old schedule's rate (its floor), the next ones jumped to the
    new schedule's; now every resumed step runs at the new schedule's rate, and a warning says so."""
    cfg = small_config(corpus_dir, optim=OptimConfig(lr=1e-2, warmup_steps=2, fused=False, min_lr_ratio=0.1))
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit()
    longer = cfg.replace(steps=16)
    with pytest.warns(UserWarning, match=r"steps 8 -> 16: the cosine schedule now spans 16 steps, so step 9"):
        Trainer(longer, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    assert lr[8] == pytest.approx(1e-3)  # the first schedule's floor
    for step in range(9, 17):
        assert lr[step] == pytest.approx(1e-2 * lr_factor(step - 1, 16, longer.optim)), step
    with pytest.raises(
        ValueError, match=r"the run is at step 16 \(step_000016\); steps=12 would end before it"
    ):
        Trainer(cfg.replace(steps=12), tmp_path / "r", make_task("lm"), resume=True, progress=False)
    assert json.loads((tmp_path / "r" / "config.json").read_text())["steps"] == 16  # untouched


def test_a_warm_up_as_long_as_the_run_is_named(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=2, optim=OptimConfig(lr=1e-2, warmup_steps=4, fused=False))
    with pytest.warns(UserWarning, match=r"warmup_steps 4 >= steps 2: the cosine schedule never decays"):
        Trainer(cfg, tmp_path / "w", make_task("lm"), progress=False).close()


def test_a_test_split_too_short_to_score_is_said_before_training(tmp_path: Path) -> None:
    """It had been found only by `tformer eval --split test`, after the training."""
    from tformer.data import load_corpus

    folder = tmp_path / "c"
    folder.mkdir()
    for i in range(8):  # long files; then a tiny one, renamed until the hash split puts it alone in test
        (folder / f"{i}.txt").write_text(f"text number {i} " + "many words here " * 200)
    for salt in range(500):
        (folder / "tiny.txt").write_text(f"w{salt}")
        corpus = load_corpus(f"text:{folder}")
        if [d.id for d in corpus["test"]] == ["tiny.txt"]:
            break
    else:
        pytest.fail("no salt put the tiny file alone in the test split")
    with pytest.warns(
        UserWarning,
        match=r"the test split of 'text:.*' is \d+ tokens, too few for one window.*will not score",
    ):
        Trainer(small_config(folder, steps=1), tmp_path / "s", make_task("lm"), progress=False).close()


def test_a_split_too_short_for_one_window_is_named(tmp_path: Path) -> None:
    for i in range(40):  # one long file per name; the val split (by hash) gets one of the short ones
        (tmp_path / "c" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "c" / f"{i:02d}.txt").write_text(("many words here " * 200) if i % 2 else f"w{i}\n")
    cfg = small_config(tmp_path / "c", steps=1)
    from tformer.data import load_corpus

    short = [s for s in ("val", "test") if all(len(t) < 10 for t in load_corpus(cfg.data.corpus).texts(s))]
    assert short, "the corpus above must leave a held-out split of short files"
    with pytest.raises(
        ValueError, match=rf"the {short[0]} split of 'text:.*' is \d+ tokens, too few for one window"
    ):
        trainer = Trainer(cfg, tmp_path / "s", make_task("lm"), progress=False)
        try:
            trainer.task.split_dataset(short[0])
        finally:
            trainer.close()


def test_a_relative_data_path_is_recorded_absolute(corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A run trained on `text:notes/` had recorded the path as typed: a resume or `tformer eval` started
    in another directory looked for the data there."""
    from tformer.runs import load_run

    monkeypatch.chdir(corpus_dir.parent)
    cfg = small_config(Path(corpus_dir.name), steps=2, save_every=2)
    assert cfg.data.corpus == f"text:{corpus_dir.name}"
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit()
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["data"]["corpus"]
    assert saved == f"text:{corpus_dir}"
    monkeypatch.chdir(tmp_path)  # elsewhere: the run's own config finds the data
    assert load_run(tmp_path / "r").train_config.data.corpus == saved
    longer = TrainConfig.load(tmp_path / "r" / "config.json").replace(steps=3)
    assert Trainer(longer, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()["step"] == 3
