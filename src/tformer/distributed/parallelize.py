"""Apply a ParallelPlan to a built model: expert parallelism, then DDP or FSDP2; and the collectives
one training step needs at that world size.

Gradient convention (the same at every world size): each rank's task loss is scaled by W / (global
target count), DDP and FSDP2 average over the W ranks, so every gradient is that of the summed loss
of all ranks' targets over their count, the gradient a single process would get on the union of the
ranks' batches. Expert-parallel weights get their gradient summed over ranks by the all-to-all's
backward, so a hook divides it by W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from tformer.distributed.env import Local
from tformer.distributed.expert_parallel import apply_expert_parallel
from tformer.distributed.plans import ParallelPlan
from tformer.model.moe import moe_layers, moe_routing_stats
from tformer.train.step import LOCAL, Collectives


class ProcessCollectives:
    """Collectives of one step over the default process group."""

    def __init__(self, env: Local, device: torch.device, rank_local: set[int]) -> None:
        self.env, self.device, self.rank_local = env, device, rank_local
        self.loss_scale = float(env.world_size)

    def sum(self, value: float) -> float:
        t = torch.tensor(
            value, dtype=torch.float64 if isinstance(value, float) else torch.int64, device=self.device
        )
        dist.all_reduce(t)
        return t.item()

    def ranks_where(self, flag: bool) -> tuple[int, ...]:
        flags = torch.zeros(self.env.world_size, dtype=torch.int64, device=self.device)
        flags[self.env.rank] = int(flag)
        dist.all_reduce(flags)  # one slot per rank: the sum is every rank's flag
        return tuple(int(r) for r in flags.nonzero().flatten().tolist())

    def all_reduce(self, t: Tensor) -> None:
        dist.all_reduce(t)

    def grad_norm(self, params: list[Tensor], max_norm: float) -> float:
        """Global L2 norm over replicated (DDP), sharded (FSDP2 DTensor) and expert-parallel gradients,
        with one all-reduce; then clip every gradient by the same factor. (torch's clip_grad_norm_
        cannot mix DTensor and plain-tensor parameters.)"""
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            g = p.grad
            if isinstance(g, DTensor):
                is_shard = any(placement.is_shard() for placement in g.placements)
                g = g.to_local()
            else:
                is_shard = id(p) in self.rank_local
            sq = g.detach().double().square().sum()
            if is_shard:
                sharded += sq
            else:
                replicated += sq
        dist.all_reduce(sharded)
        total = math.sqrt(float(replicated + sharded))
        if max_norm > 0 and math.isfinite(total):
            coef = min(1.0, max_norm / (total + 1e-6))
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        return total


@dataclass
class Parallelized:
    """What the trainer keeps: the module a step calls, the step's collectives, the device mesh."""

    model: nn.Module
    comm: Collectives = LOCAL
    mesh: DeviceMesh | None = None
    rank_local: dict[str, nn.Parameter] = field(default_factory=dict)

    def adapt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return separate_dtensor_groups(optimizer)

    def release(self) -> None:
        self.model, self.mesh, self.comm = None, None, LOCAL  # before destroy_process_group


def parallelize(model: nn.Module, plan: ParallelPlan, env: Local, device: torch.device) -> Parallelized:
    """Apply `plan` to `model` in place; return the module to call and the step's collectives."""
    if plan.data == "none":
        return Parallelized(model)
    rank_local: dict[str, nn.Parameter] = {}
    if plan.expert_parallel:
        rank_local = apply_expert_parallel(model, env.rank, env.world_size)
        for p in rank_local.values():
            p.register_hook(lambda g: g / env.world_size)  # summed over ranks by the all-to-all backward
    comm = ProcessCollectives(env, device, {id(p) for p in rank_local.values()})
    if plan.data == "ddp":
        if rank_local:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(rank_local))
        ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
        return Parallelized(wrapped, comm, None, rank_local)
    mesh = init_device_mesh(device.type, (env.world_size,))
    apply_fsdp(model, plan, mesh, set(rank_local.values()))
    return Parallelized(model, comm, mesh, rank_local)


def apply_fsdp(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, ignored: set[nn.Parameter]) -> None:
    """fully_shard every plan unit, then the root; `ignored` (expert-parallel slices) stay rank-local."""
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=plan.reshard_after_forward)
    units = [m for name, m in model.named_modules() if name and plan.is_fsdp_unit(name)]
    for unit in units:
        fully_shard(unit, ignored_params=ignored & set(unit.parameters()), **kwargs)
    fully_shard(model, ignored_params=ignored, **kwargs)
    # an expert slice that got no token on one rank must not desynchronise the reduce-scatters
    model.set_reduce_scatter_unused_params(True)


def separate_dtensor_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """foreach / fused optimizer kernels cannot mix DTensor (FSDP2) and plain (expert-parallel) tensors
    in one group: split each parameter group in two, same settings. A no-op when nothing is mixed."""
    kinds = [{isinstance(p, DTensor) for p in group["params"]} for group in optimizer.param_groups]
    if all(len(k) <= 1 for k in kinds):
        return optimizer
    groups = []
    for group in optimizer.param_groups:
        for want in (True, False):
            params = [p for p in group["params"] if isinstance(p, DTensor) is want]
            if params:
                groups.append({**group, "params": params})
    if groups:
        optimizer.param_groups.clear()
        for group in groups:
            optimizer.add_param_group(group)
    return optimizer


def global_routing_stats(model: nn.Module, env: Local) -> dict[str, dict]:
    """moe_routing_stats over all ranks: each layer's last counts, drops and window summed, entropy
    averaged (every rank must call it; only rank 0 writes the result)."""
    if env.world_size == 1:
        return moe_routing_stats(model)
    for _, layer in moe_layers(model):
        if layer.last_stats:
            stats = {k: v.detach().clone() for k, v in layer.last_stats.items()}
            for value in stats.values():
                env.all_reduce(value)
            stats["entropy"] /= env.world_size
            layer.last_stats = stats
    return moe_routing_stats(model, all_reduce=env.all_reduce)
