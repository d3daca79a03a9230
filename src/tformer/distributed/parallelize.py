"""Apply a ParallelPlan to a built model: tensor or expert parallelism, then DDP or FSDP2; and the
collectives one training step needs at that world size.

Gradient convention (the same at every world size): each rank's task loss is scaled by W / (global
target count), DDP and FSDP2 average over the W ranks, so every gradient is that of the summed loss
of all ranks' targets over their count, the gradient a single process would get on the union of the
ranks' batches. Expert-parallel weights get their gradient summed over ranks by the all-to-all's
backward, so a hook divides it by W. With tensor parallelism of degree T the ranks form a
(W / T, T) mesh: the T ranks of a group see the same batch and compute one model between them, so W
above becomes the data-parallel size W / T (targets and losses are summed over the data dimension, and
expert parallelism splits the experts over it: a group's ranks hold the same experts).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Partial
from torch.nn.parallel import DistributedDataParallel

from tformer.distributed.env import Local, set_mesh_timeout
from tformer.distributed.expert_parallel import apply_expert_parallel
from tformer.distributed.expert_width import split_expert_width, width_split_layers
from tformer.distributed.heads import split_attention_dropout
from tformer.distributed.plans import ParallelPlan, is_rank_local
from tformer.distributed.sequence import apply_sequence_parallel
from tformer.distributed.vocab import LogitSplit, split_head
from tformer.model.moe import moe_layers, moe_routing_stats
from tformer.schema import ConfigError
from tformer.train.step import LOCAL, Collectives


class ProcessCollectives:
    """Collectives of one step over the default process group."""

    def __init__(
        self,
        env: Local,
        device: torch.device,
        rank_local: dict[int, int],
        data_group=None,
        logits: LogitSplit | None = None,
    ) -> None:
        self.env, self.device, self.rank_local = env, device, rank_local
        self.data_group = data_group  # sums over the data-parallel ranks (None: all ranks)
        self.logits = logits  # the LM head split by vocabulary (tensor parallelism), or None
        self.loss_scale = float(env.data_world_size)

    def sum(self, value: float) -> float:
        if self.env.data_world_size == 1:  # one tensor-parallel group: every rank holds the whole sum
            return value
        t = torch.tensor(
            value, dtype=torch.float64 if isinstance(value, float) else torch.int64, device=self.device
        )
        dist.all_reduce(t, group=self.data_group)
        return t.item()

    def ranks_where(self, flag: bool) -> tuple[int, ...]:
        flags = torch.zeros(self.env.world_size, dtype=torch.int64, device=self.device)
        flags[self.env.rank] = int(flag)
        dist.all_reduce(flags)  # one slot per rank: the sum is every rank's flag
        return tuple(int(r) for r in flags.nonzero().flatten().tolist())

    def all_reduce(self, t: Tensor) -> None:
        dist.all_reduce(t)

    def micro_batch(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """DDP all-reduces the gradients once per step, after the last micro-batch's backward (the
        earlier ones accumulate locally). FSDP2 reduce-scatters after every micro-batch on purpose: its
        gradients then stay sharded, where deferring would hold whole unsharded gradients between
        micro-batches. A head split by vocabulary keeps its logits split for the loss within."""
        ddp = getattr(model, "_orig_mod", model)  # under torch.compile: the module it compiled
        if not last and isinstance(ddp, DistributedDataParallel):
            return ddp.no_sync()
        return self.logits.keep() if self.logits is not None else contextlib.nullcontext()

    def grad_norm(self, params: list[Tensor], max_norm: float) -> float:
        """Global L2 norm over replicated (DDP, tensor-parallel groups), sharded (FSDP2 / tensor-parallel
        DTensor) and expert-parallel gradients, with one all-reduce; then clip every gradient by the same
        factor. (torch's clip_grad_norm_ cannot mix DTensor and plain-tensor parameters.) Each gradient
        element is counted once: a DTensor's local square sum is divided by the number of ranks holding
        the same piece (its replicated mesh dimensions, and the ranks outside its mesh)."""
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            g = p.grad
            if isinstance(g, DTensor):
                copies = self.env.world_size // g.device_mesh.size()
                for dim, placement in enumerate(g.placements):
                    copies *= g.device_mesh.size(dim) if placement.is_replicate() else 1
                sharded += g.to_local().detach().double().square().sum() / copies
                continue
            sq = g.detach().double().square().sum()
            if (
                id(p) in self.rank_local
            ):  # an expert slice, held by this many ranks (of a tensor-parallel group)
                sharded += sq / self.rank_local[id(p)]
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
    if plan.tensor > 1:
        return parallelize_tensor(model, plan, env, device)
    if plan.data == "none":
        return Parallelized(model)
    rank_local = shard_experts_over(model, plan, env.rank, env.world_size)
    comm = ProcessCollectives(env, device, holders(model, rank_local, 1))
    if plan.data == "ddp":
        # MoE token counters are rank-local buffers: DDP leaves them out of the broadcast it makes when it
        # is built (counts restored before wrapping stay this rank's), and never synchronises buffers in
        # forward (the name of that switch changed in torch). The expert biases are broadcast: they are
        # the same on every rank.
        counters = [name for name, _ in model.named_buffers() if is_rank_local(name)]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [*rank_local, *counters])
        ids = [device.index] if device.type == "cuda" else None
        no_sync = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        buffers = {"forward_sync_buffers": False} if no_sync else {"broadcast_buffers": False}
        wrapped = DistributedDataParallel(model, device_ids=ids, **buffers)
        return Parallelized(wrapped, comm, None, rank_local)
    mesh = init_device_mesh(device.type, (env.world_size,))
    apply_fsdp(model, plan, mesh, set(rank_local.values()))
    return Parallelized(model, comm, mesh, rank_local)


def parallelize_tensor(
    model: nn.Module, plan: ParallelPlan, env: Local, device: torch.device
) -> Parallelized:
    """Tensor parallelism over groups of plan.tensor ranks, then FSDP2 over the data dimension (if any)."""
    check_tensor_parallel(model, plan.tensor)
    mesh = init_device_mesh(
        device.type, (env.world_size // plan.tensor, plan.tensor), mesh_dim_names=("data", "tensor")
    )
    set_mesh_timeout(mesh, env)
    by_width = width_split_layers(model, plan.tensor)  # MoE layers whose experts each rank splits by width
    # expert parallelism over the data dimension: the ranks of a tensor-parallel group hold the same
    # experts (each its slice of their width, where they are split) and exchange tokens with the other
    # groups' ranks at their place
    width = (mesh["tensor"].get_local_rank(), plan.tensor, {name for name, _ in by_width})
    rank_local = shard_experts_over(
        model, plan, env.data_rank, env.data_world_size, mesh["data"].get_group(), width
    )
    logits = apply_tensor_parallel(model, plan, mesh["tensor"], by_width)
    data_group = None
    if plan.data == "fsdp":
        apply_fsdp(model, plan, mesh["data"], set(rank_local.values()))
        data_group = mesh["data"].get_group()
    comm = ProcessCollectives(env, device, holders(model, rank_local, plan.tensor), data_group, logits)
    return Parallelized(model, comm, mesh, rank_local)


def shard_experts_over(
    model: nn.Module, plan: ParallelPlan, rank: int, size: int, group=None, width=None
) -> dict:
    """Expert parallelism over `size` ranks (when the plan asks for it): the rank's slices of the
    experts, by name. Their gradients, summed over those ranks by the all-to-all's backward, are
    divided by `size` (the data-parallel averaging that DDP / FSDP2 apply to the other parameters).
    `width`: (index, parts, layer names) of a tensor-parallel group's split by width (apply_expert_parallel)."""
    if not plan.expert_parallel:
        return {}
    layers = moe_layers(model)
    if not layers:
        raise ConfigError("parallel.experts=shard, but the model has no MoE layer to split (set model.moe)")
    n_experts = layers[0][1].experts.n_experts
    if n_experts % size:
        over = "data-parallel ranks" if plan.tensor > 1 else "processes"
        raise ConfigError(
            f"parallel.experts=shard splits each MoE layer's {n_experts} experts over the {size} {over}: "
            f"model.moe.n_experts must be divisible by {size}"
        )
    rank_local = apply_expert_parallel(model, rank, size, group, width)
    for p in rank_local.values():
        p.register_hook(lambda g: g / size)
    return rank_local


def holders(model: nn.Module, rank_local: dict[str, nn.Parameter], group: int) -> dict[int, int]:
    """id -> how many ranks hold the same piece, of every expert-parallel slice: the ranks of a
    tensor-parallel group of `group` share a slice kept whole, and each holds its own of one split by
    width."""
    ids = {id(p) for p in rank_local.values()}
    return {
        id(p): group // getattr(layer.experts, "width_parts", 1)
        for _, layer in moe_layers(model)
        for p in layer.experts.parameters()
        if id(p) in ids
    }


def check_tensor_parallel(model: nn.Module, degree: int) -> None:
    """Tensor parallelism splits heads and FFN width evenly; in MoE layers every rank of a group routes
    the same (whole) sequence and computes its slice of every expert's width
    (tformer.distributed.expert_width; experts with biases or a width the degree does not divide run
    whole)."""
    cfg = model.cfg
    for name, value in (
        ("model.n_heads", cfg.n_heads),
        ("model.n_kv_heads", cfg.resolved_n_kv_heads),
        ("model.d_ff", cfg.d_ff),
    ):
        if value % degree:
            raise ConfigError(f"parallel.tensor={degree} must divide {name}={value}")


def apply_tensor_parallel(
    model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, by_width: list[tuple[str, nn.Module]]
) -> LogitSplit | None:
    """Column-split q/k/v and the FFN's input layers, row-split o and the FFN's output layer (activations
    between them stay local to each rank; one all-reduce after each pair), and the LM head by vocabulary
    (tformer.distributed.vocab: returns its switch, None where no head is split). With plan.sequence the
    residual stream between them is split over the sequence as well (tformer.distributed.sequence).
    `by_width`: the MoE layers whose experts are split by width (expert_width.width_split_layers)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "rowwise_reduced": RowwiseParallel}
    if plan.sequence:  # row-split outputs stay partial sums: sequence.py reduce-scatters or all-reduces them
        styles["rowwise"] = partial(RowwiseParallel, output_layouts=Partial(), use_local_output=False)
    tied = shared_weights(model)  # splitting one user of a shared weight would untie it: both stay whole
    # MoE layers split by width (tformer.distributed.expert_width) split their shared experts themselves
    own_shared = tuple(f"{name}.shared." for name, _ in by_width)
    chosen = {
        name: (style, module)
        for name, module in model.named_modules()
        if (style := plan.tp_style(name))
        and id(getattr(module, "weight", None)) not in tied
        and not name.startswith(own_shared)
    }
    if not chosen:
        raise ConfigError("parallel.tensor > 1, but the model has no layer that tensor parallelism splits")
    parallelize_module(
        model, mesh, {name: styles[style]() for name, (style, _) in chosen.items() if style in styles}
    )
    heads = [split_head(module, mesh) for style, module in chosen.values() if style == "vocab"]
    split_expert_width(by_width, mesh)  # in each group
    if model.cfg.attn_dropout > 0:  # each rank drops its own heads' weights (a group shares one RNG stream)
        split_attention_dropout(model, mesh)
    if plan.sequence:
        apply_sequence_parallel(model, mesh)
    return heads[0] if heads else None


def shared_weights(model: nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (a head tied to the embedding)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def apply_fsdp(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, ignored: set[nn.Parameter]) -> None:
    """fully_shard every plan unit, then the root; `ignored` (expert-parallel slices) stay rank-local."""
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=plan.reshard_after_forward)
    units = [m for name, m in model.named_modules() if name and plan.is_fsdp_unit(name)]
    for unit in units:
        fully_shard(unit, ignored_params=ignored & set(unit.parameters()), **kwargs)
    fully_shard(model, ignored_params=ignored, **kwargs)
    for method in ("encode", "decode"):  # the encoder-decoder's search calls these, not forward
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
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
    copies = env.world_size // env.data_world_size  # a tensor-parallel group's ranks route the same tokens

    def all_reduce(t: Tensor) -> None:  # summed over the world, each token counted once
        env.all_reduce(t)
        t.div_(copies, rounding_mode=None if t.is_floating_point() else "floor")

    for _, layer in moe_layers(model):
        if layer.last_stats:
            stats = {k: v.detach().clone() for k, v in layer.last_stats.items()}
            for value in stats.values():
                all_reduce(value)
            stats["entropy"] /= env.data_world_size
            layer.last_stats = stats
    return moe_routing_stats(model, all_reduce=all_reduce)
