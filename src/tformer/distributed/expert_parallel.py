"""Expert parallelism: each rank keeps E / W of every MoE layer's experts; tokens travel to them.

Shapes: x (N, D) this rank's tokens, K = top_k, E experts in all, W ranks, El = E / W experts here
(rank r holds experts r*El ... (r+1)*El - 1), S <= N*K assignments this rank sends, R rows it receives.

One MoE forward on every rank:
  1. route locally, sort the assignments by expert, apply the capacity limit (per rank, as a single
     process would on these N tokens)
  2. exchange the (W, El) per-expert row counts (all_to_all, no autograd)
  3. send the rows to the experts' ranks (all_to_all with autograd), run the local experts with the
     model's own grouped kernels, send the outputs back (all_to_all)
  4. weight and scatter-add them per token, exactly as `GroupedDispatch` does.
An expert that receives no row still runs (on 0 rows) and gets a zero gradient, so no rank waits
on another. The model code is untouched: `apply_expert_parallel` swaps each MoE layer's `dispatch`
and keeps the rank's slice of the stacked expert weights (plain tensors, E / W along dim 0). Under
tensor parallelism the ranks of a group (the same tokens, at the same place in their expert-parallel
groups) each keep 1 / P of those experts' width as well, so their outputs are partial sums: they travel
back and are weighted like whole ones (both linear), and the layer's exit sums them over the group
(tformer.distributed.expert_width).
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tformer.model.grouped_linear import grouped_dtype
from tformer.model.moe import Dispatch, Experts, moe_layers
from tformer.model.router import Routing


class AllToAll(torch.autograd.Function):
    """Rows of x (sum(send), ...) split by `send` go to the ranks in order; the result holds
    sum(recv) rows, split by `recv`, from the ranks in order. Backward sends the gradients back the
    same way. (torch.distributed.nn.functional.all_to_all_single does the same and is deprecated in
    torch 2.13; uneven and zero-size splits work on gloo and nccl.)"""

    @staticmethod
    def forward(ctx, x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        dx = dy.new_empty((sum(ctx.send), *dy.shape[1:]))
        dist.all_to_all_single(dx, dy.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return dx, None, None, None


def all_to_all(x: Tensor, recv: list[int], send: list[int], group=None) -> Tensor:
    return AllToAll.apply(x, recv, send, group)


class ExpertParallelDispatch(Dispatch):
    """Dispatch to experts spread over the ranks of `group` (see the module docstring)."""

    def __init__(self, capacity: nn.Module, n_experts: int, rank: int, world_size: int, group=None) -> None:
        super().__init__(capacity)
        if n_experts % world_size:
            raise ValueError(
                f"expert parallelism needs n_experts={n_experts} divisible by {world_size} ranks"
            )
        self.n_experts, self.world_size, self.group = n_experts, world_size, group
        self.n_local = n_experts // world_size
        self.first = rank * self.n_local

    def forward(self, experts: Experts, x: Tensor, route: Routing) -> tuple[Tensor, Tensor]:
        n, d = x.shape
        k = route.idx.shape[1]
        order, counts, dropped = self.kept(route.idx, self.n_experts)  # (S,), (E,)
        token = order // k  # (S,)
        send_counts = counts.view(self.world_size, self.n_local)  # (W, El) rows for each rank's experts
        recv_counts = torch.empty_like(send_counts)  # (W, El) rows from each rank for my experts
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        rows = all_to_all(x.index_select(0, token), recv, send, self.group)  # (R, D) by source, expert
        expert = torch.arange(self.n_local, device=x.device).repeat(self.world_size)  # (W * El,)
        by_expert = expert.repeat_interleave(recv_counts.flatten()).argsort(stable=True)  # (R,)
        y = experts(rows.index_select(0, by_expert), experts.grouped(recv_counts.sum(0).tolist()))
        # (R, D) back in arrival order, in a dtype every rank agrees on: a rank with few rows may have
        # multiplied in the weights' dtype (grouped_linear's decoding case) where another used autocast's
        y = y.index_select(0, by_expert.argsort()).to(grouped_dtype(x))
        back = all_to_all(y, send, recv, self.group)  # (S, D) in sending order
        weighted = back * route.weights.flatten().index_select(0, order).unsqueeze(1)  # (S, D), >= fp32
        return torch.zeros(n, d, device=x.device, dtype=weighted.dtype).index_add(0, token, weighted), dropped


# where the width F sits in each stacked expert weight: gate/up (E, F, D), down (E, D, F)
WIDTH_DIM = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}


def shard_experts(
    experts: Experts, rank: int, world_size: int, width: tuple[int, int] | None = None
) -> list[nn.Parameter]:
    """Keep this rank's E / W experts of every stacked weight (E, out, in) and bias (E, out); with
    `width` = (index, parts), of those only the index-th of `parts` equal slices of each expert's width
    (tensor parallelism: tformer.distributed.expert_width; weights without biases only).
    `experts.width_parts` records the split (1: whole)."""
    n_local = experts.n_experts // world_size
    lo, kept = rank * n_local, []
    index, parts = width or (0, 1)
    for name, p in list(experts.named_parameters(recurse=False)):
        piece = p.detach()[lo : lo + n_local]
        if parts > 1:
            if name not in WIDTH_DIM:
                raise ValueError(f"only bias-free experts are split by width, got {name}")
            piece = piece.tensor_split(parts, dim=WIDTH_DIM[name])[index]
        local = nn.Parameter(piece.clone(), requires_grad=p.requires_grad)
        setattr(experts, name, local)
        kept.append(local)
    experts.n_experts, experts.width_parts = n_local, parts
    return kept


def apply_expert_parallel(
    model: nn.Module, rank: int, world_size: int, group=None, width: tuple[int, int, set[str]] | None = None
) -> dict[str, nn.Parameter]:
    """The expert-parallel plan: in every MoE layer, swap `dispatch` for `ExpertParallelDispatch` and keep
    this rank's slice of the experts (with `width` = (index, parts, layer names), the named layers' experts
    also cut to their index-th width slice). Returns the sliced parameters by name (they are rank-local:
    data parallelism must leave them alone). Needs the process group of `group` (the default one when
    None): the forward exchanges tokens with all-to-all."""
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if not dist.is_initialized():
        raise RuntimeError(
            "expert parallelism exchanges tokens between processes: initialise a process group first "
            "(torchrun and torch.distributed.init_process_group, or tformer's Trainer under torchrun)"
        )
    sharded: dict[str, nn.Parameter] = {}
    for name, layer in moe_layers(model):
        n_experts = layer.experts.n_experts
        layer.dispatch = ExpertParallelDispatch(layer.dispatch.capacity, n_experts, rank, world_size, group)
        by_width = width[:2] if width is not None and name in width[2] else None
        shard_experts(layer.experts, rank, world_size, by_width)
        for pname, p in layer.experts.named_parameters():
            sharded[f"{name}.experts.{pname}" if name else f"experts.{pname}"] = p
    return sharded
