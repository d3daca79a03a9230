"""One optimizer step: micro-batches -> loss -> backward -> guard -> clip -> step.

The loss of a step is the sum of token losses over all its micro-batches divided by the step's total
target count (known before any backward), so gradient accumulation gives exactly the gradient of the
whole batch. MoE balance losses come in through `tformer.model.moe.moe_aux_loss`, the one channel.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from tformer.model.moe import moe_aux_loss, update_expert_biases


class LossFn(Protocol):
    def __call__(self, model: nn.Module, batch: Any) -> tuple[Tensor, int]:
        """(sum of per-target losses, number of targets) of one micro-batch."""


@dataclass
class StepResult:
    loss: float  # task loss per target (nats), averaged over the step's targets
    aux_loss: float  # MoE balance losses added to the objective
    grad_norm: float  # before clipping
    targets: int
    skipped: bool


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


def autocast_context(device: torch.device, dtype: str):
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    model: nn.Module,
    loss_fn: LossFn,
    micro_batches: list[Any],
    count_targets,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
    autocast,
) -> StepResult:
    total = max(1, sum(count_targets(b) for b in micro_batches))
    loss_sum, aux_sum = 0.0, 0.0
    for batch in micro_batches:
        with autocast:
            task_loss, _ = loss_fn(model, batch)
            aux = moe_aux_loss(model) / len(micro_batches)
            loss = task_loss / total + aux
        loss.backward()
        loss_sum += task_loss.item()
        aux_sum += float(aux)
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    else:
        grad_norm = (
            float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0
        )
    skipped = not (math.isfinite(loss_sum) and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
        update_expert_biases(model)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return StepResult(loss_sum / total, aux_sum, grad_norm, total, skipped)
