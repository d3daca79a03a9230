"""MoE experts under tensor parallelism: each rank of a group computes every expert on its slice of the
expert's width (Megatron-style, as the dense FFN is split), instead of every rank computing them whole.

Shapes: experts' stacked weights gate/up (E, F, D), down (E, D, F); P ranks in the group. Rank r keeps
gate/up[:, rF/P:(r+1)F/P] and down[:, :, rF/P:(r+1)F/P] as DTensors (Shard(1) / Shard(2) on the tensor
mesh; FSDP2 and DCP take them like any tensor-parallel weight); the shared experts (one dense FFN) are
split the same way, gate/up by rows (Shard(0)), down by columns (Shard(1)). The router runs whole on
every rank (the same tokens, the same choices, the same balance losses and counts). Every rank runs the
model's own layer on its slices (the experts read their local pieces through `Experts.local`, the shared
layers through a forward that reads theirs), so the layer's output is a partial sum, routed and shared
experts together, and so is the gradient of its input (the router's part excepted). The layer is
entered and left once:

    x -> [enter: the whole sequence; backward sums the input gradient over the group once]
      -> router (whole; its input gradient scaled by 1 / P, so the sum counts it once)
      -> routed experts on F / P + shared experts on their F_s / P   (partial sums)
      -> [leave: sum over the group; backward passes the gradient on]   -> y

With sequence parallelism `enter` all-gathers the rank's positions and its backward reduce-scatters,
`leave` reduce-scatters to the rank's positions (what a dense FFN does); without, `enter` is free and its
backward all-reduces, `leave` all-reduces. One (N, D) collective per layer and direction, plus the
routing weights' (N, K) all-reduce in backward (each rank's gradient of them is its slice's part; the
router's own gradients must be whole). Before, routed and shared experts were reduced separately (two
(N, D) all-reduces forward and two backward, plus a whole-sequence gather and slice under sequence
parallelism). Expert weights with biases, or a width P does not divide, stay whole (the earlier
behaviour, the shared experts then split by the plan's styles). Under expert parallelism
(`experts=shard`, the experts split over the data dimension) each rank keeps its width slice of its
data rank's experts (plain rank-local tensors, cut by `expert_parallel.shard_experts`): the tokens
travel to the experts' ranks and their partial outputs back, then leave the layer as above. (Until
2026-12-01 expert-parallel experts stayed whole in a group: every rank of it computed them all.)
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tformer.distributed.expert_parallel import WIDTH_DIM
from tformer.distributed.sequence import SEQ
from tformer.model.moe import MoE, NoShared, moe_layers


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


class ScaleGrad(torch.autograd.Function):
    """Identity; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_linear(linear: nn.Linear, x: Tensor) -> Tensor:
    """A shared-expert layer's product on this rank's slice of its weight (no bias: see whole_experts_reason)."""
    return F.linear(x, _local(linear.weight))


class ExpertWidthSplit:
    """One width-split MoE layer's hooks: its entry and exit, the router's input, the routing weights."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.group = mesh, mesh.get_group()
        self.sequence = None  # the stack's SequenceSplit under sequence parallelism (sequence.py sets it)

    def _outside(self) -> list:
        """How the residual stream is held outside the layer in this forward: split over T, or whole."""
        return [SEQ if self.sequence is not None and self.sequence.active else Replicate()]

    def enter(self, module: nn.Module, args: tuple) -> tuple:
        """MoE forward pre-hook: the whole sequence, as a plain tensor whose gradient is this rank's
        partial sum (backward reduces it once: reduce-scatter to the positions, or all-reduce)."""
        x = DTensor.from_local(args[0], self.mesh, self._outside(), run_check=False)
        whole = x.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        return (whole, *args[1:])

    def leave(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        """MoE forward hook: the partial outputs summed over the group (to this rank's positions under
        sequence parallelism)."""
        y = DTensor.from_local(out, self.mesh, [Partial()], run_check=False)
        return y.redistribute(self.mesh, self._outside()).to_local()

    def router_input(self, module: nn.Module, args: tuple) -> tuple:
        """Router forward pre-hook: its input gradient is whole and the same on every rank; scaled by
        1 / P it joins the partial sums that `enter` adds up over the group."""
        return (ScaleGrad.apply(args[0], 1.0 / self.mesh.size()), *args[1:])

    def routing_weights(self, module: nn.Module, args: tuple) -> tuple:
        """Dispatch forward pre-hook: the routing weights' gradient summed over the group, so that the
        router's own gradients are whole."""
        experts, x, route = args
        return experts, x, route._replace(weights=CopyToGroup.apply(route.weights, self.group))


def whole_experts_reason(layer: MoE, degree: int) -> str | None:
    """Why tensor parallelism of `degree` leaves this layer's experts whole, or None (they are split)."""
    experts = layer.experts
    width = experts.down_proj.shape[-1]
    shared_bias = any(m.bias is not None for m in layer.shared.modules() if isinstance(m, nn.Linear))
    if shared_bias or any(getattr(experts, f"{n}_bias") is not None for n in experts.projections):
        return "the experts have biases (model.bias=true)"
    if width % degree:
        return f"parallel.tensor={degree} does not divide the expert width {width}"
    return None


def width_split_layers(model: nn.Module, degree: int) -> list[tuple[str, MoE]]:
    """The MoE layers of `model` whose experts tensor parallelism of `degree` splits by width; warns once
    about the ones it keeps whole."""
    split, kept_whole = [], []
    for name, layer in moe_layers(model):
        reason = whole_experts_reason(layer, degree)
        split.append((name, layer)) if reason is None else kept_whole.append(reason)
    if kept_whole:
        warnings.warn(
            f"{len(kept_whole)} MoE layer(s) keep their experts whole on every rank of a tensor-parallel "
            f"group (each rank computes them all): {kept_whole[0]}",
            stacklevel=3,
        )
    return split


def split_expert_width(layers: list[tuple[str, MoE]], mesh: DeviceMesh) -> None:
    """Split the routed and shared experts of each of `layers` (from `width_split_layers`) by width over
    `mesh` and hook the layer's entry and exit. Expert-parallel experts were cut to their width slice
    when they were split over the data dimension (plain rank-local tensors: `shard_experts`)."""
    for _, layer in layers:
        experts = layer.experts
        for name in experts.projections if getattr(experts, "width_parts", 1) == 1 else ():
            whole = getattr(experts, name)
            shard = distribute_tensor(whole.detach(), mesh, [Shard(WIDTH_DIM[name])])
            setattr(experts, name, nn.Parameter(shard, requires_grad=whole.requires_grad))
        experts.local = _local  # the grouped kernels read each rank's slices
        if not isinstance(layer.shared, NoShared):
            for name, linear in layer.shared.named_children():  # gate/up by rows, down by columns
                placement = Shard(1) if name == "down_proj" else Shard(0)
                shard = distribute_tensor(linear.weight.detach(), mesh, [placement])
                linear.weight = nn.Parameter(shard, requires_grad=linear.weight.requires_grad)
                linear.forward = partial(_local_linear, linear)
        hooks = ExpertWidthSplit(mesh)
        layer.width_split = hooks  # found by sequence.py
        layer.register_forward_pre_hook(hooks.enter)
        layer.register_forward_hook(hooks.leave)
        layer.router.register_forward_pre_hook(hooks.router_input)
        layer.dispatch.register_forward_pre_hook(hooks.routing_weights)
