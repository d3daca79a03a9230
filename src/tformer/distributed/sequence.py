"""Sequence parallelism inside a tensor-parallel group (Korthikanti et al., 2022, "Reducing Activation
Recomputation in Large Transformer Models").

Tensor parallelism alone keeps the residual stream, the norms and the dropout replicated: every rank of
a group holds (B, T, D) between the blocks and runs every norm over all T positions. With sequence
parallelism each rank holds T / P of the positions there, so those activations (and the work of the
norms) are split P ways, for the same communication volume: the all-reduce after each row-split layer
becomes a reduce-scatter over the sequence, and each sublayer's input is all-gathered before its
column-split layers.

    x (B, T/P, D) -> norm -> all-gather -> q/k/v, attention, o (heads split) -> reduce-scatter -> + x
                  -> norm -> all-gather -> FFN (width split)                 -> reduce-scatter -> + x

In each stack the first block's input is split (no communication: every rank of the group holds the
same embeddings) and the final norm's input gathered. Everything is `torch.distributed.tensor`
(DTensor) redistribution, so backward runs the dual collectives (the all-gather's backward is a
reduce-scatter) and the norms' weights are replicated DTensors whose gradients, each rank's partial
sums, are summed over the group once backward has accumulated them (by `NormGrads`: one all-reduce of
all of a model's norm gradients at the end of backward; under FSDP2, which replaces the parameters, by
FSDP2 when it reduces them).

The column-split layers' weight gradients need their gathered input in backward. Kept whole, it would
cost every rank the (B, T, D) that sequence parallelism set out to split; instead (as Megatron-LM does)
backward keeps this rank's T / P positions of it and all-gathers them again when the first of the
layers reading it runs its backward (`Regathered`, through saved-tensor hooks active during each
sublayer's forward): one more all-gather per sublayer in backward for (P - 1) / P of that memory.
`KEEP_GATHERED = True` keeps them whole (the slow twin the tests compare against). Under autocast a
sublayer's input is cast for the gather (half the bytes, and the gathered tensor is the one the layers
read and save); its gradient is still reduce-scattered in the input's dtype (where torch's DTensor
takes a backward dtype), but the q/k/v (gate/up) gradients of the gathered input add up in the
autocast dtype, where plain tensor parallelism casts each to fp32 first.

The split is decided per forward and per stack from the sequence length: a length the group size does
not divide (a translation batch of odd length, a decoding step of one token) runs that forward as plain
tensor parallelism, with the same result. Residual dropout draws the whole sequence's mask and applies
each rank's part (`SplitDropout`; on the CPU the same mask one process draws). Both routes, with and
without dropout, are tested against one process on the CPU (tests/distributed/worker_tensor.py, `tensor`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

from tformer.model.linear import autocast_enabled
from tformer.model.moe import MoE

SEQ = Shard(1)  # hidden states are (B, T, D)
KEEP_GATHERED = False  # the slow twin, read when a model is split: sublayers keep gathered inputs whole
SUBLAYERS = ("attn", "cross_attn", "ffn")  # each ends in a row-split layer whose output is left Partial
NORMS = ("attn_norm", "cross_norm", "ffn_norm")


# torch's own saved-tensor hooks stack keeps only the innermost pair active: the sublayers' hooks hand
# what they do not keep to the pair active outside (a memory meter, an offloading hook), which torch
# tells through a private function; where it does not, gathered inputs are kept whole (no hooks)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
CHAINED_HOOKS = _TOP_HOOKS is not None
# DTensor.redistribute(forward_dtype=, backward_dtype=) (newer torch): cast for the gather only
CASTING_REDISTRIBUTE = "forward_dtype" in inspect.signature(DTensor.redistribute).parameters


def outer_saved_tensors_hooks() -> tuple | None:
    """The (pack, unpack) saved-tensor hooks active now, if any."""
    return _TOP_HOOKS(False)


@dataclass(frozen=True)
class Packed:
    """A saved view of a gathered input: the shard it is gathered again from and the view's layout."""

    source: Regathered
    view: tuple
    meta: tuple | None  # (mesh, placements, shape, stride) of a DTensor view; None: a plain tensor


class Regathered:
    """A sublayer's all-gathered input, kept for backward as this rank's positions: gathered again the
    first time backward reads it (by the column-split layers' weight gradients), then shared by the
    layers that read the same input (q/k/v, gate/up) until the last of them has run."""

    def __init__(self, shard: Tensor, switch: SequenceSplit) -> None:
        self.shard, self.switch, self.whole = shard, switch, None
        self.shown = False  # to saved-tensor hooks active outside (once)

    def local(self) -> Tensor:
        if self.whole is None:
            with torch.no_grad():
                self.whole = self.switch.whole(self.shard).contiguous()
        return self.whole


