"""MoE experts under tensor parallelism: each rank of a group computes every expert on its slice of the
expert's width (Megatron-style, as the dense FFN is split), instead of every rank computing them whole.

Shapes: experts' stacked weights gate/up (E, F, D), down (E, D, F); P ranks in the group. Rank r keeps
gate/up[:, rF/P:(r+1)F/P] and down[:, :, rF/P:(r+1)F/P] as DTensors (Shard(1) / Shard(2) on the tensor
mesh; FSDP2 and DCP take them like any tensor-parallel weight). The router runs whole on every rank
(the same tokens, the same choices, the same balance losses and counts); the shared experts are split
like a dense FFN by the plan's styles (`tformer.distributed.plans.TP_STYLES`). In a
forward every rank gathers its tokens and runs the model's own grouped kernels on its slices (the
experts read their local pieces: `Experts.local`), giving a partial sum of every expert's output:

    x -> [copy: identity; backward all-reduce] -> experts on F / P -> [all-reduce; backward identity] -> y

The routing weights that scale each expert's output enter the same way (their gradient, like x's, is a
partial sum per rank). One all-reduce of (N, D) in forward and one of (N, D) + (N, K) in backward per
MoE layer; the experts' FLOPs and weights split P ways (before: P ranks computing the same thing). Expert
weights with biases, or a width P does not divide, stay whole (the earlier behaviour); expert
parallelism (`experts=shard`) splits experts over the data dimension and keeps them whole in a group.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tformer.model.moe import MoE, moe_layers

WIDTH_DIM = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}  # where F sits in each stacked weight


class CopyToGroup(torch.autograd.Function):
    """Identity; backward sums the gradient over the group (each rank's is its slice's part)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromGroup(torch.autograd.Function):
    """Sum over the group (each rank's partial output); backward passes the gradient on unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertWidthSplit:
    """The hooks of one MoE layer's dispatch: its inputs copied into the group, its output reduced."""

    def __init__(self, group) -> None:
        self.group = group

    def copy_inputs(self, module: nn.Module, args: tuple) -> tuple:
        experts, x, route = args
        weights = CopyToGroup.apply(route.weights, self.group)
        return experts, CopyToGroup.apply(x, self.group), route._replace(weights=weights)

    def reduce_output(self, module: nn.Module, args: tuple, out: tuple[Tensor, Tensor]) -> tuple:
        routed, dropped = out
        return ReduceFromGroup.apply(routed, self.group), dropped


def whole_experts_reason(layer: MoE, degree: int) -> str | None:
    """Why tensor parallelism of `degree` leaves this layer's experts whole, or None (they are split)."""
    experts = layer.experts
    width = experts.down_proj.shape[-1]
    if any(getattr(experts, f"{n}_bias") is not None for n in experts.projections):
        return "the experts have biases (model.bias=true)"
    if width % degree:
        return f"parallel.tensor={degree} does not divide the expert width {width}"
    return None


def split_expert_width(model: nn.Module, mesh: DeviceMesh) -> int:
    """Split the experts of every MoE layer of `model` by width over `mesh` (where `whole_experts_reason` gives none);
    returns how many layers were split."""
    split, kept_whole = 0, []
    for _, layer in moe_layers(model):
        if (reason := whole_experts_reason(layer, mesh.size())) is not None:
            kept_whole.append(reason)
            continue
        experts = layer.experts
        for name in experts.projections:
            whole = getattr(experts, name)
            shard = distribute_tensor(whole.detach(), mesh, [Shard(WIDTH_DIM[name])])
            setattr(experts, name, nn.Parameter(shard, requires_grad=whole.requires_grad))
        experts.local = _local  # the grouped kernels read each rank's slices
        hooks = ExpertWidthSplit(mesh.get_group())
        layer.dispatch.register_forward_pre_hook(hooks.copy_inputs)
        layer.dispatch.register_forward_hook(hooks.reduce_output)
        split += 1
    if kept_whole:
        warnings.warn(
            f"{len(kept_whole)} MoE layer(s) keep their experts whole on every rank of a tensor-parallel "
            f"group (each rank computes them all): {kept_whole[0]}",
            stacklevel=2,
        )
    return split
