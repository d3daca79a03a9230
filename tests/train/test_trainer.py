"""The trainer's steps: learning, the non-finite guard, gradient accumulation, bf16, clipping, loss spikes,
MoE losses. Resuming a run: test_resume.py."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.train.helpers import small_config
from tformer.tasks import make_task
from tformer.train.checkpoint import latest_checkpoint
from tformer.train.config import OptimConfig
from tformer.train.loop import Trainer
from tformer.train.presets import get_train_preset
from tformer.train.step import NonFiniteError


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
    for after_close in (trainer.evaluate, trainer.sample):  # had raised AttributeError on None
        with pytest.raises(RuntimeError, match="this Trainer is closed"):
            after_close()


def test_one_task_object_serves_one_run(corpus_dir: Path, tmp_path: Path) -> None:
    """A task holds its run's data and tokenizer: a second Trainer on another directory with the same task
    object had swapped them under the first run (its checkpoint saved the other run's tokenizer)."""
    task = make_task("lm")
    first = Trainer(small_config(corpus_dir, steps=1, save_every=1), tmp_path / "a", task, progress=False)
    with pytest.raises(
        ValueError, match=r"this task object holds the data and tokenizer of the run in .*a; give"
    ):
        Trainer(small_config(corpus_dir, steps=1).replace(seed=1), tmp_path / "b", task, progress=False)
    assert not (tmp_path / "b").exists() and task.run_dir == tmp_path / "a"
    first.fit()
    first.close()
    again = Trainer(small_config(corpus_dir, steps=2, save_every=1), tmp_path / "a", task, resume=True, progress=False)  # fmt: skip
    assert again.state.step == 1  # the same run, resumed with its own task: fine
    again.close()


def test_an_evaluation_that_fails_saves_its_step_first(corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """An error in the evaluation at step 3 (a model whose outputs went NaN, say) had lost every step since
    the last checkpoint: the step is saved, said in a warning, and the error still stops the run."""
    cfg = small_config(corpus_dir, steps=8, eval_every=3, save_every=100)
    trainer = Trainer(cfg, tmp_path / "run", "lm", progress=False)

    def fail():
        raise ValueError("the model's next-token logits are NaN or infinite")

    monkeypatch.setattr(trainer, "evaluate", fail)
    saved = r"evaluation at step 3 failed \(below\); the step itself is saved: .*step_000003"
    with (
        pytest.warns(UserWarning, match=saved),
        pytest.raises(ValueError, match="logits are NaN or infinite"),
    ):
        trainer.fit()
    trainer.close()
    assert latest_checkpoint(tmp_path / "run").name == "step_000003"
    resumed = Trainer(cfg, tmp_path / "run", "lm", resume=True, progress=False)
    assert resumed.state.step == 3
    resumed.fit()  # the evaluation of step 3 is made first (it had been missing from the log for good)
    resumed.close()
    straight = tmp_path / "straight"
    Trainer(cfg, straight, "lm", progress=False).fit()

    def evals(run: Path) -> list[dict]:
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [
            {k: v for k, v in r.items() if k != "time_s"} for r in records if r["kind"] in ("eval", "train")
        ]

    assert [r["step"] for r in evals(tmp_path / "run") if r["kind"] == "eval"] == [3, 6, 8]
    assert [(r["kind"], r["step"], r.get("loss"), r.get("eval_loss")) for r in evals(tmp_path / "run")] == [
        (r["kind"], r["step"], r.get("loss"), r.get("eval_loss")) for r in evals(straight)
    ]  # the same records, the same values, as a run that never failed


def test_evaluate_keeps_the_models_mode(corpus_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(small_config(corpus_dir, steps=1, save_every=1), tmp_path / "m", "lm", progress=False)
    for training in (False, True):  # evaluation had left the model in training mode, whatever it was in
        trainer.model.train(training)
        assert trainer.evaluate()["eval_loss"] > 0
        assert trainer.model.training is training
    trainer.close()


def test_tokens_per_second_leaves_out_evaluations_and_saves(
    corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """tokens/s had divided by the time since the start, evaluations, samples and checkpoints included: a
    run that evaluates often showed a fraction of its training speed."""
    cfg = small_config(corpus_dir, steps=4, eval_every=1, save_every=2, log_every=1)
    trainer = Trainer(cfg, tmp_path / "run", "lm", progress=False)
    evaluate = trainer.evaluate

    def slow_evaluate():
        time.sleep(1.0)
        return evaluate()

    monkeypatch.setattr(trainer, "evaluate", slow_evaluate)
    trainer.fit()
    trainer.close()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "train"][-1]
    assert last["step"] == 4 and [r["step"] for r in records if r["kind"] == "eval"] == [1, 2, 3, 4]
    # three evaluations (>= 3 s) ran before step 4's record; four tiny steps take far less than 1 s
    assert last["tokens_per_s"] > last["tokens_seen"] / 1.0, last


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
    """Wraps the LM task; its loss is NaN from step `bad_from` on, and at the steps in `bad_at`."""

    def __init__(self, bad_from: int = 10**9, bad_at: tuple[int, ...] = ()) -> None:
        self.inner, self.calls, self.bad_from, self.bad_at = make_task("lm"), 0, bad_from, bad_at

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def loss(self, model, batch):
        self.calls += 1
        loss, n = self.inner.loss(model, batch)
        return (loss * math.nan if self.calls >= self.bad_from or self.calls in self.bad_at else loss), n


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


def test_only_consecutive_nonfinite_steps_stop_the_run(corpus_dir: Path, tmp_path: Path) -> None:
    """A finite step resets the count: 5 bad steps in runs of 1 and 2 go on; the third in a row stops."""
    cfg = small_config(corpus_dir, max_nonfinite=3, steps=10, save_every=10)
    trainer = Trainer(cfg, tmp_path / "c", NaNTask(bad_at=(2, 4, 5, 7, 8, 9)), progress=False)
    with pytest.raises(NonFiniteError, match="step 9: 3 consecutive steps with a non-finite loss"):
        trainer.fit()
    assert trainer.state.skipped_steps == 6


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


def sgd_step_change(trainer: Trainer, micro: list) -> list[torch.Tensor]:
    """Minus the gradient one train_step applies, read as the weight change of plain SGD at lr 1 (the
    first AdamW update is g / (|g| + eps), which turns rounding in a tiny gradient into a large change)."""
    from tformer.train.step import autocast_context, train_step

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
    return [b - p.detach() for p, b in zip(trainer.model.parameters(), before)]


def test_gradient_accumulation_equals_the_big_batch(corpus_dir: Path, tmp_path: Path) -> None:
    """The loss is divided by the step's target count, not averaged per micro-batch: the first micro-batch
    scores half its targets (the rest IGNORE_INDEX), so the two readings differ."""
    from tformer.data.datasets import IGNORE_INDEX, collate_lm

    grads = []
    for accum, bs in ((1, 8), (2, 4)):
        cfg = small_config(
            corpus_dir,
            batch_size=bs,
            grad_accum=accum,
            model=small_config(corpus_dir).model.replace(dropout=0.0),
        )
        trainer = Trainer(cfg, tmp_path / f"g{accum}", make_task("lm"), progress=False)
        examples = [trainer.task.train_ds[i] for i in range(8)]
        half = examples[0][1].shape[0] // 2
        examples = [(x, y.clone().index_fill_(0, torch.arange(half), IGNORE_INDEX) if i < 4 else y) for i, (x, y) in enumerate(examples)]  # fmt: skip
        micro = [collate_lm(examples[j * bs : (j + 1) * bs]) for j in range(accum)]
        assert accum == 1 or trainer.task.count_targets(micro[0]) * 2 == trainer.task.count_targets(micro[1])
        grads.append(sgd_step_change(trainer, micro))
    assert max(float(g.abs().max()) for g in grads[0]) > 1e-3  # gradients that the tolerance can see
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_moe_aux_loss_is_averaged_over_micro_batches(corpus_dir: Path, tmp_path: Path) -> None:
    """A batch given as two equal micro-batches steps as the batch whole: each micro-batch's balance loss
    equals the whole one's (the same routing fractions), so the step takes their mean, not their sum."""
    from tformer import MoEConfig
    from tformer.data.datasets import collate_lm

    moe = MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.5, seq_aux_loss_coef=0.5)
    grads = []
    for accum in (1, 2):
        model = small_config(corpus_dir).model.replace(dropout=0.0, moe=moe)
        cfg = small_config(corpus_dir, batch_size=4 // accum, grad_accum=accum, model=model)
        trainer = Trainer(cfg, tmp_path / f"m{accum}", make_task("lm"), progress=False)
        half = [trainer.task.train_ds[i] for i in range(2)]
        micro = [collate_lm(half + half)] if accum == 1 else [collate_lm(half), collate_lm(half)]
        grads.append(sgd_step_change(trainer, micro))
    router_grads = [g for g, (name, _) in zip(grads[0], trainer.model.named_parameters()) if "router" in name]
    assert router_grads and max(float(g.abs().max()) for g in router_grads) > 1e-4
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
    trainer.close()

    # in a run: the skip is counted and logged, and the run goes on (C5: skip counter + 1)
    cfg = small_config(corpus_dir, steps=3, eval_every=100, save_every=100)
    run = Trainer(cfg, tmp_path / "run", make_task("lm"), progress=False)
    param = next(run.model.parameters())
    task_loss, calls = run.task.loss, []

    def inf_at_step_2(model, batch):
        calls.append(1)
        loss, n = task_loss(model, batch)
        return (loss + Inf.apply(param), n) if len(calls) == 2 else (loss, n)

    run.task.loss = inf_at_step_2
    report = run.fit()
    run.close()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skips = [r for r in records if r["kind"] == "skip"]
    assert run.state.skipped_steps == 1 and report["step"] == 3
    assert [r["step"] for r in skips] == [2] and math.isfinite(skips[0]["loss"])
    assert skips[0]["grad_norm"] == math.inf  # written as Infinity, read back as inf


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


def grad_norm(optimizer: torch.optim.Optimizer) -> float:
    """The global norm of the gradients an optimizer is about to apply."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def test_clipping_bounds_the_norm_the_optimizer_sees(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, model=small_config(corpus_dir).model.replace(dropout=0.0))
    trainer = Trainer(cfg, tmp_path / "c", make_task("lm"), progress=False)
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(grad_norm(self))
            return super().step(closure)

    spy = Spy(trainer.model.parameters(), lr=0.0)
    batch = trainer.loader.next_batch(trainer.device)
    unclipped = one_step(trainer, optimizer=spy, batch=batch, grad_clip=0.0)
    max_norm = unclipped.grad_norm / 4
    clipped = one_step(trainer, optimizer=spy, batch=batch, grad_clip=max_norm)
    assert clipped.grad_norm == pytest.approx(unclipped.grad_norm, rel=1e-5)  # the pre-clip norm is logged
    assert seen[0] == pytest.approx(unclipped.grad_norm, rel=1e-5)
    assert seen[1] <= max_norm + 1e-6 and seen[1] == pytest.approx(max_norm, rel=1e-4)


def test_the_trainer_clips_at_the_configured_norm(corpus_dir: Path, tmp_path: Path) -> None:
    for clip in (1e-3, 0.0):  # 0: no clipping, the raw norm (well above 1e-3 at the first step)
        cfg = small_config(corpus_dir, steps=1, save_every=1, optim=OptimConfig(grad_clip=clip, fused=False))
        trainer = Trainer(cfg, tmp_path / f"clip{clip}", make_task("lm"), progress=False)
        seen, step = [], trainer.optimizer.step

        def spy(*args, _step=step, _opt=trainer.optimizer, seen=seen, **kwargs):
            seen.append(grad_norm(_opt))
            return _step(*args, **kwargs)

        trainer.optimizer.step = spy
        trainer.fit()
        logged = [
            json.loads(x) for x in (tmp_path / f"clip{clip}" / "metrics.jsonl").read_text().splitlines()
        ]
        norm = next(r["grad_norm"] for r in logged if r["kind"] == "train")  # before clipping
        assert len(seen) == 1 and norm > 0.01
        assert seen[0] == pytest.approx(clip if clip else norm, rel=1e-4)


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
        """x50 at step 24 and at step 5 (inside the 20-step warm-up: not flagged); NaN at step 12 (skipped,
        left out of the running mean, which would otherwise be NaN and flag nothing again)."""

        def loss(self, model, batch):
            self.calls += 1
            loss, n = self.inner.loss(model, batch)
            return (loss * 50 if self.calls in (5, self.bad_from) else loss * math.nan if self.calls == 12 else loss), n  # fmt: skip

    cfg = small_config(
        corpus_dir, steps=26, eval_every=26, save_every=26, optim=OptimConfig(lr=1e-4, fused=False)
    )
    trainer = Trainer(cfg, tmp_path / "s", SpikeTask(bad_from=24), progress=False)
    trainer.fit()
    records = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    spikes = [r for r in records if r["kind"] == "spike"]
    assert [r["step"] for r in spikes] == [24], spikes
    assert spikes[0]["loss"] > 3 * spikes[0]["running_mean"] > 0
    assert trainer.state.step == 26 and trainer.state.skipped_steps == 1
    losses = [r["loss"] for r in records if r["kind"] == "train" and r["step"] < 24]  # logged every step
    assert len(losses) == 23 and math.isnan(losses.pop(11))  # steps 1-23; 12 skipped
    mean = losses[0]
    for loss in losses[1:]:  # the EMA of the finite losses before the spike, decay 0.95
        mean = 0.95 * mean + 0.05 * loss
    assert spikes[0]["running_mean"] == pytest.approx(mean, rel=1e-9)
    off = Trainer(cfg.replace(spike_factor=0.0), tmp_path / "s0", SpikeTask(bad_from=24), progress=False)
    off.fit()
    assert not [x for x in (tmp_path / "s0" / "metrics.jsonl").read_text().splitlines() if '"spike"' in x]


def test_distributed_checkpoint_without_its_index_is_skipped_and_refused(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """B1 for the torch.distributed.checkpoint format (here written by one process)."""
    from tformer.runs import load_run
    from tformer.train.checkpoint import CheckpointError
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


def test_a_dead_expert_is_logged_per_layer_over_the_logging_window(corpus_dir: Path, tmp_path: Path) -> None:
    """RELIABILITY E4: an expert no token reaches is listed under each MoE layer's `dead_experts` in every
    train record, counted over the steps since the previous record; the others are not."""
    from tformer.config import MoEConfig

    base = small_config(corpus_dir)
    moe = MoEConfig(n_experts=4, top_k=2, bias_update_rate=0.0)
    model = base.model.replace(moe=moe, dropout=0.0, n_layers=2)
    cfg = base.replace(model=model, steps=4, log_every=2, eval_every=4, save_every=4)
    trainer = Trainer(cfg, tmp_path / "d", make_task("lm"), progress=False)
    with torch.no_grad():
        for module in trainer.model.modules():
            if hasattr(module, "expert_bias"):
                module.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -1e4]))  # expert 3 never chosen
    trainer.fit()
    records = [json.loads(x) for x in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["moe"] for r in records if r["kind"] == "train"]
    assert len(logged) == 2 and all(len(layers) == 2 for layers in logged)  # steps 2 and 4, both layers
    tokens = cfg.batch_size * cfg.data.seq_len
    for layers in logged:
        for stats in layers.values():
            assert stats["dead_experts"] == [3]
            assert stats["window_tokens"] == 2 * tokens * moe.top_k  # two steps' assignments


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


def test_a_warm_up_as_long_as_the_run_is_named(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=2, optim=OptimConfig(lr=1e-2, warmup_steps=2, fused=False))
    with pytest.warns(UserWarning, match=r"warmup_steps 2 >= steps 2: the cosine schedule never decays"):
        Trainer(cfg, tmp_path / "w", make_task("lm"), progress=False).close()


@pytest.mark.parametrize(
    ("schedule", "warmup", "said"),
    [
        (
            "constant",
            4,
            "the constant schedule never reaches optim.lr (the last step runs at 0.5 x optim.lr)",
        ),
        ("cosine", 4, "the cosine schedule never reaches optim.lr nor decays (the last step runs at 0.5 x"),
        # below min_lr_ratio (0.1), where the check for a schedule that never decays had said nothing
        (
            "cosine",
            100,
            "the cosine schedule never reaches optim.lr nor decays (the last step runs at 0.02 x",
        ),
        ("wsd", 100, "the wsd schedule never reaches optim.lr nor decays (the last step runs at 0.02 x"),
    ],
)
def test_a_warm_up_that_outlasts_the_run_is_named(
    corpus_dir: Path, tmp_path: Path, schedule: str, warmup: int, said: str
) -> None:
    optim = OptimConfig(lr=1e-2, schedule=schedule, warmup_steps=warmup, fused=False)
    with pytest.warns(UserWarning, match=re.escape(f"warmup_steps {warmup} > steps 2: {said}")):
        Trainer(
            small_config(corpus_dir, steps=2, optim=optim), tmp_path / "c", make_task("lm"), progress=False
        ).close()


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


def test_a_train_text_cut_by_max_train_docs_says_so(corpus_dir: Path, tmp_path: Path) -> None:
    """The count is of the documents data.max_train_docs keeps: it had read as the whole split's."""
    cfg = small_config(corpus_dir, steps=1)
    cfg = cfg.replace(
        data=cfg.data.replace(max_train_docs=1, seq_len=30000), model=cfg.model.replace(max_seq_len=30000)
    )
    with pytest.raises(
        ValueError,
        match=r"the train split of 'text:.*' \(its first 1 document\(s\), data.max_train_docs\) is",
    ):
        Trainer(cfg, tmp_path / "s", make_task("lm"), progress=False)


def test_eval_of_the_train_split_scores_what_the_run_trained_on(
    corpus_dir: Path, tmp_path: Path, capsys
) -> None:
    """`tformer eval --split train` of a run with data.max_train_docs scores those documents (it had scored
    the whole split)."""
    from tformer.cli.main import main

    cfg = small_config(corpus_dir, steps=1, save_every=1)
    cfg = cfg.replace(data=cfg.data.replace(max_train_docs=2))
    trainer = Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False)
    trainer.fit()
    trained = len(trainer.task.train_ds)
    trainer.close()
    capsys.readouterr()
    assert (
        main(["eval", "--run", str(tmp_path / "r"), "--split", "train", "--json", "--max-batches", "1000"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["windows"] == trained


def test_a_new_run_warns_of_settings_it_does_not_use(corpus_dir: Path, tmp_path: Path) -> None:
    """Kept (one setting switches their component back on) but never silently dropped."""
    cfg = small_config(corpus_dir, steps=1)
    cfg = cfg.replace(
        model=cfg.model.replace(positions="sinusoidal", rope=cfg.model.rope.replace(theta=5e5)),
        optim=cfg.optim.replace(schedule="constant", min_lr_ratio=0.5, decay_frac=0.3),
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Trainer(cfg, tmp_path / "run", "lm", progress=False).close()
    said = [str(w.message) for w in seen if "is not used by this run" in str(w.message)]
    assert said == [
        "model.rope.theta (500000.0: model.positions is 'sinusoidal', not 'rope') is not used by this run",
        "optim.min_lr_ratio (0.5: the constant schedule never decays) is not used by this run",
        "optim.decay_frac (0.3: read by schedule 'wsd' only, not 'constant') is not used by this run",
    ]
    with warnings.catch_warnings(record=True) as seen:  # the same values where they are read: no warning
        warnings.simplefilter("always")
        used = small_config(corpus_dir, steps=1)
        Trainer(used.replace(optim=used.optim.replace(schedule="wsd", decay_frac=0.3)), tmp_path / "b", "lm",
                progress=False).close()  # fmt: skip
    assert not [w for w in seen if "is not used by this run" in str(w.message)]


def test_a_new_run_names_the_model_sizes_its_task_replaces(corpus_dir: Path, tmp_path: Path) -> None:
    """The task sizes the vocabulary by the tokenizer it trains and the context by data.seq_len: a
    `--set model.vocab_size=...` is replaced, and `tformer train` says so and names the setting that
    does. A preset's own values are not the user's (`--set data.vocab_size` alone says nothing), and a
    resumed run does not repeat it."""
    from tformer.cli.main import main
    from tformer.train.config import replaced_model_settings

    base = ["train", "--preset", "tiny-lm", "--no-progress", "--no-sample", "--set", f"data.corpus=text:{corpus_dir}",
            "--set", "data.vocab_size=300", "--set", "data.seq_len=32", "--set", "steps=2", "--set", "save_every=1",
            "--set", "eval_batches=1", "--set", "optim.warmup_steps=1"]  # fmt: skip
    sizes = ["--set", "model.vocab_size=1000", "--set", "model.max_seq_len=16"]
    said = [
        "model.vocab_size 1,000 is replaced by the tokenizer's 300 tokens: data.vocab_size sets the vocabulary",
        "model.max_seq_len 16 is raised to 32 to hold data.seq_len's sequences",
    ]

    def warned(argv: list[str]) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert main(argv) == 0
        return [str(w.message) for w in seen if str(w.message).startswith("model.")]

    assert warned([*base, *sizes, "--out", str(tmp_path / "run")]) == said
    assert warned([*base, *sizes, "--set", "steps=3", "--out", str(tmp_path / "run"), "--resume"]) == []
    assert (
        warned([*base, "--out", str(tmp_path / "preset")]) == []
    )  # the preset's 512 replaced: not the user's
    cfg = small_config(corpus_dir)
    # a tokenizer that learned fewer tokens than data.vocab_size says so itself, once
    assert replaced_model_settings(cfg, cfg.model.replace(vocab_size=281), {"model.vocab_size"}) == []


def test_the_source_vocabulary_the_translation_task_replaces_is_named() -> None:
    """model.src_vocab_size comes from the source tokenizer (separate) or is the target's (joint)."""
    from tformer.train.config import replaced_model_settings

    cfg = get_train_preset("translation")
    cfg = cfg.replace(model=cfg.model.replace(share_embeddings=False))
    given = cfg.model
    keys = {"model.src_vocab_size"}
    assert replaced_model_settings(cfg, given, keys) == []
    joint = replaced_model_settings(cfg.replace(model=given.replace(src_vocab_size=999)), given, keys)
    assert replaced_model_settings(cfg.replace(model=given.replace(src_vocab_size=999)), given, ()) == []
    assert joint == [
        "model.src_vocab_size 999 is replaced: the source vocabulary shares the target's (data.tokenizer "
        "'joint'); data.src_vocab_size sets it"
    ]
    separate = replaced_model_settings(
        cfg.replace(model=given.replace(src_vocab_size=999)), given.replace(src_vocab_size=3000), keys
    )
    assert separate == [
        "model.src_vocab_size 999 is replaced: the source vocabulary is the source tokenizer's 3,000 tokens; "
        "data.src_vocab_size sets it"
    ]


def test_a_run_inside_a_checkpoint_or_named_as_one_is_refused(corpus_dir: Path, tmp_path: Path) -> None:
    """A run written into another run's checkpoint had mixed its files with the checkpoint's (loading
    either read the other's weights), and the outer run's keep_last pruning later deleted it. A folder
    named as a step the outer run would save is refused too, as are the run's checkpoints/ folder itself
    (`--run` of it means the run) and its tensorboard/ folder and what lies in it (TensorBoard reads
    subfolders); anything else in or beside a run's checkpoints folder is an ordinary directory (a project
    keeping its runs under checkpoints/)."""
    cfg = small_config(corpus_dir, steps=2, save_every=1)
    outer = Trainer(cfg, tmp_path / "a", "lm", progress=False)
    outer.fit()
    outer.close()
    checkpoints = sorted((tmp_path / "a" / "checkpoints").iterdir())
    listing = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "a").rglob("*"))
    for out, said in (
        (checkpoints[-1], f"is the checkpoint {checkpoints[-1]}: its files would mix"),
        (checkpoints[0] / "sub", f"lies inside the checkpoint {checkpoints[0]}: its files would mix"),
        (tmp_path / "a" / "checkpoints" / "step_000009", f"is named as a checkpoint of the run in {tmp_path / 'a'}"),
        (tmp_path / "a" / "checkpoints", f"is the checkpoints/ folder of the run in {tmp_path / 'a'}: the new run's files would mix with its checkpoints"),
        (tmp_path / "a" / "tensorboard", f"is the tensorboard/ folder of the run in {tmp_path / 'a'}: the new run's files would mix with its TensorBoard logs"),
        (tmp_path / "a" / "tensorboard" / "b", f"lies inside the tensorboard/ folder of the run in {tmp_path / 'a'}"),
    ):  # fmt: skip
        for resume in (False, True):
            with pytest.raises(ValueError, match=re.escape(said)):
                Trainer(cfg, out, "lm", progress=False, resume=resume)
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "a").rglob("*")) == listing
    project = tmp_path / "project"  # a config.json of a run's shape kept by the user, no run started there
    project.mkdir()
    shutil.copy(tmp_path / "a" / "config.json", project / "config.json")
    for ordinary in (
        tmp_path / "a" / "sub",
        tmp_path / "a" / "checkpoints" / "b",
        tmp_path / "checkpoints" / "r",
        project / "checkpoints",
        project / "tensorboard" / "r",
    ):
        Trainer(cfg, ordinary, "lm", progress=False).close()  # fmt: skip


def test_a_run_inside_its_data_folder_is_refused(corpus_dir: Path, tmp_path: Path) -> None:
    """Its checkpoints and logs would be scanned as data by every later load (a resume, an evaluation)."""
    before = sorted(p.name for p in corpus_dir.iterdir())
    for out in (corpus_dir / "run", corpus_dir, corpus_dir / "runs" / "a"):
        with pytest.raises(ValueError, match=r"lies inside the data folder .*: its checkpoints and logs"):
            Trainer(small_config(corpus_dir, steps=1), out, "lm", progress=False)
    assert sorted(p.name for p in corpus_dir.iterdir()) == before  # nothing written there
    Trainer(small_config(corpus_dir, steps=1), tmp_path / "beside", "lm", progress=False).close()


def test_with_a_progress_bar_evaluations_are_written_above_it(
    corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Through the bar's write (which clears and redraws it): printed past it, a stale copy of the bar had
    stayed above each evaluation line; each redraw shows its own step's numbers."""
    from tqdm import tqdm

    written: list[str] = []
    real_write = tqdm.write
    monkeypatch.setattr(
        tqdm, "write", classmethod(lambda cls, s, *a, **k: written.append(s) or real_write(s, *a, **k))
    )
    cfg = small_config(corpus_dir, steps=4, eval_every=2, save_every=4)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=True).fit()
    evals = [line for line in written if ": eval_loss" in line]
    assert [line.split(":")[0] for line in evals] == ["step 2", "step 4"]
