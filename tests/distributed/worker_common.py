"""What the distributed test workers share: the LM batches and the train_step arguments of the parity
checks, the MoE model config they train, and gathering a tensor whole."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tformer.config import MoEConfig
from tformer.presets import tiny
from tformer.tasks.lm import lm_loss_sum


def moe_model_cfg(**moe):
    moe = {"n_experts": 4, "top_k": 2, "aux_loss_coef": 0.0, "bias_update_rate": 0.01, **moe}
    return tiny().replace(d_model=32, d_ff=32, n_heads=2, vocab_size=64, moe=MoEConfig(**moe))


def full(t: torch.Tensor, sliced: bool, group=None, width: tuple | None = None) -> torch.Tensor:
    """The whole tensor on every rank: DTensors gathered, expert-parallel slices concatenated over
    `group` (the ranks the experts are split over; None: all), after their width slices over a tensor-
    parallel group (`width`: (dim, group), or None where each rank holds whole experts)."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    if width is not None:
        dim, width_group = width
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(width_group))]
        dist.all_gather(parts, t.contiguous(), group=width_group)
        t = torch.cat(parts, dim)
    if sliced:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)
    return t


B, T = 2, 8  # per-rank batch


class Batch:
    def __init__(self, ids, targets):
        self.ids, self.targets = ids, targets


def global_batch(world: int, step: int) -> Batch:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 64, (world * B, T + 1), generator=g)
    return Batch(ids[:, :-1], ids[:, 1:])


def rank_part(batch: Batch, rank: int) -> Batch:
    return Batch(batch.ids[rank * B : (rank + 1) * B], batch.targets[rank * B : (rank + 1) * B])


def max_diff(model, ref, sliced: set[str] | dict[str, tuple | None], what: str, group=None) -> float:
    """Largest difference of `model`'s parameters (or gradients) from `ref`'s, each read whole; `sliced`:
    the expert-parallel slices (a dict: each with its width split, see `full`)."""
    worst = 0.0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        mine = p.grad if what == "grad" else p.detach()
        want = ref_params[name].grad if what == "grad" else ref_params[name].detach()
        if mine is None:
            mine = torch.zeros_like(p)
        width = sliced.get(name) if isinstance(sliced, dict) else None
        worst = max(worst, float((full(mine, name in sliced, group, width) - want).abs().max()))
    return worst


def step_args(model, optimizer, comm=None) -> list:
    """train_step's arguments; [2] (the micro-batches) is filled in per step. Clipping at 0.05 is active."""
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = [model, lm_loss_sum, None, lambda b: int(b.targets.numel()), optimizer, sched, 0.05, nullcontext()]
    return args + ([comm] if comm is not None else [])
