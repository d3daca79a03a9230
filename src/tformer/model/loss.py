"""The output projection and the cross-entropy as one operation, a block of rows at a time.

A training step's head computes logits (N, V) = h (N, D) @ W (V, D)^T, their cross-entropy, and in the
backward the gradient of the logits, then grad h = G @ W and grad W = G^T @ h. Done by autograd, the
logits, their log-softmax and their gradient are N x V tensors (under autocast also an fp32 copy of the
bf16 logits): with a large vocabulary and many tokens per batch they are most of a step's memory.
`linear_cross_entropy` runs the same three products on BLOCK_ROWS rows at a time: each block's logits,
loss and logit gradient are made, used and dropped, and no N x V tensor exists. The loss is a scalar, so
the gradients are computed in the forward (for an upstream gradient of 1) and the backward only scales
them.

It saves memory, not time: the products are thinner and grad W is read and written once per block (under
autocast once more, to add each block's bf16 product into fp32). benchmarks/bench_loss.py, 2,048 tokens,
d_model 512, on a 2-core Xeon (AVX512, AMX), 2026-12-03: the peak bytes the head and loss make fall from
192 to 84 MiB (vocabulary 8,192) and 768 to 324 MiB (32,768) in fp32, 202 to 125 and 802 to 485 MiB under
bf16 autocast (none of the fused path's tensors grows with tokens x vocabulary, only with tokens x
d_model or vocabulary x d_model); its speed is the same in fp32 (1.01x, 0.99x) and lower under bf16
autocast (0.84x, 0.92x). So it is off unless a run asks for it (TrainConfig.fused_loss).

The slow twin is `linear_cross_entropy_reference` (F.linear + F.cross_entropy on fp32 logits, what the
task losses compute from a model's logits); tests/model/test_loss.py holds the two equal in fp32 and
under bf16 autocast, with label smoothing and ignored positions, and through a model's backward.

Same arithmetic as the twin: the product in the autocast dtype when autocast is on (else in the
weight's dtype), the softmax in fp32. Label smoothing eps as torch's: the target's weight is 1 - eps and
every class's eps / V. Positions holding `ignore_index` add nothing to the loss or the gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # torch's default ignore_index; tformer.data.datasets pads targets with it
BLOCK_ROWS = 1024  # rows of logits made at a time (fewer: thinner products and more passes over grad W)


def block_rows(n_rows: int) -> int:
    """Rows per block: BLOCK_ROWS, or all of them when there are fewer."""
    return max(1, min(n_rows, BLOCK_ROWS))


def _blocks(
    h: Tensor, weight: Tensor, targets: Tensor, eps: float, dtype: torch.dtype, need_h: bool, need_w: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(summed loss, grad h, grad W) for an upstream gradient of 1, a block of rows at a time; a gradient
    nobody needs is neither made nor computed (without either, one product per block)."""
    n, v = h.shape[0], weight.shape[0]
    w = weight.to(dtype)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0).unsqueeze(1)  # (N, 1): ignored rows gather class 0, weight 0
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    rows = block_rows(n)
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, n, rows):
            end = min(n, start + rows)
            hb, tb, ok = h[start:end].to(dtype), safe[start:end], valid[start:end]
            z = (hb @ w.t()).float()  # (rows, V) logits
            lse = torch.logsumexp(z, dim=1)
            per_row = lse - (1 - eps) * z.gather(1, tb).squeeze(1)
            if eps:
                per_row = per_row - eps * z.mean(dim=1)
            loss += torch.where(ok, per_row, 0.0).sum()
            if not (need_h or need_w):
                continue
            # d loss / d z = softmax(z) - (1 - eps) * onehot(target) - eps / V; 0 on ignored rows
            shift = torch.where(ok, lse, torch.inf).unsqueeze(1)
            g = z.sub_(shift).exp_()
            if eps:
                g.sub_(torch.where(ok, eps / v, 0.0).unsqueeze(1))
            g.scatter_add_(1, tb, torch.where(ok, eps - 1.0, 0.0).unsqueeze(1))
            gb = g.to(dtype)
            if need_h:
                grad_h[start:end] = gb @ w
            if need_w:
                if dtype == torch.float32:
                    grad_w.addmm_(gb.t(), hb)
                else:
                    grad_w += gb.t() @ hb
    return loss, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: D102
        ctx, h: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float, dtype: torch.dtype
    ) -> Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_h, grad_w = _blocks(h, weight, targets, label_smoothing, dtype, need_h, need_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        if torch.is_grad_enabled():  # create_graph=True: the saved gradients are constants, not a graph
            raise RuntimeError(
                "linear_cross_entropy (fused_loss) has no second derivative: for a gradient penalty or "
                "create_graph=True, take the logits (model(...) without targets) and torch's cross-entropy"
            )
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None


@torch.compiler.disable  # the loop over blocks would tie a compiled graph to one token count
def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """sum over positions of cross_entropy(h @ weight.T, targets), in fp32, without an N x V tensor.

    h (..., D) float, weight (V, D), targets (...) int64 in [0, V) or IGNORE_INDEX (checked by the caller:
    tformer.model.checks.check_targets). Without gradients (no_grad, or neither h nor weight requiring
    them) only the loss is computed. Under torch.compile it runs eagerly, between the compiled graphs."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    flat, targets, eps = h.reshape(-1, h.shape[-1]), targets.reshape(-1), float(label_smoothing)
    if not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
        return _blocks(flat, weight, targets, eps, dtype, need_h=False, need_w=False)[0]
    return _LinearCrossEntropy.apply(flat, weight, targets, eps, dtype)


def linear_cross_entropy_reference(
    h: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float = 0.0
) -> Tensor:
    """The slow twin of `linear_cross_entropy`: the logits as a tensor, then torch's cross-entropy."""
    logits = F.linear(h, weight)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing,
    )