@dataclass
class SequenceSplit:
    """One stack's switch: whether the forward running now holds its residual stream split over T.
    keep_gathered: the slow twin of `Regathered` (the sublayers' gathered inputs kept whole for backward)."""

    mesh: DeviceMesh
    active: bool = False
    keep_gathered: bool = field(default_factory=lambda: KEEP_GATHERED)
    gathered: dict[int, Regathered] = field(default_factory=dict)  # storage address -> its shard
    saving: list = field(default_factory=list)  # the saved-tensor hooks of the sublayer running now

    def from_local(self, x: Tensor, split: bool) -> DTensor:
        return DTensor.from_local(x, self.mesh, [SEQ if split else Replicate()], run_check=False)

    def shard(self, x: Tensor) -> Tensor:
        """This rank's positions of a whole (replicated) sequence; in backward, the gradients gathered."""
        return self.from_local(x, False).redistribute(self.mesh, [SEQ]).to_local()

    def whole(self, x: Tensor) -> Tensor:
        """The whole sequence from this rank's positions, as a plain (replicated) tensor."""
        return self.from_local(x, True).redistribute(self.mesh, [Replicate()]).to_local()

    # ---- stack boundaries, and MoE layers (every rank of the group routes the whole sequence: the layer
    # hands back whole input gradients; its experts' width split, if any, reduces inside the layer)
    def split(self, module: nn.Module, args: tuple) -> tuple | None:
        """Forward pre-hook of the stack's first block: keep this rank's T / P positions."""
        x = args[0]
        self.active = x.shape[1] % self.mesh.size() == 0
        return (self.shard(x), *args[1:]) if self.active else None

    def gather(self, module: nn.Module, args: tuple) -> tuple | None:
        """Forward pre-hook of the stack's final norm (or its identity, Post-Norm) and of an MoE layer:
        the whole sequence."""
        return (self.whole(args[0]), *args[1:]) if self.active else None

    def split_output(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
        """Forward hook of an MoE layer: this rank's positions of its output."""
        return self.shard(out) if self.active else None

    # ---- sublayers: attention, cross-attention, FFN
    def gather_input(self, module: nn.Module, args: tuple) -> tuple | None:
        """The whole sequence for the column-split layers, as a replicated DTensor: their input
        gradients (partial sums over the group) then reduce-scatter back to the shards. Under autocast
        the positions are cast before the gather (half the bytes, and the gathered tensor is what the
        layers save). Backward keeps this rank's positions of it, not the whole (`Regathered`)."""
        if not self.active:
            return None
        self.end_sublayer(module, args, None)  # hooks a forward interrupted by Ctrl-C may have left pushed
        x, casts = args[0], {}
        kind = x.device.type
        if autocast_enabled(kind) and x.is_floating_point() and x.dtype != torch.get_autocast_dtype(kind):
            if CASTING_REDISTRIBUTE:  # the input gradient is still reduce-scattered in x's dtype
                casts = {"forward_dtype": torch.get_autocast_dtype(kind), "backward_dtype": x.dtype}
            else:
                x = x.to(torch.get_autocast_dtype(kind))
        whole = self.from_local(x, True).redistribute(self.mesh, [Replicate()], **casts)
        local = whole.to_local()
        if not self.keep_gathered and torch.is_grad_enabled() and local.is_contiguous() and CHAINED_HOOKS:
            shard = x.detach().to(local.dtype)  # what is gathered again: a copy only if cast
            self.gathered[local.untyped_storage().data_ptr()] = Regathered(shard, self)
            outer = outer_saved_tensors_hooks()
            hooks = torch.autograd.graph.saved_tensors_hooks(
                partial(self.pack, outer=outer), partial(self.unpack, outer=outer)
            )
            hooks.__enter__()  # left by `end_sublayer`, which runs even when the forward raises
            self.saving.append(hooks)
        return (whole, *args[1:])

    def reduce_output(self, module: nn.Module, args: tuple, out: DTensor) -> Tensor:
        """The row-split layer's partial sums: reduce-scattered over T (split) or all-reduced."""
        return out.redistribute(self.mesh, [SEQ if self.active else Replicate()]).to_local()

    def end_sublayer(self, module: nn.Module, args: tuple, out: object) -> None:
        while self.saving:
            self.saving.pop().__exit__(None, None, None)
        self.gathered.clear()

    def pack(self, t: Tensor, outer: tuple | None) -> object:
        """A tensor backward keeps: a view of a gathered input becomes its shard and the view's layout;
        anything else goes to the saved-tensor hooks that were active outside (if any), as without these.
        Those are shown the shard kept in place of a gathered input (what they return for it is unused:
        this is for hooks that measure; an offloading hook leaves the shard where it is)."""
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        source = self.gathered.get(storage.data_ptr())
        if source is None or storage.nbytes() != source.shard.nbytes * self.mesh.size():
            return outer[0](t) if outer else t
        if outer and not source.shown:
            outer[0](source.shard)
            source.shown = True
        view = (local.shape, local.stride(), local.storage_offset())
        meta = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return Packed(source, view, meta)

    @staticmethod
    def unpack(packed: object, outer: tuple | None) -> Tensor:
        if not isinstance(packed, Packed):
            return outer[1](packed) if outer else packed
        local = packed.source.local().as_strided(*packed.view)
        if packed.meta is None:
            return local
        mesh, placements, shape, stride = packed.meta
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    # ---- norms: replicated weights, sharded or replicated inputs
    def norm_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return (self.from_local(inputs[0], self.active), *inputs[1:])

    @staticmethod
    def norm_output(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> Tensor:
        return out.to_local()


class SplitDropout(nn.Module):
    """A block's residual dropout while its sequence is split: the mask of the whole (B, T, D) is drawn
    from the group's one RNG stream and this rank's positions of it are applied, so every rank drops
    its own positions. On the CPU, where `F.dropout` is x * (bernoulli(1 - p) / (1 - p)) with the same
    draws, a run drops exactly what plain tensor parallelism and one process drop; on CUDA `F.dropout`
    is a fused kernel with draws of its own, so the masks differ from theirs (and the part kept for
    backward is in x's dtype where the fused kernel keeps one byte per element)."""

    def __init__(self, p: float, switch: SequenceSplit) -> None:
        super().__init__()
        self.p, self.switch = p, switch

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and self.switch.active):
            return F.dropout(x, self.p, self.training)
        b, t, d = x.shape
        rank = self.switch.mesh.get_local_rank()
        whole = x.new_empty(b, t * self.switch.mesh.size(), d).bernoulli_(1 - self.p)
        return x * whole[:, rank * t : (rank + 1) * t].div(1 - self.p)  # a copy: only it is kept for backward

    def extra_repr(self) -> str:
        return f"p={self.p}"


def apply_sequence_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Hook every stack (a module with `blocks` and `final_norm`) of a tensor-parallel model whose
    row-split layers leave their outputs Partial (`parallelize.apply_tensor_parallel`)."""
    stacks = [m for m in model.modules() if isinstance(getattr(m, "blocks", None), nn.ModuleList)]
    norm_grads = NormGrads(mesh)
    for stack in stacks:
        switch = SequenceSplit(mesh)
        stack.blocks[0].register_forward_pre_hook(switch.split)
        stack.final_norm.register_forward_pre_hook(switch.gather)
        for block in stack.blocks:
            if isinstance(block.drop, nn.Dropout):
                block.drop = SplitDropout(block.drop.p, switch)
            for name in SUBLAYERS:
                if (sub := getattr(block, name, None)) is None:
                    continue
                if getattr(sub, "width_split", None) is not None:  # an MoE layer split by width:
                    sub.width_split.sequence = switch  # it gathers and reduce-scatters itself (expert_width)
                elif isinstance(
                    sub, MoE
                ):  # the same tokens on every rank of the group: whole in, this rank's out
                    sub.register_forward_pre_hook(switch.gather)
                    sub.register_forward_hook(switch.split_output)
                else:
                    sub.register_forward_pre_hook(switch.gather_input)
                    sub.register_forward_hook(switch.reduce_output)
                    sub.register_forward_hook(switch.end_sublayer, always_call=True)
            for name in NORMS:
                if (norm := getattr(block, name, None)) is not None:
                    distribute_module(norm, mesh, input_fn=switch.norm_input, output_fn=switch.norm_output)
                    for p in norm.parameters():
                        p.register_post_accumulate_grad_hook(norm_grads.accumulated)


class NormGrads:
    """The norm weights' gradients from a split sequence are each rank's partial sums (placement Partial):
    summed over the group at the end of each backward, so that clipping, the gradient norm and the
    optimizer read whole gradients. One all-reduce for all of them (they are d_model elements each, two
    or three per block: one collective each was latency, not bandwidth). Each gradient accumulated queues
    the reduction with the autograd engine, which runs its callbacks when backward ends: the first
    reduces everything pending, the others find nothing (no flag to go stale when a backward raises).
    `BUCKETED = False`: one all-reduce per parameter as it accumulates (the slow twin the tests compare
    against)."""

    BUCKETED = True

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.pending = mesh, []

    def accumulated(self, p: nn.Parameter) -> None:
        if p.grad.placements == p.placements:
            return
        if not self.BUCKETED:
            p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
            return
        self.pending.append(p)
        torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        """The pending gradients summed over the group in one all-reduce (in the gradients' dtype; mixed
        dtypes reduce in fp32)."""
        pending, self.pending = self.pending, []
        # each once, and only what is still partial (a backward that raised may have left some behind)
        pending = [
            p for p in dict.fromkeys(pending) if p.grad is not None and p.grad.placements != p.placements
        ]
        if not pending:
            return
        local = [p.grad.to_local() for p in pending]
        dtype = local[0].dtype if all(t.dtype == local[0].dtype for t in local) else torch.float32
        flat = torch.cat([t.reshape(-1).to(dtype) for t in local])
        dist.all_reduce(flat, group=self.mesh.get_group())
        for p, t, piece in zip(pending, local, flat.split([t.numel() for t in local])):
            whole = piece.view_as(t).to(t.dtype)
            p.grad = DTensor.from_local(whole, self.mesh, p.placements, run_check=False)
