"""The task loss: summed cross-entropy with checked targets (ids outside the outputs get a clear error)."""

from __future__ import annotations

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
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        cross_entropy_sum(torch.zeros(3, 5), torch.tensor([0.0, 1.0, 2.0]), name="labels")


def test_every_target_ignored_sums_to_zero_not_nan() -> None:
    logits = torch.randn(2, 3, 8, requires_grad=True)
    loss, n = cross_entropy_sum(logits, torch.full((2, 3), IGNORE_INDEX))
    assert (loss.item(), n) == (0.0, 0)
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
