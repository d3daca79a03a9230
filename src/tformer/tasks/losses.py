"""The loss every task minimises: summed cross-entropy over the targets that count.

Targets are checked on the host first (`check_targets`): an id outside the model's outputs gets a
ValueError naming it, where torch's cross-entropy says only "Target 64 is out of bounds" on the CPU
and asserts on a GPU. Positions holding IGNORE_INDEX add nothing; a batch where every target is
ignored sums to 0 over 0 targets (the trainer divides by max(1, count), so its loss is 0, not NaN).
Under tensor parallelism a training step hands over logits split by vocabulary (a DTensor), and the
loss is computed from the pieces (tformer.distributed.vocab).
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor

from tformer.data.datasets import IGNORE_INDEX
from tformer.model.checks import check_targets, is_dtensor


def cross_entropy_sum(
    logits: Tensor, targets: Tensor, label_smoothing: float = 0.0, name: str = "targets"
) -> tuple[Tensor, int]:
    """(sum of the cross-entropy over the targets that are not IGNORE_INDEX, their count).

    logits (..., C) and targets (...) of the same leading shape; computed in fp32."""
    check_targets(targets, logits.shape[-1], name, ignore_index=IGNORE_INDEX)
    count = target_count(targets)
    if vocab_split(logits):  # a training step under tensor parallelism: logits split by vocabulary
        from tformer.distributed.vocab import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, targets, label_smoothing, IGNORE_INDEX), count
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing,
    )
    return loss, count


def target_count(targets: Tensor) -> int:
    """The targets that count (not IGNORE_INDEX)."""
    return int((targets != IGNORE_INDEX).sum())


def fuses_loss(cfg) -> bool:
    """Whether a training step of this TrainConfig takes its loss from the model's fused head
    (`fused_loss`), which needs the whole head on each rank: not under tensor parallelism, whose head
    splits the vocabulary and hands its logits to the vocabulary-parallel loss."""
    return cfg.fused_loss and cfg.parallel.tensor == 1


def vocab_split(logits: Tensor) -> bool:
    """A DTensor (only possible once torch.distributed.tensor is imported): the logits of a head split by
    vocabulary, kept split for the loss (tformer.distributed.vocab)."""
    return is_dtensor(logits)


def perplexity(loss: float) -> float:
    """exp(loss), inf past what a float holds (it had been capped at exp(50), which read as a number);
    NaN for a NaN loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def loss_unit(base: str, task: object) -> str:
    """loss.png's axis: the unit of the plotted loss (the evaluation's loss is plain cross-entropy; the
    training loss is label-smoothed where the run's config sets label_smoothing)."""
    smoothing = getattr(getattr(task, "cfg", None), "label_smoothing", 0.0)
    return base + (f"; train label-smoothed {smoothing:g}" if smoothing else "")
