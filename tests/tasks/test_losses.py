"""The task loss: summed cross-entropy with checked targets (ids outside the outputs get a clear error)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tformer.data.datasets import IGNORE_INDEX
from tformer.tasks.losses import cross_entropy_sum


def test_equals_torch_cross_entropy_over_the_counted_targets() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 16, generator=gen)
    targets = torch.randint(0, 16, (2, 5), generator=gen)
    targets[1, 3:] = IGNORE_INDEX
    loss, n = cross_entropy_sum(logits, targets, label_smoothing=0.1)
    want = F.cross_entropy(
        logits.flatten(0, 1),
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=0.1,
    )
    assert n == 8
    torch.testing.assert_close(loss, want)


@pytest.mark.parametrize("bad", [16, 40, -1, -99])
def test_target_outside_the_outputs_is_named(bad: int) -> None:
    targets = torch.zeros(2, 5, dtype=torch.long)
    targets[1, 3] = bad
    with pytest.raises(
        ValueError,
        match=rf"targets contains id {bad} at \(batch 1, position 3\); allowed ids are 0\.\.15 or -100",
    ):
        cross_entropy_sum(torch.zeros(2, 5, 16), targets)


def test_class_labels_are_checked_too() -> None:
    with pytest.raises(ValueError, match=r"labels contains id 5 at \(batch 2\); allowed ids are 0\.\.4"):
        cross_entropy_sum(torch.zeros(3, 5), torch.tensor([0, 4, 5]), name="labels")
    with pytest.raises(TypeError, match="labels must be a torch.long tensor"):
        cross_entropy_sum(torch.zeros(3, 5), torch.tensor([0.0, 1.0, 2.0]), name="labels")
    with pytest.raises(TypeError, match="got dtype torch.int32"):  # -100 and cross-entropy need int64
        cross_entropy_sum(torch.zeros(3, 5), torch.tensor([0, 1, 2], dtype=torch.int32), name="labels")


def test_every_target_ignored_sums_to_zero_not_nan() -> None:
    logits = torch.randn(2, 3, 8, requires_grad=True)
    loss, n = cross_entropy_sum(logits, torch.full((2, 3), IGNORE_INDEX))
    assert (loss.item(), n) == (0.0, 0)
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_an_all_padding_pair_adds_nothing_to_the_translation_loss() -> None:
    """RELIABILITY D6: a fully padded sample (source mask all False, every target ignored) gives finite
    outputs and contributes 0: the batch's loss and gradients equal those of the real pair alone."""
    from tformer.data.datasets import Seq2SeqBatch
    from tformer.model import build_model
    from tformer.presets import tiny
    from tformer.tasks.translation import seq2seq_loss_sum

    torch.manual_seed(0)
    model = build_model(tiny("encoder_decoder"))
    src = torch.tensor([[5, 6, 7, 2], [0, 0, 0, 0]])
    src_mask = src != 0
    tgt_in = torch.tensor([[1, 8, 9], [0, 0, 0]])
    tgt_out = torch.tensor([[8, 9, 2], [IGNORE_INDEX] * 3])
    both = Seq2SeqBatch(src, src_mask, tgt_in, tgt_out, tgt_out != IGNORE_INDEX)
    one = Seq2SeqBatch(*(t[:1] for t in both))
    losses, grads = [], []
    for batch in (both, one):
        model.zero_grad()
        loss, n = seq2seq_loss_sum(model, batch)
        loss.backward()
        losses.append((loss.item(), n))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert math.isfinite(losses[0][0]) and losses[0][1] == losses[1][1] == 3
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)  # batched sums: rounding only
    assert torch.isfinite(model(src, tgt_in, src_mask, None)).all()


OUTPUTS = {  # what each task's model predicts for a batch, and the targets it is scored on
    "lm": lambda model, b: (model(b.ids), b.targets),
    "translation": lambda model, b: (model(b.src, b.tgt_in, b.src_mask, None), b.tgt_out),
    "classification": lambda model, b: (model(b.ids, b.mask), b.labels),
}


@pytest.mark.parametrize("task", sorted(OUTPUTS))
def test_the_configured_label_smoothing_reaches_the_task_loss(
    task, dictionary_file, bbc_root, tmp_path
) -> None:
    from tformer.tasks import make_task
    from tformer.train.loop import Trainer
    from tformer.train.presets import tiny_classification, tiny_lm, tiny_translation

    cfg = {"lm": tiny_lm, "translation": tiny_translation, "classification": tiny_classification}[task]()
    path = {"translation": dictionary_file, "classification": bbc_root}.get(task)
    if path is not None:
        cfg = cfg.replace(data=cfg.data.replace(path=str(path)))
    trainer = Trainer(cfg.replace(label_smoothing=0.1), tmp_path / "run", make_task(task), progress=False)
    batch = trainer.loader.next_batch(trainer.device)
    model = trainer.model.eval()  # no dropout: the two forwards below see the same logits
    loss, n = trainer.task.loss(model, batch)
    logits, targets = OUTPUTS[task](model, batch)

    def torch_loss(smoothing: float) -> torch.Tensor:
        flat = logits.flatten(0, -2).float(), targets.flatten()
        return F.cross_entropy(*flat, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=smoothing)

    assert n == int((targets != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss, torch_loss(0.1))
    assert not torch.isclose(loss, torch_loss(0.0))  # the smoothing shows at this tolerance
    trainer.close()


def test_the_loss_plot_names_label_smoothing_for_every_task_that_reads_it() -> None:
    from types import SimpleNamespace

    from tformer.tasks import make_task

    for name, base in (
        ("lm", "nats / token"),
        ("translation", "nats / target token"),
        ("classification", "nats / text"),
    ):
        task = make_task(name)
        assert task.loss_unit == base  # before setup: no config
        task.cfg = SimpleNamespace(label_smoothing=0.1)
        assert task.loss_unit == f"{base}; train label-smoothed 0.1"
        task.cfg = SimpleNamespace(label_smoothing=0.0)
        assert task.loss_unit == base
