"""Attention dropout under tensor parallelism: each rank drops its own heads' weights, as one process would.

The ranks of a tensor-parallel group draw from one RNG stream (they must: the replicated parts of the
model, residual dropout included, have to drop alike). Attention dropout inside each rank's fused kernel
would then drop the same positions in every rank's heads: rank 1's heads would copy rank 0's mask. Here
each attention's kernel is wrapped (`HeadSplitDropout`): in training it computes the rank's heads'
attention weights, draws the mask of *all* heads from the shared stream, and applies the rank's part,
as `SplitDropout` does for the residual stream over the sequence. On the CPU, where torch's attention
dropout (fused or not) is probs * (bernoulli(1 - p) / (1 - p)) over (B, H, Tq, Tk), every rank drops
exactly the positions one process drops in those heads. The price: the weights are materialised (the
eager kernel, (B, H / P, Tq, Tk) per rank as fp32) and each rank draws the whole mask, one byte per
weight of all H heads, for the time of the draw; outside training the wrapped fused kernel runs. (On
CUDA a run cannot match one process anyway: the fused kernels draw their own way.)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tformer.model.attention import Attention, attention_weights, repeat_kv
from tformer.model.masks import Mask


class HeadSplitDropout(nn.Module):
    """A tensor-parallel rank's attention kernel with dropout p over its n_heads / P heads."""

    def __init__(self, kernel: nn.Module, p: float, n_rep: int, mesh: DeviceMesh) -> None:
        super().__init__()
        self.kernel, self.p, self.n_rep, self.mesh = kernel, p, n_rep, mesh

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
        if not self.training:
            return self.kernel(q, k, v, mask)
        probs = attention_weights(q, repeat_kv(k, self.n_rep), mask)  # (B, H/P, Tq, Tk), fp32 until @ v
        b, h, tq, tk = probs.shape
        rank = self.mesh.get_local_rank()
        # every head's draw, one byte each (on the CPU the same positions and draws as a float mask)
        whole = torch.empty(b, h * self.mesh.size(), tq, tk, dtype=torch.bool, device=q.device)
        whole.bernoulli_(1 - self.p)
        keep = whole[:, rank * h : (rank + 1) * h].float().div_(1 - self.p)  # only this rank's part is kept
        return (probs * keep).to(v.dtype) @ repeat_kv(v, self.n_rep)  # (B, H/P, Tq, E)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def split_attention_dropout(model: nn.Module, mesh: DeviceMesh) -> None:
    """Wrap the kernel of every attention whose heads tensor parallelism split (a plan may leave some
    whole: their ranks hold the same heads and must drop alike), in a model with attention dropout."""
    p = model.cfg.attn_dropout
    for module in model.modules():
        if isinstance(module, Attention) and isinstance(module.q_proj.weight, DTensor):
            module.kernel = HeadSplitDropout(module.kernel, p, module.n_heads // module.n_kv_heads, mesh)
