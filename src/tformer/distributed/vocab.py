"""The LM head split by vocabulary under tensor parallelism, and the cross-entropy that reads its logits
split (Megatron-LM's vocabulary-parallel cross-entropy, with label smoothing).

Each rank of a tensor-parallel group of P holds V / P rows of the head's weight and computes the logits
of its V / P vocabulary entries. Outside a training step (evaluation, generation, a user's forward) the
head all-gathers them: callers get whole (B, T, V) logits, as from one process. Inside a training
step's micro-batch (`LogitSplit.keep`, entered by the trainer's collectives) the head hands back its
split logits as a DTensor, and `cross_entropy_sum` computes the loss from the pieces: per row three
numbers cross the group (the sum of exp, the target's logit, the sum of logits for smoothing) after a
max, instead of the (B, T, V) logits, and each rank keeps only its (B, T, V / P) softmax for backward,
which needs no communication. torch's `loss_parallel` does the same for plain cross-entropy but takes
no label smoothing, which the translation presets train with.

For a row with target t, logits z over V entries, m = max z, lse = m + log sum exp(z - m):
    loss = (1 - eps) (lse - z_t) + eps (lse - mean z)          (eps: label smoothing; rows ignored: 0)
    d loss / d z = softmax(z) - (1 - eps) onehot(t) - eps / V
which is `F.cross_entropy(..., label_smoothing=eps, ignore_index=..., reduction="sum")` term by term.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

VOCAB = Shard(-1)


@dataclass
class LogitSplit:
    """Whether the head's logits stay split by vocabulary in the forward running now."""

    active: bool = False

    @contextlib.contextmanager
    def keep(self) -> Iterator[None]:
        """Within: the head returns its logits as a DTensor split by vocabulary (for `cross_entropy_sum`)."""
        self.active, before = True, self.active
        try:
            yield
        finally:
            self.active = before

    def output_hook(self, module: nn.Module, args, out: DTensor) -> Tensor | DTensor:
        return out if self.active else out.redistribute(out.device_mesh, [Replicate()]).to_local()


def split_head(head: nn.Module, mesh: DeviceMesh) -> LogitSplit:
    """Split `head` (a Linear from d_model to V) over `mesh` by vocabulary; its logits gathered unless the
    returned switch keeps them split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(head, mesh, ColwiseParallel(output_layouts=VOCAB, use_local_output=False))
    split = LogitSplit()
    head.register_forward_hook(split.output_hook)  # after ColwiseParallel's own output hook
    return split


def vocab_range(logits: DTensor) -> tuple[int, int]:
    """(first vocabulary id, count) of this rank's piece: DTensor's Shard splits like torch.chunk."""
    mesh, vocab, (placement,) = logits.device_mesh, logits.shape[-1], logits.placements
    if not (isinstance(placement, Shard) and placement.dim % logits.ndim == logits.ndim - 1):
        raise ValueError(f"vocabulary-split logits must be Shard(-1) on a 1-D mesh, got {logits.placements}")
    chunk = -(-vocab // mesh.size())
    start = min(mesh.get_local_rank() * chunk, vocab)
    count = logits.to_local().shape[-1]
    if count != min(chunk, vocab - start):
        raise ValueError(
            f"this rank holds {count} of {vocab} logits, where torch.chunk would give it {chunk}"
        )
    return start, count


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy over rows whose logits are split by vocabulary over `group`."""

    @staticmethod
    def forward(ctx, local, targets, start, vocab, smoothing, ignore_index, group):  # noqa: PLR0913
        # local (N, V_r) fp32: this rank's logits of ids [start, start + V_r) (V_r may be 0); targets (N,)
        n, count = local.shape
        m = local.amax(dim=-1) if count else local.new_full((n,), -torch.inf)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = local - m.unsqueeze(1)  # (N, V_r)
        own = (targets >= start) & (targets < start + count)  # (N,) the target is in this piece
        idx = torch.where(own, targets - start, 0)
        picked = shifted.gather(1, idx.unsqueeze(1)).squeeze(1) if count else shifted.new_zeros(n)
        zeros = shifted.new_zeros(n)
        sums = torch.stack(
            [
                shifted.exp().sum(dim=-1),  # sum of exp
                torch.where(own, picked, zeros),  # the target's (shifted) logit (a -inf elsewhere stays out)
                shifted.sum(dim=-1) if smoothing else zeros,  # sum of (shifted) logits, for smoothing
            ]
        )  # (3, N)
        dist.all_reduce(sums, group=group)
        lse = sums[0].log()  # relative to m
        per_row = lse - sums[1]
        if smoothing:  # (without it a -inf logit would give 0 * inf)
            per_row = (1 - smoothing) * per_row + smoothing * (lse - sums[2] / vocab)
        valid = targets != ignore_index
        softmax = (shifted - lse.unsqueeze(1)).exp_()  # (N, V_r)
        ctx.save_for_backward(softmax, idx, own, valid)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return torch.where(valid, per_row, 0).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        """In place on the saved softmax: a second backward through the same graph (retain_graph) is
        refused by autograd's in-place check instead of computing from a changed tensor."""
        softmax, idx, own, valid = ctx.saved_tensors
        d = softmax.sub_(ctx.smoothing / ctx.vocab)
        if d.shape[1]:
            d.scatter_add_(1, idx.unsqueeze(1), (-(1 - ctx.smoothing) * own).to(d.dtype).unsqueeze(1))
        d.mul_((grad * valid).unsqueeze(1))
        return d, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: DTensor, targets: Tensor, label_smoothing: float, ignore_index: int
) -> Tensor:
    """sum over rows of cross-entropy(logits[row], targets[row]) for logits (..., V) split by vocabulary
    (Shard(-1) DTensor) and targets (...); the same plain scalar on every rank of the group. fp32."""
    start, count = vocab_range(logits)
    local = logits.to_local().float().reshape(targets.numel(), count)  # the gradient goes back as a DTensor
    group = logits.device_mesh.get_group()
    return VocabParallelCrossEntropy.apply(
        local, targets.reshape(-1), start, logits.shape[-1], label_smoothing, ignore_index, group
    )
